"""Batched sampling: all the rows of a step processed and drawn in a few tensor operations.

Same results, bit for bit, as the per-row definitions (``tests/reference_sampling.py`` keeps
them, the tests compare): every step that decides a token (temperature division, top-k's k-th
value, top-p's softmax / window top-k / sort / cumulative sum, min-p's threshold, the draw's
softmax, ``p / E`` and argmax) is the same torch operation on the same float32 values, applied
to a ``[R, V]`` matrix along its last dimension instead of to one ``[V]`` row; per-row
parameters enter as float32 columns, which is how torch applies a Python float to a float32
tensor. torch's CPU kernels for these operations compute each row of a matrix alone, with the
code a single row gets (the tests check it on many seeds, ties included).

The draw of all sampled rows is one extension call (``softmax_race``: ``csrc/noise.cpp``'s
``softmax_race``, the softmax and ``exponential_race`` of each row on one thread, which computes
the row's noise as it goes, skips the logarithm where a token provably cannot win, and stores
neither the noise nor the probabilities); where the noise itself is needed (a
drafter's perturbed scores), ``gather_noise`` draws all missing rows in one call
(``exponential_noise_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specengine.ops.extension import ext
from specengine.ops.lists import int_tensor
from specengine.sampling.params import SampleNoise, SamplingParams, noise_rows

TOP_P_WINDOW = 256  # top-p looks for the cut among this many most likely tokens first


def _column(values: list[float]) -> torch.Tensor:
    """``[R, 1]`` float32: per-row scalars as torch applies a Python float to float32 rows."""
    return torch.tensor(values, dtype=torch.float32)[:, None]


def is_plain(p: SamplingParams, vocab: int) -> bool:
    """True when ``process_rows`` leaves the row as it is: greedy, or temperature 1 with no
    top-k / top-p / min-p."""
    return p.greedy or (p.temperature == 1.0 and not 0 < p.top_k < vocab and p.top_p >= 1.0
                        and p.min_p <= 0.0)


def process_rows(logits: torch.Tensor, params: list[SamplingParams],
                 copy: bool = True) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p of every row, batched (the per-row definition:
    ``tests/reference_sampling.py``'s ``process_logits_per_row``).

    Rows are processed together: temperature as a division by a per-row column, top-k with one
    ``topk`` of the largest k (each row's own k-th value masks it), top-p by ``top_p_rows_``,
    min-p as a per-row threshold on one softmax. Greedy rows, and rows at temperature 1 with no
    filter, are left as they are.

    Args:
        logits: ``[B, V]`` float32 (already masked for ``min_tokens``); not modified.
        params: one SamplingParams per row.
        copy: when False and no row changes, ``logits`` itself is returned (callers that do
            not modify the result skip a copy).

    Returns:
        ``[B, V]`` float32, filtered tokens ``-inf``; a new tensor unless ``copy`` is False
        and no row changes.

    Raises:
        ValueError: ``logits`` is not 2-D, or ``params`` does not have one entry per row.
    """
    if logits.dim() != 2 or len(params) != logits.shape[0]:
        raise ValueError(f"logits must be [B, V] with one SamplingParams per row; got logits "
                         f"{tuple(logits.shape)} and {len(params)} params")
    B, V = logits.shape
    work = [i for i, p in enumerate(params) if not is_plain(p, V)]
    if not work:
        return logits.clone() if copy else logits
    sub = [params[i] for i in work]
    every = len(work) == B
    temperature = _column([p.temperature for p in sub])
    z = logits / temperature if every else logits[work].div_(temperature)

    def rows_of(select: list[int], apply) -> None:  # apply to the rows select of z, in place
        if len(select) == len(sub):
            apply(z, sub)
        else:
            part = z[select]
            apply(part, [sub[j] for j in select])
            z[select] = part

    top_k = [j for j, p in enumerate(sub) if 0 < p.top_k < V]
    if top_k:
        rows_of(top_k, _top_k_rows_)
    top_p = [j for j, p in enumerate(sub) if p.top_p < 1.0]
    if top_p:
        rows_of(top_p, lambda part, ps: top_p_rows_(part, _column([p.top_p for p in ps])[:, 0]))
    min_p = [j for j, p in enumerate(sub) if p.min_p > 0.0]
    if min_p:
        rows_of(min_p, _min_p_rows_)
    if every:
        return z
    out = logits.clone()
    out[work] = z
    return out


