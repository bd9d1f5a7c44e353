"""Step-time model fitted online: how long a step takes for a batch and a draft strategy.

A step costs drafting + one target forward + everything else (verify, sampling, bookkeeping):

- **forward** (seconds) = ``c0 + c1*n + c2*max(0, n - knee) + c3*ctx + c4*qctx`` with ``n`` the
  tokens in the forward, ``ctx`` the context tokens of the batch (KV positions attended, summed
  over sequences) and ``qctx`` = ctx x tokens per sequence (attention reads the context once per
  query token on backends that do not share it across a tree). Piecewise-linear in ``n``: flat
  while the forward is memory-bound, a steeper slope once it is compute-bound (RLHFSpec arXiv
  2512.04752 models verification cost the same way). The knee is chosen among powers of two by
  the smallest weighted residual, so no machine constant is written down anywhere.
- **draft** = ``d0 + d1*B + d2*depth + d3*depth*B + d4*nodes + d5*catch_up`` when speculating
  (0 otherwise): fits a free n-gram lookup (all ~0), a draft model (a forward of B tokens per
  depth) and an EAGLE head alike; ``catch_up`` is the tokens committed while the drafter was
  not drafting for the sequences it drafts for now (``StepRecord.num_catch_up``), which a
  stateful drafter feeds through its layers first: the price of turning speculation on
  (``catch_up_time``), 0 in a run of speculative steps.
- **other** = ``o0 + o1*B + o2*nodes + o3*committed + o4*[nodes > 0]``: a step that verifies a
  tree pays a fixed price besides its nodes (building the verify's inputs, sampling it by
  depth); without its own term that price was fitted per node from the few probe steps of 4
  nodes (2 ms a node at 16 qwen2.5-0.5B sequences, where 16 nodes cost 3 ms in all) and a
  depth-1 chain at 16 sequences was priced 30 ms too dear.

Each part is a weighted least-squares fit on relative error (weight 1/y^2), kept as sufficient
statistics: a fixed prior from the start-up profile (``profiling.py``) plus online statistics
that decay by ``decay`` per step, so the model follows a changed machine or model within a few
hundred steps while the profile still anchors directions the online data does not cover.
"""

from __future__ import annotations

import numpy as np

KNEES = tuple(2 ** i for i in range(14))  # candidate knee positions (tokens): 1 .. 8192


