"""Per-row sampling, as the engine did it before ``specengine.sampling.batched``: the reference the
batched code must match bit for bit (``test_batch_sampling.py``) and the "before" of
``bench/bench_sampling.py``.

``process_logits`` / ``top_p_`` / ``sample`` are the per-row loops of ``specengine.sampling.params``
at commit aa405da, verbatim; ``sampler_sample`` / ``sampler_verify`` are ``Sampler.sample`` /
``Sampler.verify`` of that commit over them, each noise row drawn by its own extension call.
"""

from __future__ import annotations

import torch

from specengine.engine.sequence import Sequence
from specengine.sampling.params import SamplingParams, noise_rows
from specengine.speculative.tree import DraftTree
from specengine.speculative.verify import committed_tokens, verify_coupled, verify_greedy

TOP_P_WINDOW = 256


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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
            top_p_(row, p.top_p)
        if p.min_p > 0.0:
            probs = torch.softmax(row, -1)
            row.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))
    return out


def top_p_(row: torch.Tensor, top_p: float) -> None:
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


def sample(processed: torch.Tensor, params: list[SamplingParams],
           noise: list[torch.Tensor | None]) -> torch.Tensor:
    """Argmax for greedy rows, else ``argmax(softmax(row) / E)``, one row at a time."""
    tokens = torch.argmax(processed, dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = torch.argmax(torch.softmax(processed[i], -1) / noise[i])
    return tokens


def noise(seq: Sequence, position: int, vocab: int) -> torch.Tensor:
    """``[vocab]`` noise of ``seq`` at ``position``: one ``exponential_noise`` call, no cache."""
    return noise_rows(seq.noise.key, [position], vocab)[0]


def sampler_sample(sampler, logits: torch.Tensor, seqs: list[Sequence]):
    """``Sampler.sample`` per row: ``(tokens, entries)``."""
    masked = sampler.mask_stop_ids(logits, seqs, [s.num_output_tokens for s in seqs])
    params = [s.params for s in seqs]
    processed = masked if all(p.greedy for p in params) else process_logits(masked, params)
    vocab = logits.shape[1]
    rows = [None if p.greedy else noise(s, s.num_output_tokens, vocab)
            for s, p in zip(seqs, params)]
    tokens = sample(processed, params, rows).tolist()
    return tokens, sampler.logprob_entries(logits, masked, params, list(range(len(seqs))),
                                           tokens, processed)


def verify(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
           noise_rows_: torch.Tensor | None) -> tuple[list[int], int]:
    """``speculative.verify.verify`` over the per-row ``process_logits``."""
    if params.greedy:
        return verify_greedy(tree, target_logits)
    probs = torch.softmax(process_logits(target_logits, [params] * target_logits.shape[0]), -1)
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
