"""``BanditPolicy``: TLT's bucketed epsilon-greedy bandit (BEG-MAB, arXiv 2511.16665), the
baseline ``AutoPolicy`` is compared against. It models nothing: per batch-size bucket
(``base.batch_bucket``), each strategy's measured committed tokens per second only.
"""

from __future__ import annotations

import random
import time
from collections import deque

from specengine.speculative.policy.base import Policy, StepRecord, batch_bucket
from specengine.speculative.strategy import Strategy


class BanditPolicy(Policy):
    """Bucketed epsilon-greedy bandit (TLT's BEG-MAB, arXiv 2511.16665).

    Batch sizes fall into power-of-two buckets; in each bucket every arm (strategy) keeps its
    last ``window`` rewards (committed tokens per second of decode-only steps). Untried arms
    are tried first; then with probability ``epsilon`` a random arm, else the arm with the best
    mean reward.

    Args:
        candidates: arms; ``None`` (no speculation) is always added.
        epsilon: exploration probability.
        window: rewards kept per arm and bucket.
        seed: seeds the exploration RNG (decisions are reproducible).
    """

    name = "bandit"

    def __init__(self, candidates: list[Strategy | None], epsilon: float = 0.1,
                 window: int = 32, seed: int = 0):
        super().__init__()
        self.arms = [None] + [s for s in dict.fromkeys(candidates) if s is not None]
        self.epsilon, self.window = epsilon, window
        self.rng = random.Random(seed)
        self.rewards: dict[tuple[int, Strategy | None], deque] = {}
        self._chosen: tuple[int, Strategy | None] | None = None

    def mean_reward(self, bucket: int, arm: Strategy | None) -> float | None:
        """Mean of the kept rewards (committed tokens/s) of ``arm`` in ``bucket``; None when
        untried."""
        r = self.rewards.get((bucket, arm))
        return sum(r) / len(r) if r else None

    def choose(self, num_running: int) -> Strategy | None:
        t0 = time.perf_counter()
        bucket = batch_bucket(num_running)
        means = {a: self.mean_reward(bucket, a) for a in self.arms}
        untried = [a for a, m in means.items() if m is None]
        if untried:
            arm = untried[0]
        elif self.rng.random() < self.epsilon:
            arm = self.rng.choice(self.arms)
        else:
            arm = max(self.arms, key=means.get)
        self._chosen = (bucket, arm)
        self._predicted = means[arm]
        self.decision_time += time.perf_counter() - t0
        return arm

    def record(self, rec: StepRecord) -> None:
        self._tally(rec)
        if not rec.is_decode_only or self._chosen is None:
            return
        bucket, arm = self._chosen
        if arm != rec.strategy:
            return
        reward = rec.num_committed / max(rec.step_time, 1e-9)
        self.rewards.setdefault((bucket, arm), deque(maxlen=self.window)).append(reward)
