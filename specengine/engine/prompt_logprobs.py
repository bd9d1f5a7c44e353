"""Logits of every prompt position, for the first prefill of a request that needs them:
``prompt_logprobs`` entries, and the teacher-forced completion logprobs of an ``LLM.score``
request or of a continued sample's partial output (``fill_prompt_logprobs``)."""

from __future__ import annotations

import torch

from specengine.engine.sequence import Request, Sequence
from specengine.engine.step import ForwardLayout
from specengine.sampling.sampler import Sampler

PROMPT_ROWS = 256  # logits rows computed at once for prompt logprobs and scores


def fill_prompt_logprobs(requests: dict[str, Request], layout: ForwardLayout,
                         hidden: torch.Tensor, model, sampler: Sampler) -> None:
    """The first prefill of a request that asks for them computes the logits of every
    prompt position, ``PROMPT_ROWS`` rows at a time (bounded memory; the rows of a
    batch-invariant forward do not depend on the grouping): ``prompt_logprobs``
    entries (``Sampler.prompt_rows``), and the completion logprobs of an ``LLM.score``
    request or of a continued sample's partial output (``Sampler.score_rows``; the
    latter become the sample's own logprobs)."""
    for i, e in enumerate(layout.entries):
        req = requests.get(e.seq.request_id)
        if (not e.is_prefill or req is None or e.seq.num_cached
                or (req.params.prompt_logprobs is None and req.score is None)
                or req.prompt_logprobs is not None):
            continue
        ids, off, spec = e.seq.token_ids, layout.token_offsets[i], req.score
        prompt_rows = len(req.prompt_token_ids) - 1 if req.params.prompt_logprobs is not None \
            else 0
        entries: list = [None]
        first, end = prompt_rows, prompt_rows  # rows scored: [first, end)
        if spec is not None:
            spec.raw, spec.processed, spec.entries = [], [], []
            context = Sequence(req.request_id, 0, ids[:spec.prompt_len], spec.params, None)
            first = spec.prompt_len - 1
            end = first + len(spec.completion)
        for a in range(0, max(prompt_rows, end), PROMPT_ROWS):
            b = min(a + PROMPT_ROWS, max(prompt_rows, end))
            logits = model.compute_logits(hidden[off + a:off + b]).cpu()
            if a < prompt_rows:
                rows = min(b, prompt_rows) - a
                entries += sampler.prompt_rows(logits[:rows], req.params,
                                                    ids[a + 1:a + 1 + rows])
            if spec is not None and b > first:
                j0 = max(a, first)
                raw, proc, ents = sampler.score_rows(
                    logits[j0 - a:], context, spec.completion, j0 - first, spec.logprobs)
                spec.raw += raw
                spec.processed += proc
                spec.entries += ents
        req.prompt_logprobs = entries if req.params.prompt_logprobs is not None else []
        if spec is not None and spec.into_sample and e.seq.logprobs is not None:
            e.seq.logprobs = list(spec.entries)  # a continued sample's partial output
            e.seq.cumulative_logprob = sum(lp[t].logprob for lp, t in
                                           zip(spec.entries, spec.completion))
