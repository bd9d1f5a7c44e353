"""Results of ``LLM.generate`` with vLLM's names: ``RequestOutput`` holds ``CompletionOutput``s."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specengine.engine.sequence import Logprob, Request


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index in ``0 .. n-1``.
        text: generated text (stop strings cut as vLLM does).
        token_ids: generated token ids (a stop token or EOS that ended the sample is included).
        logprobs: per generated token, ``{token_id: Logprob}`` with the sampled token and the
            top-``logprobs`` tokens; None when ``SamplingParams.logprobs`` is None.
        cumulative_logprob: sum of the sampled tokens' log-probabilities (None without logprobs).
        finish_reason: ``"stop"`` (EOS, stop token or stop string) or ``"length"``.
        stop_reason: the stop string or stop token id that ended it; None for EOS or length.
        weight_versions: per generated token, the weight version of the target that sampled
            it (AReaL's per-token policy version; differs within a sample only when the
            weights were updated while it ran).
        hidden_states: with ``SamplingParams.return_hidden_states``, the target's last hidden
            states (after the final norm, the model's dtype, CPU) ``[len(token_ids), H]``: row
            j is the state at the position before token j, whose logits produced it (the last
            prompt token's for j = 0); under speculation, the verify rows of the accepted
            tree nodes. None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    hidden_states: torch.Tensor | None = None
    weight_versions: list[int] = field(default_factory=list)

    @property
    def sampled_logprobs(self) -> list[float] | None:
        """Per generated token, the log-probability of the token that was sampled (what RL
        importance sampling reads: vLLM ``logprobs=0``); None without logprobs."""
        if self.logprobs is None:
            return None
        return [lp[t].logprob for t, lp in zip(self.token_ids, self.logprobs)]


@dataclass
class RequestOutput:
    """All samples of one prompt, plus the request's timing metrics (seconds, tokens).

    ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, one ``{token_id:
    Logprob}`` per prompt token (the prompt token's and the top ones; None for the first
    token), as vLLM; else None.

    ``weight_version``: the version of the target's weights that generated it (0: as loaded;
    +1 per weight update, see ``LLM.weight_version``; updates wait for requests to finish, so
    one version produced the whole request).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = field(default_factory=dict)
    weight_version: int | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def request_output(req: Request, metrics: dict, weight_version: int | None = None
                   ) -> RequestOutput:
    """The finished ``req`` as a ``RequestOutput``: one ``CompletionOutput`` per sample, in
    sample order, the request's ``metrics`` and the target ``weight_version`` that produced it."""
    outs = [CompletionOutput(
        index=s.index, text=s.text, token_ids=s.output_token_ids, logprobs=s.logprobs,
        cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
        finish_reason=s.finish_reason, stop_reason=s.stop_reason,
        hidden_states=None if s.hidden_states is None else _stack(s.hidden_states),
        weight_versions=s.weight_versions[:len(s.output_token_ids)])
        for s in req.seqs]
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True, metrics,
                         weight_version=weight_version,
                         prompt_logprobs=req.prompt_logprobs
                         if req.params.prompt_logprobs is not None else None)


def _stack(chunks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(chunks) if chunks else torch.empty(0, 0)


@dataclass
class ScoreOutput:
    """``LLM.score``'s result for one prompt and completion.

    Attributes:
        prompt_token_ids, token_ids: the prompt and the completion scored.
        logprobs: per completion token, its raw log-probability (``log_softmax`` of the
            model's float32 logits, before temperature and filters).
        processed_logprobs: per completion token, its log-probability under the distribution
            sampled from (after the ``min_tokens`` mask, penalties, temperature, top-k, top-p,
            min-p of the params given).
        top_logprobs: with ``score(logprobs=k)``, per token ``{token_id: Logprob}`` as
            ``CompletionOutput.logprobs`` (the engine's ``logprobs_mode``); else None.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    processed_logprobs: list[float]
    top_logprobs: list[dict[int, Logprob]] | None = None


def continuation_prompts(output: RequestOutput) -> list[dict]:
    """Prompts that continue the samples of ``output`` cut short (``finish_reason ==
    "abort"``), one per sample, for ``LLM.generate`` / ``add_request`` with the request's
    sampling params (same seed): ``{"prompt_token_ids", "partial": {"token_ids", "index",
    "weight_versions"}}``. With unchanged weights each continued sample equals the one that
    was never interrupted (APRIL's recycled partial rollouts, exactly)."""
    return [{"prompt": output.prompt, "prompt_token_ids": list(output.prompt_token_ids),
             "partial": {"token_ids": list(c.token_ids), "index": c.index,
                         "weight_versions": list(c.weight_versions)}}
            for c in output.outputs if c.finish_reason == "abort"]
