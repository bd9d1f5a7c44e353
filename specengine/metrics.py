"""Accounting: the engine's counters and each request's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from specengine.sequence import Request


@dataclass
class EngineMetrics:
    """Counters since the engine started (tokens, steps, seconds)."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    sample_time: float = 0.0
    preemptions: int = 0
    decode_steps: int = 0
    draft_time: float = 0.0
    spec_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_depth: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Counters plus derived ``acceptance_length`` (tau: tokens committed per verify
        forward, the bonus token included) and ``acceptance_rate_per_depth``."""
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        if self.spec_steps:
            d["acceptance_length"] = (self.accepted_tokens + self.spec_steps) / self.spec_steps
            d["acceptance_rate_per_depth"] = [
                self.accepted_per_depth.get(i, 0) / self.spec_steps
                for i in range(max(self.accepted_per_depth, default=-1) + 1)]
        d.update(self.extra)
        return d

    def record_request(self, num_prompt_tokens: int) -> None:
        """Count one admitted request."""
        self.requests += 1
        self.prompt_tokens += num_prompt_tokens


def request_metrics(req: Request, now: float) -> dict:
    """A finished request's metrics (vLLM-like; seconds from ``time.perf_counter``, tokens):
    arrival, first token and finish times, prompt and generated tokens, target forwards, and
    over its verify steps the drafted and accepted tokens, ``acceptance_length`` and
    ``acceptance_rate_per_depth``."""
    seqs = req.seqs
    spec_steps = sum(s.num_spec_steps for s in seqs)
    depth = max((len(s.accepted_per_depth) for s in seqs), default=0)
    metrics = {
        "arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
        "finished_time": now, "num_prompt_tokens": len(req.prompt_token_ids),
        "num_generated_tokens": sum(s.num_output_tokens for s in seqs),
        "target_forwards": sum(s.num_forwards for s in seqs),
        "spec_steps": spec_steps,
        "drafted_tokens": sum(s.num_drafted for s in seqs),
        "accepted_tokens": sum(s.num_accepted for s in seqs)}
    if spec_steps:
        metrics["acceptance_length"] = (metrics["accepted_tokens"] + spec_steps) / spec_steps
        metrics["acceptance_rate_per_depth"] = [
            sum(s.accepted_per_depth[d] for s in seqs if d < len(s.accepted_per_depth))
            / spec_steps for d in range(depth)]
    return metrics
