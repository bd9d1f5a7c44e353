"""Noise-coupled drafting: the drafter proposes the tokens the target is about to sample.

Sampling draws the token at output position ``j`` as ``argmax(p_j / E_j)`` with noise ``E_j``
that plain sampling and verification share (``specengine.sampling.params``). A drafter that ranks a
node's children by the perturbed draft score ``log q_T(x) - log E_j[x]`` (``q_T``: the draft
distribution after the request's temperature, top-k, top-p and min-p) proposes first exactly the
token the target samples when ``q_T = p_j``, and agrees with it with probability at least
``(1 - TV) / (1 + TV)`` otherwise: the shared-Gumbel coupling of Daliri et al. 2024, "Coupling
without Communication and Drafter-Invariant Speculative Decoding" (arXiv 2408.07978).
Verification (``sampling.verify``) is unchanged, so output stays lossless whatever is drafted.

A request's repetition / presence / frequency penalties are applied to the draft logits first,
each row with its own context (the committed tokens plus the draft path to the row's node,
``specengine.sampling.penalties``), as verification applies them to the target's: not needed for
losslessness, but otherwise the draft keeps proposing the tokens the target is penalised for.

``coupled_topk`` gives a drafter's children directly: one extension call (``coupled_topk`` in
``csrc/noise.cpp``) for the rows with neither filters nor penalties, which computes each noise
value as it goes (counter-based, never stored) and keeps the k best in one pass over the draft
vocabulary; the other rows take ``coupled_logprobs`` and ``torch.topk``.
"""

from __future__ import annotations

import torch

from specengine.engine.sequence import Sequence
from specengine.ops.extension import ext
from specengine.sampling.batched import gather_noise, store_noise
from specengine.sampling.params import SamplingParams
from specengine.sampling.penalties import penalize

TOP_P_WINDOW = 256  # drafting's top-p keeps at most this many tokens


def coupled_logprobs(logits: torch.Tensor, seqs: list[Sequence], positions: list[int],
                     vocab: int, vocab_map: torch.Tensor | None = None,
                     paths: list[list[int]] | None = None) -> torch.Tensor:
    """Log-probabilities to rank each row's draft children by (top-k of a row = its children).

    Args:
        logits: ``[R, Vd]`` float32 draft logits; row ``r`` drafts the children of a node of
            ``seqs[r]`` whose token goes to output position ``positions[r]`` (0 = the first
            output token). Not modified.
        seqs: the sequence of each row (its ``params`` and ``noise``).
        positions: ``R`` output positions.
        vocab: the target's vocabulary size V (the noise is ``seq.noise(position, V)``).
        vocab_map: ``[Vd]`` int64 target ids of the draft vocabulary (EAGLE / FR-Spec), or
            None when ``Vd == V``.
        paths: per row the draft tokens from the root to the node whose children it drafts
            (that node included), or None for none: with the committed tokens, the context of
            the row's penalties (``penalties.penalize``).

    Returns:
        ``[R, Vd]`` float32: greedy rows ``log_softmax(logits)`` (as uncoupled drafting);
        sampled rows ``log_softmax(filtered(logits / T) - log E)`` with ``E`` the row's noise
        (``[vocab_map]``), tokens the request's top-k / top-p / min-p drop being ``-inf``;
        ``logits`` penalised first for requests with penalties.
    """
    logits = penalize(logits, seqs, vocab, paths, vocab_map)
    sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
    if not sampled:
        return torch.log_softmax(logits, -1)
    slot: dict[tuple[int, int], int] = {}  # (sequence, position) -> noise row
    first: list[int] = []
    for r in sampled:
        key = (seqs[r].seq_id, positions[r])
        if key not in slot:
            slot[key] = len(first)
            first.append(r)
    noises, at = [seqs[r].noise for r in first], [positions[r] for r in first]
    noise, drawn = gather_noise(noises, at, vocab)  # one extension call for the new rows
    store_noise(noises, at, vocab, noise, drawn)  # verification reads them again
    log_e = (noise if vocab_map is None else noise[:, vocab_map]).log_()
    if len(first) < len(sampled):
        log_e = log_e[[slot[(seqs[r].seq_id, positions[r])] for r in sampled]]
    every = len(sampled) == len(seqs)
    z = filter_logits(logits if every else logits[sampled], [seqs[r].params for r in sampled])
    lp = torch.log_softmax(z.sub_(log_e), -1)
    if every:
        return lp
    out = torch.log_softmax(logits, -1)
    out[sampled] = lp
    return out


