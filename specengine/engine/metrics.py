"""Accounting: the timestamps of a step's phases, the engine's counters, the per-sequence
counters behind each request's metrics, and the ``StepRecord`` a policy learns from."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specengine.engine.sequence import Request
from specengine.engine.step import Commit, ForwardLayout
from specengine.speculative.policy import StepRecord
from specengine.speculative.sources import SourceStats
from specengine.speculative.strategy import Strategy


@dataclass
class StepTimes:
    """``time.perf_counter()`` marks (seconds) of one step: its start and the end of each phase
    before the tokens are appended."""

    start: float = field(default_factory=time.perf_counter)
    drafted: float = 0.0
    forwarded: float = 0.0
    sampled: float = 0.0  # sampled / verified, KV committed: the tokens' time
    thread_probe: bool = False  # the kernels ran at a count being probed (``ThreadTuner``)
    observe_time: float = 0.0  # seconds of the sampled phase spent in ``phases.observe``

    def mark(self, phase: str) -> None:
        """Stamp the end of ``phase`` (``"drafted"``, ``"forwarded"`` or ``"sampled"``)."""
        setattr(self, phase, time.perf_counter())

    @property
    def draft_time(self) -> float:
        return self.drafted - self.start

    @property
    def forward_time(self) -> float:
        return self.forwarded - self.drafted

    @property
    def sample_time(self) -> float:
        return self.sampled - self.forwarded


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
    sources: SourceStats = field(default_factory=SourceStats)

    def as_dict(self) -> dict:
        """Counters plus derived ``acceptance_length`` (tau: tokens committed per verify
        forward, the bonus token included), ``acceptance_rate_per_depth`` and
        ``source_stats`` (per draft source: ``SourceStats.as_dict``)."""
        d = {k: v for k, v in self.__dict__.items() if k not in ("extra", "sources")}
        if self.spec_steps:
            d["source_stats"] = self.sources.as_dict()
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

    def record_step(self, layout: ForwardLayout, commits: list[Commit], times: StepTimes,
                    num_appended: int, preemptions: int) -> None:
        """Count one step: its verified trees, ``num_appended`` tokens appended, prompt tokens,
        the phases' seconds (the forward as prefill time when it held prompt tokens, else as
        decode time) and the scheduler's preemptions so far."""
        for c in commits:
            if c.is_verified:
                self.spec_steps += 1
                self.drafted_tokens += c.entry.tree.num_nodes
                self.accepted_tokens += len(c.accepted)
                self.sources.record(c.entry.tree, c.accepted)
                for d in range(len(c.accepted)):
                    self.accepted_per_depth[d] = self.accepted_per_depth.get(d, 0) + 1
        self.generated_tokens += num_appended
        self.steps += 1
        num_prefill = layout.num_prefill_tokens
        self.prefill_tokens += num_prefill
        if num_prefill:
            self.prefill_time += times.forward_time
        else:
            self.decode_time += times.forward_time
            self.decode_steps += 1
        self.draft_time += times.draft_time
        self.sample_time += times.sample_time
        self.preemptions = preemptions


def record_sequences(layout: ForwardLayout, commits: list[Commit]) -> None:
    """Count, on each sequence, the target forward it took part in and its verified tree (the
    counters ``request_metrics`` sums), and mark how far the drafter has seen a sequence it
    drafted for (``Sequence.drafted_through``; run after the step's tokens are appended)."""
    for e in layout.entries:
        for s in e.samplers:
            s.num_forwards += 1
        if e.drafted:
            e.seq.drafted_through = len(e.seq.token_ids)
    for c in commits:
        if c.is_verified:
            c.seq.spec_stats(c.entry.tree.num_nodes, len(c.accepted))


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


def step_record(layout: ForwardLayout, commits: list[Commit], strategy: Strategy | None,
                times: StepTimes, num_proposed: int | None, catch_up: int = 0) -> StepRecord:
    """What the step did and cost, for the policy (``other_time`` runs until now)."""
    decodes = layout.decodes
    verified = [c for c in commits if c.is_verified]
    return StepRecord(
        strategy=strategy, num_decode=len(decodes), num_prefill_tokens=layout.num_prefill_tokens,
        num_forward_tokens=layout.num_tokens,
        context_tokens=sum(e.seq.num_cached for e in decodes),
        num_drafted=sum(e.tree.num_nodes for e in decodes if e.tree is not None),
        num_committed=len(decodes) + sum(len(c.accepted) for c in verified),
        accepted_per_seq=[len(c.accepted) for c in verified],
        draft_time=times.draft_time, forward_time=times.forward_time,
        other_time=time.perf_counter() - times.forwarded,
        verified=[(c.seq, c.entry.tree, c.accepted) for c in verified],
        num_proposed=num_proposed, num_catch_up=catch_up, thread_probe=times.thread_probe,
        observe_time=times.observe_time)
