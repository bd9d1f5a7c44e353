"""Step-time model fitted online: how long a step takes for a batch and a draft strategy.

A step costs drafting + one target forward + everything else (verify, sampling, bookkeeping):

- **forward** (seconds) = ``c0 + c1*n + c2*max(0, n - knee) + c3*ctx + c4*qctx`` with ``n`` the
  tokens in the forward, ``ctx`` the context tokens of the batch (KV positions attended, summed
  over sequences) and ``qctx`` = ctx x tokens per sequence (attention reads the context once per
  query token on backends that do not share it across a tree). Piecewise-linear in ``n``: flat
  while the forward is memory-bound, a steeper slope once it is compute-bound (RLHFSpec arXiv
  2512.04752 models verification cost the same way). The knee is chosen among powers of two by
  the smallest weighted residual, so no machine constant is written down anywhere.
- **draft** = ``d0 + d1*B + d2*depth + d3*depth*B + d4*nodes`` when speculating (0 otherwise):
  fits a free n-gram lookup (all ~0), a draft model (a forward of B tokens per depth) and an
  EAGLE head alike.
- **other** = ``o0 + o1*B + o2*nodes + o3*committed``.

Each part is a weighted least-squares fit on relative error (weight 1/y^2), kept as sufficient
statistics: a fixed prior from the start-up profile (``profile_forward``) plus online statistics
that decay by ``decay`` per step, so the model follows a changed machine or model within a few
hundred steps while the profile still anchors directions the online data does not cover.
"""

from __future__ import annotations

import time

import numpy as np

KNEES = tuple(2 ** i for i in range(14))  # candidate knee positions (tokens): 1 .. 8192


def nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin theta' a theta - 2 b' theta`` subject to ``theta >= 0`` (``a`` symmetric
    positive definite): Lawson and Hanson's active-set NNLS on the normal equations. Every
    feature here adds work, so a negative coefficient is an artefact of noise or collinearity
    and would extrapolate to negative times."""
    n = len(b)
    theta = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(float(np.abs(b).max()), 1e-300)
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
    fixed prior.

    Args:
        dim: number of features.
        decay: factor applied to the online statistics at every update (1: never forget).
        ridge: relative ridge on the diagonal, for numerical stability only.
    """

    def __init__(self, dim: int, decay: float = 0.998, ridge: float = 1e-6):
        self.decay, self.ridge = decay, ridge
        self.prior_a = np.zeros((dim, dim))
        self.prior_b = np.zeros(dim)
        self.prior_yy = 0.0
        self.a = np.zeros((dim, dim))
        self.b = np.zeros(dim)
        self.yy = 0.0
        self._theta: np.ndarray | None = None

    def add(self, x: np.ndarray, y: float, weight: float = 1.0, prior: bool = False) -> None:
        """Add observation ``(x, y)``; ``prior=True`` adds it to the fixed prior instead."""
        if prior:
            self.prior_a += weight * np.outer(x, x)
            self.prior_b += weight * y * x
            self.prior_yy += weight * y * y
        else:
            d = self.decay
            self.a = d * self.a + weight * np.outer(x, x)
            self.b = d * self.b + weight * y * x
            self.yy = d * self.yy + weight * y * y
        self._theta = None

    @property
    def theta(self) -> np.ndarray:
        """Current coefficients (zeros before any data)."""
        if self._theta is None:
            a = self.prior_a + self.a
            a = a + self.ridge * np.diag(np.maximum(np.diag(a), 1e-30))
            self._theta = nonnegative_solve(a, self.prior_b + self.b)
        return self._theta

    @property
    def residual(self) -> float:
        """Weighted sum of squared residuals of the current fit (prior and online data)."""
        t = self.theta
        a, b = self.prior_a + self.a, self.prior_b + self.b
        return float(self.prior_yy + self.yy - 2 * t @ b + t @ a @ t)


