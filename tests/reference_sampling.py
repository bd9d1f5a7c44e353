"""Sampling in the forms the tests call: per-call wrappers of the batched code, and the per-row
sampling the engine did before ``specengine.sampling.batched``.

- ``process_logits`` / ``top_p_`` / ``sample``: the processing and draw of given rows through
  ``specengine.sampling.batched`` (``process_rows``, ``top_p_rows_``, ``draw``), one call each;
  the engine's ``Sampler`` calls those directly.
- ``process_logits_per_row`` / ``top_p_per_row_`` / ``sample_per_row``: the per-row loops of
  ``specengine.sampling.params`` at commit aa405da (there named ``process_logits`` / ``top_p_`` /
  ``sample``), the reference the batched code must match bit for bit (``test_batch_sampling.py``)
  and the "before" of ``bench/bench_sampling.py``; ``sampler_sample`` / ``sampler_verify`` are
  ``Sampler.sample`` / ``Sampler.verify`` of that commit over them, each noise row drawn by its
  own extension call.
"""

from __future__ import annotations

import torch
from reference_verify import verify_coupled, verify_greedy

from specengine.engine.sequence import Sequence
from specengine.sampling.batched import draw, process_rows, softmax_rows, top_p_rows_
from specengine.sampling.params import SamplingParams, noise_rows
from specengine.sampling.verify import committed_tokens
from specengine.speculative.tree import DraftTree

TOP_P_WINDOW = 256


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p per row, all rows batched
    (``batched.process_rows``).

    Args:
        logits: ``[B, V]`` float32 (already masked for ``min_tokens``); not modified.
        params: one SamplingParams per row.

    Returns:
        ``[B, V]`` float32 logits where filtered tokens are ``-inf`` (a new tensor). Greedy
        rows are returned unchanged (temperature is not applied to them).
    """
    return process_rows(logits, params)


def top_p_(row: torch.Tensor, top_p: float) -> None:
    """Nucleus filtering of one row of logits ``[V]`` in place: a token is dropped when the
    probability mass of the tokens before it (most likely first) already reaches ``top_p``; the
    most likely token always stays (``batched.top_p_rows_`` of one row)."""
    top_p_rows_(row[None], torch.tensor([top_p], dtype=torch.float32))


def sample(processed: torch.Tensor, params: list[SamplingParams],
           noise: list[torch.Tensor | None]) -> torch.Tensor:
    """Pick one token per row: argmax for greedy rows, else ``argmax(softmax(row) / E)``, an
    exact draw from ``softmax(row)`` given exponential noise ``E`` (the exponential race); all
    rows batched (``batched.draw``).

    Args:
        processed: ``[B, V]`` float32 output of ``process_logits``.
        params: one per row. noise: per row ``[V]`` float32 ``Exp(1)`` noise (``SampleNoise``
            of the row's sample at its output position); ignored for greedy rows.

    Returns:
        ``[B]`` int64 token ids.
    """
    rows = [e for e, p in zip(noise, params) if not p.greedy]
    return draw(processed, params, torch.stack(rows) if rows else None)


def process_logits_per_row(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, one row at a time (``[B, V]`` float32 in and out)."""
    out = logits.clone()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = out[i]
        if p.temperature != 1.0:
            row.div_(p.temperature)
        top_k = p.top_k if p.top_k > 0 else 0
        if top_k and top_k < row.numel():
            kth = torch.topk(row, top_k).values[-1]
            row.masked_fill_(row < kth, float("-inf"))
        if p.top_p < 1.0:
            top_p_per_row_(row, p.top_p)
        if p.min_p > 0.0:
            probs = torch.softmax(row, -1)
            row.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))
    return out


def top_p_per_row_(row: torch.Tensor, top_p: float) -> None:
    """Nucleus filtering of one row ``[V]`` in place (window top-k, full sort when wider)."""
    probs = torch.softmax(row, -1)
    w = min(TOP_P_WINDOW, row.numel())
    vals, idx = torch.topk(probs, w)
    before = vals.cumsum(0) - vals
    if w < row.numel() and before[-1] < top_p:  # the nucleus reaches past the window
        vals, idx = torch.sort(probs, descending=True)
        before = vals.cumsum(0) - vals
    keep = before < top_p
    keep[0] = True
    kept = idx[keep]
    saved = row[kept]
    row.fill_(float("-inf"))
    row[kept] = saved


def sample_per_row(processed: torch.Tensor, params: list[SamplingParams],
                   noise: list[torch.Tensor | None]) -> torch.Tensor:
    """Argmax for greedy rows, else ``argmax(softmax(row) / E)``, one row at a time."""
    tokens = torch.argmax(processed, dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = torch.argmax(softmax_rows(processed[i][None])[0] / noise[i])
    return tokens


def noise(seq: Sequence, position: int, vocab: int) -> torch.Tensor:
    """``[vocab]`` noise of ``seq`` at ``position``: one ``exponential_noise`` call, no cache."""
    return noise_rows(seq.noise.key, [position], vocab)[0]


def sampler_sample(sampler, logits: torch.Tensor, seqs: list[Sequence]):
    """``Sampler.sample`` per row: ``(tokens, entries)``."""
    masked = sampler.mask_stop_ids(logits, seqs, [s.num_output_tokens for s in seqs])
    params = [s.params for s in seqs]
    processed = (masked if all(p.greedy for p in params)
                 else process_logits_per_row(masked, params))
    vocab = logits.shape[1]
    rows = [None if p.greedy else noise(s, s.num_output_tokens, vocab)
            for s, p in zip(seqs, params)]
    tokens = sample_per_row(processed, params, rows).tolist()
    return tokens, sampler.logprob_entries(logits, masked, params, list(range(len(seqs))),
                                           tokens, processed)


def verify(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
           noise_rows_: torch.Tensor | None) -> tuple[list[int], int]:
    """``reference_verify.verify`` over ``process_logits_per_row``."""
    if params.greedy:
        return verify_greedy(tree, target_logits)
    probs = softmax_rows(process_logits_per_row(target_logits,
                                                [params] * target_logits.shape[0]))
    return verify_coupled(tree, probs, noise_rows_)


def sampler_verify(sampler, seq: Sequence, tree: DraftTree, logits: torch.Tensor):
    """``Sampler.verify`` with one noise call per depth: ``(accepted, tokens, entries)``."""
    p, n_out = seq.params, seq.num_output_tokens
    depths = [0] + tree.depths
    masked = sampler.mask_stop_ids(logits, [seq] * len(depths), [n_out + d for d in depths])
    rows = None if p.greedy else torch.stack(
        [noise(seq, n_out + d, logits.shape[1]) for d in range(tree.max_depth + 1)])
    accepted, bonus = verify(tree, masked, p, rows)
    tokens = committed_tokens(tree, accepted, bonus)
    kept = [0] + [1 + a for a in accepted]
    return accepted, tokens, sampler.logprob_entries(logits, masked, [p] * len(depths), kept,
                                                     tokens)
