"""``CorrectionTable``: per batch-size bucket and candidate, observed over modelled committed
tokens per second: what ``AutoPolicy``'s latency and acceptance models miss."""

from __future__ import annotations

import numpy as np

from specengine.speculative.policy.base import batch_bucket


class CorrectionTable:
    """Per batch-size bucket (``batch_bucket``) and candidate, the moving average of observed
    over modelled committed tokens per second of the steps that candidate ran: what the
    latency and acceptance models miss (e.g. a drafter's real cost). Each step that updates a
    bucket first fades all its factors 1% back towards 1, so a strategy judged on another
    workload is tried again.

    A young cell learns fast: its first steps are averaged (each of the first ~10 weighs
    ``1 / (steps so far)`` rather than ``RATE``), and it is trusted fully after ``TRUSTED``
    evidence (~3 steps), so one or two steps of a strategy far slower than modelled turn it
    off. A cell with less evidence borrows, in proportion to what it lacks, from the nearest
    cell that has it (``_borrowed``): nearest in bucket first, then the same candidate, then
    nearest in candidate order; speculative candidates borrow only from speculative ones, no
    speculation only from itself in another bucket; 1 when nothing is measured.
    The models' errors are shared that way (a drafter's cost they miss at depth 1 they also
    miss at depth 2 and one bucket up), so a strategy never run is not preferred just
    because nothing has corrected it yet.

    Args:
        num_candidates: factors per bucket (indexed in the policy's candidate order; index 0
            is no speculation).
    """

    FADE = 0.01  # per update of a bucket, of every factor towards 1 and of every evidence
    RATE = 0.1  # weight of one step's ratio in its cell's moving average (once ~10 steps in)
    TRUSTED = 0.3  # evidence (~3 steps) after which a cell no longer borrows

    def __init__(self, num_candidates: int):
        self.num_candidates = num_candidates
        self.per_bucket: dict[int, np.ndarray] = {}  # bucket -> [num_candidates] factors
        self.evidence: dict[int, np.ndarray] = {}  # bucket -> [num_candidates], ~steps / 10

    def factors(self, batch: int) -> np.ndarray | float:
        """The ``[num_candidates]`` factors for a batch of ``batch`` sequences (1.0 before any
        step was observed)."""
        if not self.per_bucket:
            return 1.0
        b = batch_bucket(batch)
        n = self.num_candidates
        own = self.per_bucket.get(b, np.ones(n))
        w = np.minimum(self.evidence.get(b, np.zeros(n)) / self.TRUSTED, 1.0)
        if (w >= 1.0).all():
            return own
        return w * own + (1.0 - w) * np.array([self._borrowed(b, i) for i in range(n)])

    def _borrowed(self, bucket: int, i: int) -> float:
        """The factor cell ``(bucket, i)`` borrows: the measured cell nearest in bucket, then
        the same candidate, then nearest in candidate order (speculative candidates borrow
        from speculative ones only, no speculation from itself); 1 when there is none."""
        spec = i > 0
        cells = [(abs(k - bucket), j != i, abs(j - i), k, j) for k, e in self.evidence.items()
                 for j in range(self.num_candidates)
                 if e[j] >= self.TRUSTED and (j > 0) == spec and (k, j) != (bucket, i)]
        if not cells:
            return 1.0
        *_, k, j = min(cells)
        return float(self.per_bucket[k][j])

    def observe(self, batch: int, index: int, observed: float, modelled: float) -> None:
        """A step of ``batch`` sequences under candidate ``index`` committed ``observed``
        tokens/s where the models predicted ``modelled`` (> 0); the ratio is clipped to
        [0.25, 4] per step."""
        b = batch_bucket(batch)
        corr = self.per_bucket.setdefault(b, np.ones(self.num_candidates))
        ev = self.evidence.setdefault(b, np.zeros(self.num_candidates))
        corr += (1.0 - corr) * self.FADE  # unrefreshed corrections fade (the workload changes)
        ev *= 1.0 - self.FADE
        ratio = min(max(observed / modelled, 0.25), 4.0)
        w = max(self.RATE, self.RATE / (ev[index] + self.RATE))  # 1, 1/2, 1/3, ... then RATE
        corr[index] = (1.0 - w) * corr[index] + w * ratio
        ev[index] += self.RATE