def outlier_weight(seconds: float, predicted: float, limit: float = 3.0) -> float:
    """Down-weighting of a measurement more than ``limit`` times slower than predicted (a
    descheduled thread, a garbage collection): its relative residual counts as ``limit``
    (Huber-style), so a machine that really got slower still moves the fit, only gradually."""
    if predicted <= 0 or seconds <= limit * predicted:
        return 1.0
    return (limit * predicted / seconds) ** 2


def forward_x(tokens: float, context: float, per_seq: float, knee: int) -> np.ndarray:
    """Features of the forward-time fit (see the module docstring)."""
    return np.array([1.0, tokens, max(0.0, tokens - knee), context, context * per_seq])


def draft_x(batch: float, depth: float, nodes: float) -> np.ndarray:
    """Features of the draft-time fit: the work of drafting ``nodes`` nodes ``depth`` deep for
    ``batch`` sequences."""
    return np.array([1.0, batch, depth, depth * batch, nodes])


def other_x(batch: float, nodes: float, committed: float) -> np.ndarray:
    """Features of the verify/sample/bookkeeping-time fit."""
    return np.array([1.0, batch, nodes, committed])


class LatencyModel:
    """Predicts step time (seconds) from batch shape; learns from every step.

    Args:
        decay: forgetting factor per observed step for the online statistics.
        prior_weight: weight of each profile point relative to one online step.
    """

    def __init__(self, decay: float = 0.998, prior_weight: float = 20.0):
        self.prior_weight = prior_weight
        self.forward = {k: WeightedLeastSquares(5, decay) for k in KNEES}
        self.draft = WeightedLeastSquares(5, decay)
        self.other = WeightedLeastSquares(4, decay)
        self.knee = KNEES[0]
        self.num_forward = 0  # forward observations (profile included)
        self.num_draft = 0

    # ---- learning ---------------------------------------------------------------------------
    def add_forward(self, tokens: int, context: int, num_seqs: int, seconds: float,
                    prior: bool = False) -> None:
        """One measured target forward of ``tokens`` tokens over ``num_seqs`` sequences with
        ``context`` context tokens in all; ``prior`` marks a start-up profile point."""
        if seconds <= 0 or tokens <= 0:
            return
        w = (self.prior_weight if prior else 1.0) / seconds ** 2
        if not prior and self.num_forward:
            w *= outlier_weight(seconds, self.forward_time(tokens, context, num_seqs))
        per_seq = tokens / max(num_seqs, 1)
        for k, fit in self.forward.items():
            fit.add(forward_x(tokens, context, per_seq, k), seconds, w, prior)
        self.num_forward += 1
        if self.num_forward < 64 or self.num_forward % 16 == 0:
            self.knee = min(self.forward, key=lambda k: self.forward[k].residual)

    def add_draft(self, batch: int, depth: int, nodes: int, seconds: float,
                  prior: bool = False) -> None:
        """Drafting ``nodes`` nodes up to ``depth`` deep for ``batch`` sequences took
        ``seconds``."""
        w = (self.prior_weight if prior else 1.0) / max(seconds, 1e-4) ** 2
        if not prior and self.num_draft:
            w *= outlier_weight(seconds, self.draft_time(batch, depth, nodes))
        self.draft.add(draft_x(batch, depth, nodes), seconds, w, prior)
        self.num_draft += 1

    def add_other(self, batch: int, nodes: int, committed: int, seconds: float) -> None:
        """Verify, sampling and bookkeeping of a step took ``seconds``."""
        w = outlier_weight(seconds, self.other_time(batch, nodes, committed)) \
            / max(seconds, 1e-4) ** 2
        self.other.add(other_x(batch, nodes, committed), seconds, w)

    # ---- prediction -------------------------------------------------------------------------
    def forward_time(self, tokens: float, context: float, num_seqs: float) -> float:
        """Predicted seconds of a target forward (never below 0)."""
        x = forward_x(tokens, context, tokens / max(num_seqs, 1), self.knee)
        return max(float(x @ self.forward[self.knee].theta), 0.0)

    def draft_time(self, batch: float, depth: float, nodes: float) -> float:
        """Predicted seconds of drafting (0 for no speculation or before any observation)."""
        if depth == 0 or self.num_draft == 0:
            return 0.0
        return max(float(draft_x(batch, depth, nodes) @ self.draft.theta), 0.0)

    def other_time(self, batch: float, nodes: float, committed: float) -> float:
        """Predicted seconds of verify/sampling/bookkeeping."""
        return max(float(other_x(batch, nodes, committed) @ self.other.theta), 0.0)

    def step_time(self, batch: float, context: float, depth: float, nodes: float,
                  committed: float) -> float:
        """Predicted seconds of a decode step: ``batch`` sequences with ``context`` context
        tokens in all, ``nodes`` draft nodes in all (``depth`` deep), ``committed`` tokens."""
        return (self.forward_time(batch + nodes, context, batch)
                + self.draft_time(batch, depth, nodes)
                + self.other_time(batch, nodes, committed))