def coupled_topk(logits: torch.Tensor, k: int, seqs: list[Sequence], positions: list[int],
                 vocab: int, vocab_map: torch.Tensor | None = None,
                 paths: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best children of each row: ``torch.topk(coupled_logprobs(...), k)``.

    Args and the ranking as ``coupled_logprobs`` (``k`` <= ``Vd``). Rows that are greedy or
    sampled with a temperature only (no top-k / top-p / min-p, no penalties) take one
    extension call when the extension is built (float32 log-probabilities equal to
    ``coupled_logprobs``' within a few ulp; ties go to the lower index); the others, and all
    rows without the extension, ``coupled_logprobs`` and ``torch.topk``. ``logits`` on a GPU
    are copied to the CPU first (where the noise streams and penalty counts live); the
    results are CPU tensors.

    Returns:
        ``(values, indices)``: ``[R, k]`` float32 log-probabilities, best first, and ``[R, k]``
        int64 draft-vocabulary indices (``-inf`` values past a row's tokens that survive its
        filters).
    """
    if logits.device.type != "cpu":  # the noise streams, penalty counts and kernel are on CPU
        logits = logits.float().cpu()
        vocab_map = None if vocab_map is None else vocab_map.cpu()
    mod = ext()
    R = logits.shape[0]
    plain = [r for r, s in enumerate(seqs) if plain_params(s.params, vocab)]
    if mod is None or logits.device.type != "cpu" or not plain:
        top = torch.topk(coupled_logprobs(logits, seqs, positions, vocab, vocab_map, paths), k,
                         dim=-1)
        return top.values, top.indices
    x = logits if len(plain) == R else logits[plain]
    params = [seqs[r].params for r in plain]
    values, indices = mod.coupled_topk(
        x.float().contiguous(), k,
        torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
        torch.tensor([0 if p.greedy else seqs[r].noise.key for r, p in zip(plain, params)],
                     dtype=torch.int64),
        torch.tensor([positions[r] for r in plain], dtype=torch.int64), vocab_map)
    if len(plain) == R:
        return values, indices
    kernel_rows = set(plain)
    rest = [r for r in range(R) if r not in kernel_rows]
    lp = coupled_logprobs(logits[rest], [seqs[r] for r in rest], [positions[r] for r in rest],
                          vocab, vocab_map, None if paths is None else [paths[r] for r in rest])
    top = torch.topk(lp, k, dim=-1)
    out_v, out_i = torch.empty(R, k), torch.empty(R, k, dtype=torch.int64)
    out_v[plain], out_i[plain] = values, indices
    out_v[rest], out_i[rest] = top.values, top.indices
    return out_v, out_i


def plain_params(p: SamplingParams, vocab: int) -> bool:
    """True when a row's draft scores need no filter and no penalty (``coupled_topk``'s
    extension call handles it)."""
    return not p.has_penalties and (p.greedy or (
        p.top_p >= 1.0 and p.min_p <= 0.0 and not 0 < p.top_k < vocab))


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``batched.process_rows`` for drafting: temperature, top-k, top-p (Holtzman et al.
    2019), min-p, except that top-p without top-k keeps at most ``TOP_P_WINDOW`` tokens (a
    top-k, not the 49k-token sort that costs ~3.4 ms a row; a flat draft row's nucleus is cut
    there) and that tokens tied at a cut are all kept.

    Args:
        logits: ``[R, V]`` float32 raw logits. params: one non-greedy SamplingParams per row.

    Returns:
        ``[R, V]`` float32 processed logits, filtered tokens ``-inf``.
    """
    V = logits.shape[1]
    z = logits / torch.tensor([[p.temperature] for p in params])
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params])
    top_p = torch.tensor([p.top_p if p.top_p < 1 else torch.inf for p in params])
    cut = ((top_k < V) | (top_p < 1)).nonzero()[:, 0]
    if len(cut):
        k, zc = top_k[cut], z[cut]
        most = k.masked_fill(k == V, min(V, TOP_P_WINDOW))  # the most tokens a row keeps
        vals = torch.topk(zc, int(most.max()), dim=-1).values  # [C, w] descending
        top = torch.arange(vals.shape[1]) < most[:, None]
        norm = torch.where(k < V, torch.logsumexp(vals.masked_fill(~top, -torch.inf), -1),
                           torch.logsumexp(zc, -1))  # of the top-k, else of the whole row
        prob = (vals - norm[:, None]).exp().masked_fill(~top, 0.0)
        keep = top & (prob.cumsum(-1) - prob < top_p[cut, None])
        keep[:, 0] = True
        n = keep.sum(-1)
        z[cut] = zc.masked_fill(zc < vals.gather(1, (n - 1)[:, None]), -torch.inf)
    min_p = torch.tensor([[p.min_p] for p in params])
    if (min_p > 0).any():  # p < min_p * max p, in log space (log 0 = -inf keeps all)
        z.masked_fill_(z < z.amax(-1, keepdim=True) + min_p.log(), -torch.inf)
    return z