def _top_k_rows_(z: torch.Tensor, params: list[SamplingParams]) -> None:
    """Tokens below each row's k-th largest value become ``-inf`` (ties at it stay)."""
    k = torch.tensor([p.top_k for p in params])
    kth = torch.topk(z, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    z.masked_fill_(z < kth, float("-inf"))


def _min_p_rows_(z: torch.Tensor, params: list[SamplingParams]) -> None:
    """Tokens with probability < min_p * the row's largest probability become ``-inf``."""
    probs = torch.softmax(z, -1)
    z.masked_fill_(probs < _column([p.min_p for p in params]) * probs.amax(-1, keepdim=True),
                   float("-inf"))


def top_p_rows_(z: torch.Tensor, top_p: torch.Tensor) -> None:
    """Nucleus filtering of logits ``z`` ``[R, V]`` float32 in place: in row r a token is
    dropped when the probability mass of the tokens before it (most likely first) already
    reaches ``top_p[r]`` (``[R]`` float32); the most likely token always stays. The cut is
    looked for among the ``TOP_P_WINDOW`` most likely tokens (one ``topk`` for all rows), and
    by a full sort only in the rows whose nucleus is wider."""
    probs = torch.softmax(z, -1)
    V = z.shape[1]
    w = min(TOP_P_WINDOW, V)
    vals, idx = torch.topk(probs, w, dim=-1)
    before = vals.cumsum(-1) - vals
    keep = before < top_p[:, None]
    keep[:, 0] = True
    kept = torch.zeros(z.shape, dtype=torch.bool).scatter_(1, idx, keep)
    wide = (before[:, -1] < top_p).nonzero()[:, 0].tolist() if w < V else []
    if wide:  # the nucleus reaches past the window
        vals, idx = torch.sort(probs[wide], dim=-1, descending=True)
        before = vals.cumsum(-1) - vals
        keep = before < top_p[wide, None]
        keep[:, 0] = True
        kept[wide] = torch.zeros(len(wide), V, dtype=torch.bool).scatter_(1, idx, keep)
    z.masked_fill_(~kept, float("-inf"))


@dataclass(frozen=True)
class NoiseStreams:
    """Where the noise of S sampled rows comes from, without drawing it: row r's is
    ``noise_rows(keys[r], [positions[r]], V)`` (``SampleNoise.key``, output position)."""

    keys: list[int]
    positions: list[int]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum, ``[R, V]`` float32 -> ``[R]`` int64: the first maximal
    entry, a NaN counting as the maximum (``torch.argmax``'s rule). On the CPU one extension
    call (``argmax_rows``, ``csrc/noise.cpp``: 16 lanes of comparisons; rows and 16k-value
    chunks in parallel past 128k values), else ``x.max(-1).indices``, which follows the same
    rule. 49152 logits per row, 2 threads on Zen 4 (``bench/bench_kernels.py --argmax``):
    1 / 4 / 64 rows 0.004 / 0.010 / 0.13 ms, torch's reduction 0.044 / 0.085 / 1.30 ms."""
    mod = ext()
    if (mod is not None and hasattr(mod, "argmax_rows") and x.device.type == "cpu"
            and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0):
        return mod.argmax_rows(x)
    return x.max(-1).indices


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The probabilities sampled from: the softmax of each row of ``x`` ``[R, V]`` float32,
    ``[R, V]`` float32. On the CPU one extension call (``softmax_rows``, ``csrc/noise.cpp``)
    with one definition whatever ``R`` or the thread count (a row's max, ``exp(x - max)`` with
    exp of less than -87.3 taken as 0 so a ``-inf`` logit has probability 0, the sum over
    fixed 8192-value chunks in order, times ``1 / sum``; a row holding NaN, or whose max is
    infinite, all NaN as torch gives), rows and chunks on the kernel pool's threads; else
    ``torch.softmax``.

    Why not ``torch.softmax``: inside a step torch runs on one thread (``kernels.kernel_threads``),
    and a Qwen2.5-sized vocabulary (151,936 tokens) made its softmax 0.2 ms a row, more than the
    exponential race after it (2-core Intel Xeon with AMX, 32 rows: 6.55 ms on one thread, 3.51
    ms here; ``python bench/bench_sampling.py --softmax``).

    Raises:
        ValueError: ``x`` is not 2-D.
    """
    if x.dim() != 2:
        raise ValueError(f"softmax_rows takes [R, V] logits, got shape {tuple(x.shape)}")
    mod = ext()
    if (mod is not None and hasattr(mod, "softmax_rows") and x.device.type == "cpu"
            and x.dtype == torch.float32 and x.shape[1] > 0):
        return mod.softmax_rows(x)
    return torch.softmax(x, -1)


def race(probs: torch.Tensor, noise: torch.Tensor | NoiseStreams) -> torch.Tensor:
    """The exponential race of every row: ``argmax(probs[r] / E_r)``.

    Args:
        probs: ``[S, V]`` float32 probabilities (softmax of processed logits); not modified.
        noise: ``[S, V]`` float32 ``Exp(1)`` noise, or the ``NoiseStreams`` of the rows: then
            one extension call (``exponential_race``) computes the noise as it goes and never
            stores it, with the same quotients and argmax as dividing by ``noise_batch``'s rows
            (without that call: ``noise_batch`` and a division).

    Returns:
        ``[S]`` int64 token ids.

    Raises:
        ValueError: ``noise`` does not have one row (or stream) per row of ``probs``.
    """
    S, V = probs.shape
    if isinstance(noise, NoiseStreams):
        if not len(noise.keys) == len(noise.positions) == S:
            raise ValueError(f"noise streams must be {S} (one per row), got "
                             f"{len(noise.keys)} keys and {len(noise.positions)} positions")
        mod = ext()
        if mod is not None and hasattr(mod, "exponential_race"):
            return mod.exponential_race(probs, torch.tensor(noise.keys, dtype=torch.int64),
                                        torch.tensor(noise.positions, dtype=torch.int64))
        noise = noise_batch(noise.keys, noise.positions, V)
    if tuple(noise.shape) != (S, V):
        raise ValueError(f"noise must be [{S}, {V}] (one row per sampled row), got "
                         f"{tuple(noise.shape)}")
    return argmax_rows(probs / noise)


def softmax_race(x: torch.Tensor, noise: NoiseStreams,
                 rows: list[int] | None = None) -> torch.Tensor:
    """``race(softmax_rows(x), noise)`` bit for bit: the tokens ``[S]`` int64 drawn from the
    logits ``x`` ``[S, V]`` float32 with the noise of the ``S`` streams, in one extension call
    (``softmax_race``, ``csrc/noise.cpp``) that writes no probabilities: with at least two rows
    per kernel thread each row's max, exponentials and race run on one thread while the row is
    in that core's cache (Qwen2.5's 151,936-token vocabulary, 32 rows, 2-core Intel Xeon with
    AVX-512: 4.5 ms against 5.9 for the two calls; ``python bench/bench_sampling.py
    --softmax``). Without the extension call: the two calls.

    ``rows``: draw from ``x[rows]`` (``S`` row indices of ``x`` ``[N, V]``) instead, the same
    tokens without gathering the rows first (a verify's rows reached at one depth are spread
    over the forward's logits: the gather copied 16 x 151,936 floats, ~1.8 ms on the Xeon).

    Raises:
        ValueError: ``x`` is not 2-D, ``noise`` does not have one stream per row (per entry
            of ``rows``), or a row index is out of range.
    """
    if x.dim() != 2:
        raise ValueError(f"softmax_race takes [S, V] logits, got shape {tuple(x.shape)}")
    S = x.shape[0] if rows is None else len(rows)
    if not len(noise.keys) == len(noise.positions) == S:
        raise ValueError(f"noise streams must be {S} (one per row), got "
                         f"{len(noise.keys)} keys and {len(noise.positions)} positions")
    if rows is not None and not all(0 <= r < x.shape[0] for r in rows):
        raise ValueError(f"rows must index the {x.shape[0]} rows of x, got {rows}")
    mod = ext()
    if (mod is not None and hasattr(mod, "softmax_race") and x.device.type == "cpu"
            and x.dtype == torch.float32 and x.shape[1] > 0):
        return mod.softmax_race(x, torch.tensor(noise.keys, dtype=torch.int64),
                                torch.tensor(noise.positions, dtype=torch.int64),
                                None if rows is None else int_tensor(rows, torch.int64))
    return race(softmax_rows(x if rows is None else x[rows]), noise)


def draw(processed: torch.Tensor, params: list[SamplingParams],
         noise: torch.Tensor | NoiseStreams | None) -> torch.Tensor:
    """One token per row: argmax for greedy rows, else ``argmax(softmax(row) / E)`` (the
    exponential race), all sampled rows in one ``softmax_race`` (streams) or one
    ``softmax_rows`` and one ``race`` (noise rows).

    Args:
        processed: ``[B, V]`` float32 output of ``process_rows``.
        params: one per row.
        noise: the noise of the S sampled (non-greedy) rows, in row order: ``[S, V]`` float32
            ``Exp(1)`` rows or their ``NoiseStreams``; None when every row is greedy.

    Returns:
        ``[B]`` int64 token ids.

    Raises:
        ValueError: ``noise`` does not match the sampled rows.
    """
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return argmax_rows(processed)
    if noise is None:
        raise ValueError(f"noise is None but {len(sampled)} rows are sampled")
    every = len(sampled) == len(params)
    rows = processed if every else processed[sampled]
    tokens = softmax_race(rows, noise) if isinstance(noise, NoiseStreams) else \
        race(softmax_rows(rows), noise)
    if every:
        return tokens
    out = torch.empty(len(params), dtype=torch.int64)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    out[greedy] = argmax_rows(processed[greedy])
    out[sampled] = tokens
    return out


def noise_batch(keys: list[int], positions: list[int], vocab: int) -> torch.Tensor:
    """``[P, vocab]`` float32 ``Exp(1)`` noise, row r of stream ``keys[r]`` at output position
    ``positions[r]``: bit for bit ``params.noise_rows(keys[r], [positions[r]], vocab)``, in
    one extension call (``exponential_noise_batch``; per-row calls with an extension built
    before it, or without one)."""
    mod = ext()
    if mod is not None and hasattr(mod, "exponential_noise_batch"):
        return mod.exponential_noise_batch(torch.tensor(keys, dtype=torch.int64),
                                           torch.tensor(positions, dtype=torch.int64), vocab)
    return torch.cat([noise_rows(k, [p], vocab) for k, p in zip(keys, positions)])


def gather_noise(noises: list[SampleNoise], positions: list[int], vocab: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """The noise rows ``noises[r](positions[r], vocab)`` of many samples: rows a
    ``SampleNoise`` holds come from it, all the others from one ``noise_batch`` call (a row
    asked for twice is drawn once). Nothing is stored in the ``SampleNoise`` caches
    (``store_noise`` does).

    Returns:
        ``(noise, drawn)``: ``[R, vocab]`` float32, a new tensor the caller may modify, and the
        indices r of the rows drawn now.
    """
    rows = [n.cached(p, vocab) for n, p in zip(noises, positions)]
    drawn = [r for r, e in enumerate(rows) if e is None]
    if drawn:
        slot: dict[tuple[int, int], int] = {}
        for r in drawn:
            slot.setdefault((noises[r].key, positions[r]), len(slot))
        fresh = noise_batch([k for k, _ in slot], [p for _, p in slot], vocab)
        if len(slot) == len(rows):
            return fresh, drawn
        for r in drawn:
            rows[r] = fresh[slot[(noises[r].key, positions[r])]]
    return torch.stack(rows), drawn


def store_noise(noises: list[SampleNoise], positions: list[int], vocab: int,
                noise: torch.Tensor, rows: list[int]) -> None:
    """Keep rows ``rows`` of ``noise`` (from ``gather_noise``) in their ``SampleNoise`` caches,
    each as its own copy (a view would keep the whole batch alive)."""
    for r in rows:
        noises[r].store(positions[r], vocab, noise[r].clone())