def profile_forward(runner, blocks, model: LatencyModel, budget_s: float = 1.5,
                    proposer=None) -> int:
    """Warm-start ``model`` by timing dummy decode forwards of growing size with ``runner`` (a
    ``ModelRunner``) over KV blocks borrowed from ``blocks`` (returned afterwards), and, when a
    ``proposer`` is given, drafting for dummy sequences. Stops once ``budget_s`` seconds are
    spent or the pool is too small. Returns the number of profile points added.

    The points span 1 .. 512 forward tokens, chains of 0, 3 and 7 nodes per sequence and short
    and long contexts, so each feature of the forward fit is seen. The KV contents are whatever
    the pool holds (timing does not depend on them); the engine's sequences are not touched.
    """
    import torch

    from specengine.sampling import SamplingParams
    from specengine.scheduler import BatchEntry
    from specengine.sequence import Sequence
    from specengine.spec.strategy import Strategy
    from specengine.spec.tree import DraftTree

    # (sequences, chain nodes per sequence, context per sequence)
    grid = [(1, 0, 32), (1, 0, 32), (1, 3, 32), (1, 7, 512), (4, 3, 64), (16, 0, 64),
            (1, 0, 1024), (16, 7, 64), (64, 3, 64), (8, 0, 512), (64, 7, 128), (128, 3, 64)]
    params = SamplingParams(temperature=0.0)
    start = time.perf_counter()
    added = 0
    for i, (b, m, ctx) in enumerate(grid):
        if time.perf_counter() - start > budget_s:
            break
        need = b * -(-(ctx + 1 + m) // blocks.block_size)
        if need > blocks.num_free:
            continue
        seqs, entries = [], []
        for _ in range(b):
            s = Sequence("profile", 0, [1] * (ctx + 1), params, torch.Generator())
            blocks.grow(s, ctx + 1 + m)
            s.num_cached = ctx
            tree = DraftTree([1] * m, list(range(-1, m - 1))) if m else None
            seqs.append(s)
            entries.append(BatchEntry(s, 1, [s], tree=tree))
        try:
            t0 = time.perf_counter()
            runner.run(entries, blocks)
            seconds = time.perf_counter() - t0
            if i > 0:  # the first forward pays one-off allocations
                model.add_forward(b * (1 + m), b * ctx, b, seconds, prior=True)
                added += 1
            if proposer is not None and m and b * ctx <= 1024:
                proposer.propose(seqs, Strategy(m))  # a draft model catches up on the context
                t0 = time.perf_counter()
                trees = proposer.propose(seqs, Strategy(m))
                seconds = time.perf_counter() - t0
                nodes = sum(t.num_nodes for t in trees if t is not None)
                model.add_draft(b, m, nodes, seconds, prior=True)
        finally:
            for s in seqs:
                blocks.free(s)
                if proposer is not None:
                    proposer.release(s)
    return added
