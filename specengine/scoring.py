"""Teacher-forced scoring (``LLM.score``): the logprobs of given completions.

For each prompt and completion (token ids, as ``CompletionOutput.token_ids``), one prefill of
the prompt and all completion tokens but the last gives the logits before every completion
token; each goes through generation's own pipeline (``min_tokens`` mask, penalties,
temperature / top-k / top-p / min-p with the params the completion was sampled with). With
batch invariance on (the default, ``kernels.set_batch_invariant``), the values equal bit for
bit the logprobs ``generate`` returned for those tokens, with or without speculation, whatever
the batch (``SamplingParams.prompt_logprobs`` is the same computation over the prompt)."""

from __future__ import annotations

from tqdm.auto import tqdm

from specengine.engine.outputs import ScoreOutput
from specengine.engine.sequence import ScoreSpec
from specengine.prompts import check_logprobs, to_token_ids
from specengine.sampling.params import SamplingParams


def score_completions(engine, tokenizer, max_logprobs: int, prompts: list,
                      completions: list[list[int]], params: list[SamplingParams],
                      logprobs: int | None, use_tqdm: bool = False) -> list[ScoreOutput]:
    """``LLM.score`` once its prompts and params are paired up (``per_prompt``): check
    everything (``logprobs`` against ``max_logprobs``, each prompt and completion), then
    run (``run_scoring``). Returns one ``ScoreOutput`` per prompt.

    Raises:
        ValueError: as ``score_specs`` and ``prompts.to_token_ids``; nothing is run then.
    """
    check_logprobs(SamplingParams(logprobs=logprobs), max_logprobs, "score")
    tokenized = [to_token_ids(p, i, tokenizer) for i, p in enumerate(prompts)]
    specs = score_specs(engine, tokenized, completions, params, logprobs)
    return run_scoring(engine, tokenized, specs, logprobs, use_tqdm)


def score_specs(engine, tokenized: list[tuple[str | None, list[int]]],
                completions: list[list[int]], params: list[SamplingParams],
                logprobs: int | None) -> list[ScoreSpec]:
    """One ``ScoreSpec`` per (prompt, completion), every one checked before anything runs.

    Args:
        engine: the ``Engine`` (its ``validate_prompt`` checks prompt + completion).
        tokenized: ``(text, token ids)`` per prompt. completions: token ids per prompt.
        params: the sampling params per prompt. logprobs: top entries per token, or None.

    Raises:
        ValueError: a completion that is not a list of ints; a prompt + completion the engine
            refuses (too long, ids outside the vocabulary).
    """
    specs = []
    for i, ((_, ids), comp, p) in enumerate(zip(tokenized, completions, params)):
        if not isinstance(comp, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in comp):
            raise ValueError(f"completions[{i}] must be a list of token ids")
        engine.validate_prompt(ids + list(comp)[:-1], f"prompt {i} + completion")
        specs.append(ScoreSpec(len(ids), list(comp), p, logprobs))
    return specs


def run_scoring(engine, tokenized: list[tuple[str | None, list[int]]], specs: list[ScoreSpec],
                logprobs: int | None, use_tqdm: bool = False) -> list[ScoreOutput]:
    """Run one greedy one-token request per non-empty completion (its prompt and all its
    tokens but the last; the ``ScoreSpec`` collects the logprobs), to the end; every request
    of the engine is aborted afterwards (also after an error). Returns one ``ScoreOutput``
    per prompt, in order (``entries`` only when ``logprobs`` is not None)."""
    greedy = SamplingParams(temperature=0, max_tokens=1)
    index = {}
    try:
        for i, ((_, ids), spec) in enumerate(zip(tokenized, specs)):
            if spec.completion:
                rid = engine.add_request(ids + spec.completion[:-1], greedy, score=spec)
                index[rid] = i
        with tqdm(total=len(index), desc="score", disable=not use_tqdm) as bar:
            while engine.has_unfinished():
                bar.update(len(engine.step()))
    finally:
        engine.abort_all()
    return [ScoreOutput(ids, s.completion, s.raw or [], s.processed or [],
                        s.entries if logprobs is not None else None)
            for (_, ids), s in zip(tokenized, specs)]
