"""``LossGuard``: the budget that keeps ``AutoPolicy`` at least ``1 - alpha`` as fast as no
speculation in every batch-size bucket: exploration (and any speculation) is paid for out of
the time speculation has saved there plus ``alpha`` of the time spent there.

The rule is the conservative bandit's (Wu, Shariff, Lattimore and Szepesvari, "Conservative
Bandits", ICML 2016): the learner may play an arm other than the baseline only while its
cumulative reward, counting that play's worst case, stays above ``1 - alpha`` times what the
baseline would have earned. Here the baseline is no speculation and the reward is time: a
speculative step of ``B`` sequences that committed ``c`` tokens in ``t`` seconds saved
``c / r_off - t`` seconds, ``r_off`` the step's estimated no-speculation rate (tokens/s).
"""

from __future__ import annotations

from specengine.speculative.policy.base import batch_bucket, bucket_label


class LossGuard:
    """Per batch-size bucket (``batch_bucket``), the seconds speculation saved (``saved``,
    negative when it lost) and the seconds of decode steps run (``spent``); a speculative step
    whose worst case would take ``saved + alpha * spent`` below zero is refused (``affords``).

    Both sums fade by ``1 / horizon`` per step of their bucket, so the promise holds over the
    last ~``horizon`` steps of each bucket, not only since the engine started: savings from an
    old workload do not pay for losses on a new one.

    Args:
        alpha: the share of no speculation's speed that may be lost (0.02: at least 0.98x).
        horizon: steps per bucket the sums remember (their fading time constant).
    """

    def __init__(self, alpha: float = 0.02, horizon: int = 2000):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"LossGuard alpha={alpha}: must be in [0, 1)")
        if horizon < 1:
            raise ValueError(f"LossGuard horizon={horizon}: must be >= 1")
        self.alpha, self.fade = alpha, 1.0 - 1.0 / horizon
        self.saved: dict[int, float] = {}  # bucket -> seconds saved by speculation (faded)
        self.spent: dict[int, float] = {}  # bucket -> seconds of decode steps (faded)
        self.refused = 0  # speculative steps refused

    def slack(self, batch: int) -> float:
        """Seconds a step of ``batch`` sequences may still lose: ``saved + alpha * spent``."""
        b = batch_bucket(batch)
        return self.saved.get(b, 0.0) + self.alpha * self.spent.get(b, 0.0)

    def affords(self, batch: int, worst_loss: float) -> bool:
        """True when a step of ``batch`` sequences that may lose ``worst_loss`` seconds against
        no speculation keeps the bucket's slack non-negative; counts a refusal otherwise."""
        if worst_loss <= 0.0 or self.slack(batch) >= worst_loss:
            return True
        self.refused += 1
        return False

    def observe(self, batch: int, step_seconds: float, saved_seconds: float) -> None:
        """A decode step of ``batch`` sequences took ``step_seconds`` and saved
        ``saved_seconds`` against no speculation (0 for a step without it)."""
        b = batch_bucket(batch)
        self.saved[b] = self.saved.get(b, 0.0) * self.fade + saved_seconds
        self.spent[b] = self.spent.get(b, 0.0) * self.fade + step_seconds

    def stats(self) -> dict:
        """``refused`` steps and, per bucket label, ``saved_s`` and ``spent_s``."""
        return {"refused": self.refused,
                "buckets": {bucket_label(b): {"saved_s": round(self.saved[b], 4),
                                              "spent_s": round(self.spent[b], 4)}
                            for b in sorted(self.saved)}}