def nonnegative_solve(a: np.ndarray, b: np.ndarray, hint: np.ndarray | None = None) -> np.ndarray:
    """``argmin theta' a theta - 2 b' theta`` subject to ``theta >= 0`` (``a`` symmetric
    positive definite): Lawson and Hanson's active-set NNLS on the normal equations. Every
    feature here adds work, so a negative coefficient is an artefact of noise or collinearity
    and would extrapolate to negative times. ``hint``: the nonzero pattern of a previous
    solution; if it still satisfies the optimality conditions one solve suffices."""
    n = len(b)
    tol = 1e-12 * max(float(np.abs(b).max()), 1e-300)
    if hint is not None and hint.any():
        idx = np.flatnonzero(hint)
        theta = np.zeros(n)
        theta[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
        if theta[idx].min() > 0 and (b - a @ theta)[~hint].max(initial=-1.0) <= tol:
            return theta
    theta = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        grad = b - a @ theta  # descent direction of the objective
        grad[free] = -np.inf
        j = int(np.argmax(grad))
        if grad[j] <= tol:
            break
        free[j] = True
        while True:
            idx = np.flatnonzero(free)
            trial = np.zeros(n)
            trial[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            if trial[idx].min() > 0:
                theta = trial
                break
            bad = idx[trial[idx] <= 0]
            step = np.min(theta[bad] / (theta[bad] - trial[bad]))
            theta = theta + step * (trial - theta)
            free &= theta > 0
            theta[~free] = 0.0
            if not free.any():
                break
    return theta


class WeightedLeastSquares:
    """Non-negative least squares ``y ~ x @ theta`` from decaying sufficient statistics plus a
    fixed prior; ``copies`` fits that see the same observations through different features
    (one per candidate knee) are updated together.

    Args:
        dim: number of features.
        decay: factor applied to the online statistics at every update (1: never forget).
        ridge: relative ridge on the diagonal, for numerical stability only.
        copies: number of fits.
    """

    def __init__(self, dim: int, decay: float = 0.998, ridge: float = 1e-6, copies: int = 1,
                 refit_every: int = 1):
        self.decay, self.ridge, self.shape = decay, ridge, (copies, dim)
        self.refit_every = refit_every  # adds between solves (the fit moves slowly)
        self._adds = 0
        self.prior_a = np.zeros((copies, dim, dim))
        self.prior_b = np.zeros((copies, dim))
        self.prior_yy = 0.0
        self.a = np.zeros((copies, dim, dim))
        self.b = np.zeros((copies, dim))
        self.yy = 0.0
        self._theta: dict[int, np.ndarray] = {}
        self._last: dict[int, np.ndarray] = {}  # last solved coefficients, kept across adds

    def add(self, x: np.ndarray, y: float, weight: float = 1.0, prior: bool = False) -> None:
        """Add observation ``(x, y)`` (``x``: ``[dim]`` or ``[copies, dim]``); ``prior=True``
        adds it to the fixed prior instead."""
        self.add_many(np.asarray(x, dtype=float)[None], [y], [weight], prior)

    def add_many(self, xs: np.ndarray, ys, weights, prior: bool = False) -> None:
        """``add`` of ``k`` observations in the order made, in one batched update: ``xs``
        ``[k, dim]`` or ``[k, copies, dim]``, ``ys`` and ``weights`` ``[k]``."""
        ys, w = np.asarray(ys, dtype=float), np.asarray(weights, dtype=float)
        k = len(ys)
        xs = np.broadcast_to(np.asarray(xs, dtype=float).reshape(k, -1, self.shape[1]),
                             (k, *self.shape))
        if prior:
            self.prior_a += np.einsum("k,kci,kcj->cij", w, xs, xs)
            self.prior_b += np.einsum("k,kci->ci", w * ys, xs)
            self.prior_yy += float((w * ys * ys).sum())
        else:
            d = self.decay
            f = w * d ** np.arange(k - 1, -1, -1.0)  # what each is worth after the later decays
            self.a = d ** k * self.a + np.einsum("k,kci,kcj->cij", f, xs, xs)
            self.b = d ** k * self.b + np.einsum("k,kci->ci", f * ys, xs)
            self.yy = d ** k * self.yy + float((f * ys * ys).sum())
        self._adds += k
        if prior or self._adds >= self.refit_every:
            self._theta.clear()
            self._adds = 0

    def theta(self, i: int = 0) -> np.ndarray:
        """Coefficients of fit ``i`` (zeros before any data), solved again after every
        ``refit_every`` observations."""
        t = self._theta.get(i)
        if t is None:
            a = self.prior_a[i] + self.a[i]
            a = a + self.ridge * np.diag(np.maximum(np.diag(a), 1e-30))
            last = self._last.get(i)
            t = nonnegative_solve(a, self.prior_b[i] + self.b[i],
                                  None if last is None else last > 0)
            self._theta[i] = self._last[i] = t
        return t

    def stale_theta(self, i: int = 0) -> np.ndarray:
        """The coefficients last solved (no solve unless there are none yet)."""
        t = self._last.get(i)
        return self.theta(i) if t is None else t

    def residuals(self, indices: list[int] | None = None) -> np.ndarray:
        """Weighted sums of squared residuals of the fits ``indices`` (default: all
        ``copies``; prior and online data)."""
        idx = list(range(self.shape[0])) if indices is None else list(indices)
        t = np.stack([self.theta(i) for i in idx])
        a, b = self.prior_a[idx] + self.a[idx], self.prior_b[idx] + self.b[idx]
        quad = np.einsum("ci,cij,cj->c", t, a, t)
        return self.prior_yy + self.yy - 2 * np.einsum("ci,ci->c", t, b) + quad


def outlier_weight(seconds, predicted, limit: float = 3.0) -> np.ndarray:
    """Down-weighting of a measurement more than ``limit`` times slower than predicted (a
    descheduled thread, a garbage collection): its relative residual counts as ``limit``
    (Huber-style), so a machine that really got slower still moves the fit, only gradually.
    Elementwise over arrays of ``seconds`` and ``predicted``; 1 where ``predicted <= 0``."""
    seconds, predicted = np.asarray(seconds, dtype=float), np.asarray(predicted, dtype=float)
    slow = (predicted > 0) & (seconds > limit * predicted)
    return np.where(slow, (limit * predicted / np.where(slow, seconds, 1.0)) ** 2, 1.0)


def _features(*columns) -> np.ndarray:
    """Columns (scalars or arrays, broadcast together) stacked on a last axis."""
    cols = np.broadcast_arrays(*(np.asarray(c, dtype=float) for c in columns))
    return np.stack(cols, axis=-1)


def forward_x(tokens, context, per_seq, knee) -> np.ndarray:
    """Features of the forward-time fit (see the module docstring), ``[..., 5]`` over the
    broadcast shape of the arguments (``[len(knee), 5]`` for one forward and an array of
    knees)."""
    tokens, context, per_seq = (np.asarray(v, dtype=float) for v in (tokens, context, per_seq))
    return _features(1.0, tokens, np.maximum(tokens - np.asarray(knee, dtype=float), 0.0),
                     context, context * per_seq)


def draft_x(batch, depth, nodes, catch_up=0.0) -> np.ndarray:
    """Features of the draft-time fit, ``[..., 6]``: the work of drafting ``nodes`` nodes
    ``depth`` deep for ``batch`` sequences after catching up on ``catch_up`` tokens."""
    batch, depth = np.asarray(batch, dtype=float), np.asarray(depth, dtype=float)
    return _features(1.0, batch, depth, depth * batch, nodes, catch_up)


def other_x(batch, nodes, committed) -> np.ndarray:
    """Features of the verify/sample/bookkeeping-time fit, ``[..., 5]``."""
    nodes = np.asarray(nodes, dtype=float)
    return _features(1.0, batch, nodes, committed, nodes > 0)


class LatencyModel:
    """Predicts step time (seconds) from batch shape; learns from every step.

    Args:
        decay: forgetting factor per observed step for the online statistics.
        prior_weight: weight of each profile point relative to one online step.
    """

    def __init__(self, decay: float = 0.998, prior_weight: float = 3.0):
        self.prior_weight = prior_weight
        self.knees = np.array(KNEES, dtype=float)
        self.forward = WeightedLeastSquares(5, decay, copies=len(KNEES), refit_every=8)
        self.draft = WeightedLeastSquares(6, decay, refit_every=8)
        self.other = WeightedLeastSquares(5, decay, refit_every=8)
        self.knee_index = 0
        self.num_forward = 0  # forward observations (profile included)
        self.num_draft = 0

    @property
    def knee(self) -> int:
        """Tokens per forward where the fitted step time starts to climb faster."""
        return KNEES[self.knee_index]

    # ---- learning ---------------------------------------------------------------------------
    def add_forward(self, tokens: int, context: int, num_seqs: int, seconds: float,
                    prior: bool = False) -> None:
        """One measured target forward of ``tokens`` tokens over ``num_seqs`` sequences with
        ``context`` context tokens in all; ``prior`` marks a start-up profile point."""
        self.add_forwards([tokens], [context], [num_seqs], [seconds], prior)

    def add_forwards(self, tokens, context, num_seqs, seconds, prior: bool = False) -> None:
        """``add_forward`` of several forwards (arrays, in the order measured), one batched
        update; the outlier check uses the coefficients from before them."""
        t, c, n, s = (np.asarray(v, dtype=float) for v in (tokens, context, num_seqs, seconds))
        ok = (s > 0) & (t > 0)
        t, c, n, s = t[ok], c[ok], n[ok], s[ok]
        if not len(s):
            return
        w = (self.prior_weight if prior else 1.0) / s ** 2
        per_seq = t / np.maximum(n, 1)
        if not prior and self.num_forward:
            x = forward_x(t, c, per_seq, self.knee)
            w = w * outlier_weight(s, x @ self.forward.stale_theta(self.knee_index))
        self.forward.add_many(forward_x(t[:, None], c[:, None], per_seq[:, None], self.knees),
                              s, w, prior)
        before, self.num_forward = self.num_forward, self.num_forward + len(s)
        # the knee is chosen again every few observations: each choice solves all the fits
        every = 16 if self.num_forward <= 64 else 64
        if prior or before // every != self.num_forward // every:
            self.select_knee(local=not prior)

    def select_knee(self, local: bool = False) -> None:
        """Take the candidate knee whose forward fit has the smallest weighted residual:
        among all of them, or (``local``: online, where the knee moves little and each
        candidate costs a solve) among the current one and its two neighbours."""
        if not local:
            self.knee_index = int(np.argmin(self.forward.residuals()))
            return
        k = self.knee_index
        near = [i for i in (k - 1, k, k + 1) if 0 <= i < len(KNEES)]
        self.knee_index = near[int(np.argmin(self.forward.residuals(near)))]

    def add_draft(self, batch: int, depth: int, nodes: int, seconds: float,
                  prior: bool = False, catch_up: int = 0) -> None:
        """Drafting ``nodes`` nodes up to ``depth`` deep for ``batch`` sequences, after
        catching up on ``catch_up`` tokens, took ``seconds``."""
        self.add_drafts([batch], [depth], [nodes], [seconds], prior, [catch_up])

    def add_drafts(self, batch, depth, nodes, seconds, prior: bool = False,
                   catch_up=0.0) -> None:
        """``add_draft`` of several steps (arrays, in order), one batched update."""
        s = np.asarray(seconds, dtype=float)
        if not len(s):
            return
        w = (self.prior_weight if prior else 1.0) / np.maximum(s, 1e-4) ** 2
        x = draft_x(batch, depth, nodes, catch_up)
        if not prior and self.num_draft:  # a catch-up teaches its own term: never an outlier
            w = w * np.where(x[:, 5] > 0, 1.0, outlier_weight(s, x @ self.draft.stale_theta()))
        self.draft.add_many(x, s, w, prior)
        self.num_draft += len(s)

    def add_other(self, batch: int, nodes: int, committed: int, seconds: float) -> None:
        """Verify, sampling and bookkeeping of a step took ``seconds``."""
        self.add_others([batch], [nodes], [committed], [seconds])

    def add_others(self, batch, nodes, committed, seconds) -> None:
        """``add_other`` of several steps (arrays, in order), one batched update."""
        s = np.asarray(seconds, dtype=float)
        if not len(s):
            return
        x = other_x(batch, nodes, committed)
        w = outlier_weight(s, x @ self.other.stale_theta()) / np.maximum(s, 1e-4) ** 2
        self.other.add_many(x, s, w)

    # ---- prediction -------------------------------------------------------------------------
    # scalar predictions in plain float arithmetic: called per step, where small-array numpy
    # costs more than the arithmetic
    def learn(self, recs: list, forward: list[bool] | None = None) -> None:
        """Fit the forward, draft and other-time models on the decode-only steps of ``recs``
        (``StepRecord``s; the draft model on the speculative ones; the forward model on those
        ``forward`` marks, default all)."""
        fwd = [r for r in recs if r.is_decode_only]
        timed = [r for r, f in zip(recs, forward or [True] * len(recs)) if f and r.is_decode_only]
        self.add_forwards([r.num_forward_tokens for r in timed],
                          [r.context_tokens for r in timed], [r.num_decode for r in timed],
                          [r.forward_time for r in timed])
        spec = [r for r in fwd if r.strategy is not None]
        self.add_drafts([r.num_decode for r in spec], [r.strategy.depth for r in spec],
                        [r.num_drafted if r.num_proposed is None else r.num_proposed
                         for r in spec], [r.draft_time for r in spec], False,
                        [r.num_catch_up for r in spec])
        self.add_others([r.num_decode for r in fwd], [r.num_drafted for r in fwd],
                        [r.num_committed for r in fwd], [r.other_time for r in fwd])

    def sequence_seconds(self, n: int, context: float, depth: int, nodes: float,
                         built: float) -> float:
        """Seconds one of ``n`` sequences (``context`` tokens in all) adds to a step by being
        drafted for: its ``nodes`` verify tokens in the forward plus its share of a draft of
        ``depth`` that builds ``built`` nodes per sequence."""
        base = n * (1 + nodes)
        return (self.forward_time(base, context, n) - self.forward_time(base - nodes, context, n)
                + self.draft_time(n, depth, n * built)
                - self.draft_time(n - 1, depth, (n - 1) * built))

    def forward_time(self, tokens: float, context: float, num_seqs: float) -> float:
        """Predicted seconds of a target forward (never below 0)."""
        c0, c1, c2, c3, c4 = self.forward.theta(self.knee_index).tolist()
        y = (c0 + c1 * tokens + c2 * max(tokens - self.knee, 0.0) + c3 * context
             + c4 * context * tokens / max(num_seqs, 1))
        return max(y, 0.0)

    def draft_time(self, batch: float, depth: float, nodes: float,
                   catch_up: float = 0.0) -> float:
        """Predicted seconds of drafting (0 for no speculation or before any observation),
        after catching up on ``catch_up`` tokens."""
        if depth == 0 or self.num_draft == 0:
            return 0.0
        d0, d1, d2, d3, d4, d5 = self.draft.theta().tolist()
        return max(d0 + d1 * batch + d2 * depth + d3 * depth * batch + d4 * nodes
                   + d5 * catch_up, 0.0)

    def catch_up_time(self, tokens: float) -> float:
        """Predicted seconds a drafter spends catching up on ``tokens`` tokens before it can
        draft (the draft fit's ``catch_up`` term; 0 before any draft was observed)."""
        if self.num_draft == 0:
            return 0.0
        return max(float(self.draft.theta()[5]) * tokens, 0.0)

    def other_time(self, batch: float, nodes: float, committed: float) -> float:
        """Predicted seconds of verify/sampling/bookkeeping."""
        o0, o1, o2, o3, o4 = self.other.theta().tolist()
        return max(o0 + o1 * batch + o2 * nodes + o3 * committed + (o4 if nodes > 0 else 0.0),
                   0.0)

    def step_times(self, batch: float, context: float, depth: np.ndarray, nodes: np.ndarray,
                   committed: np.ndarray, proposed: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds of a decode step for many candidates at once: ``batch`` sequences
        with ``context`` context tokens in all, ``nodes`` draft nodes verified in all per
        candidate (``depth`` deep; ``proposed`` drafted, default ``nodes``), ``committed``
        tokens (arrays of the same length; depth 0 means no speculation): one small matrix
        product per part, for a cheap decision."""
        tokens = batch + nodes
        fx = forward_x(tokens, context, tokens / max(batch, 1), self.knee)
        total = np.maximum(fx @ self.forward.theta(self.knee_index), 0.0)
        if self.num_draft:
            dx = draft_x(batch, depth, nodes if proposed is None else proposed)
            total += np.where(depth > 0, np.maximum(dx @ self.draft.theta(), 0.0), 0.0)
        ox = other_x(batch, nodes, committed)
        return total + np.maximum(ox @ self.other.theta(), 0.0)
