"""``LossGuard``: the budget that keeps ``AutoPolicy`` at least ``1 - alpha`` as fast as no
speculation in every batch-size bucket: exploration (and any speculation) is paid for out of
the time speculation has saved there plus ``alpha`` of the time spent there (less, after
speculation there kept losing: ``backoff``).

The rule is the conservative bandit's (Wu, Shariff, Lattimore and Szepesvari, "Conservative
Bandits", ICML 2016): the learner may play an arm other than the baseline only while its
cumulative reward, counting that play's worst case, stays above ``1 - alpha`` times what the
baseline would have earned. Here the baseline is no speculation and the reward is time: a
speculative step of ``B`` sequences that committed ``c`` tokens in ``t`` seconds saved
``c / r_off - t`` seconds, ``r_off`` the step's estimated no-speculation rate (tokens/s).
"""

from __future__ import annotations

from collections import deque

from specengine.speculative.policy.base import batch_bucket, bucket_label


class LossGuard:
    """Per batch-size bucket (``batch_bucket``), the seconds speculation saved (``saved``,
    negative when it lost) and the seconds of loss it is allowed (``allowance``: ``alpha``
    of each decode step's seconds); a speculative step whose worst case would take
    ``saved + allowance`` below zero is refused (``affords``).

    Both sums fade by ``1 / horizon`` per step of their bucket, so the promise holds over the
    last ~``horizon`` steps of each bucket, not only since the engine started: savings from an
    old workload do not pay for losses on a new one.

    The worst case a step is allowed on is the policy's model of it, which may be wrong (a
    cost the models never saw); so per bucket the guard keeps ``underestimate``: how many
    times the modelled worst case the real loss of a speculative step has been (the largest
    ratio learnt, as below, fading 10% towards 1 with each step that lost less), and asks for
    that many times the modelled worst case in slack. A loss within a plain step's own noise
    (``observe``) is no such evidence: it is charged to ``saved`` but teaches neither this nor
    ``backoff``. Nor is one step's loss beyond it alone: on a shared CPU a plain step can run
    20-40% slower for seconds at a time, and a ratio learnt from one such step (28x, on one
    loss of 2 ms where 0.1 ms was modelled) kept a bucket from speculating for hundreds of
    steps. So a ratio counts once ``confirm`` modelled steps in a row have shown it (the
    smallest of their ratios is learnt); every loss is charged to ``saved`` all the same.

    Where speculation keeps losing, exploring costs ``alpha`` for nothing; so per bucket each
    modelled speculative step that lost (beyond the noise) while the bucket's recent
    speculative steps lost on balance (``recent``: their savings, fading by ``1 / memory``
    per such step) doubles ``backoff`` (up to ``max_backoff``), and it is reset to 1 once
    they saved on balance; the allowance grows by ``alpha / backoff`` of a step's seconds
    (beyond the step's fixed ``overhead``, which it earns back in full, up to ``alpha`` of a
    step; a step's overhead beyond that, as when the policy learns from 64 steps at once, is
    earned back over the next steps): after a run of losses the bucket tries again
    ``backoff`` times less often, and loses that much less (as the kernels' thread tuner
    backs off its probes, ``ops.threads``). On balance, not step by step: a step's saving is
    one draw of its acceptance (one sequence's chain is rejected at its first node about one
    step in three even where speculation pays 1.4x), and doubling on each such loss, reset
    by the next win, had left a batch-1 bucket at backoff 4-8 after a few unlucky steps, its
    slack growing 4-8x slower: in qwen2.5-0.5B rollouts (``bench/rl_epochs.py``) a batch-1
    tail ran idle for most of its steps (1.00x over 356 steps in one epoch); counted on
    balance, 215 of the 227 steps at batch 1 of the same rollout speculated.

    Args:
        alpha: the share of no speculation's speed that may be lost (0.02: at least 0.98x).
        horizon: steps per bucket the sums remember (their fading time constant).
        max_backoff: the largest divisor of ``alpha`` (>= 1; 1: no backing off).
        confirm: modelled speculative steps in a row whose losses ``underestimate`` learns
            from (>= 1; 1: every step's ratio alone).
        memory: modelled speculative steps per bucket ``recent`` remembers (its fading time
            constant, >= 1; 1: the last step alone, each loss doubling ``backoff``).
    """

    def __init__(self, alpha: float = 0.02, horizon: int = 2000, max_backoff: int = 8,
                 confirm: int = 2, memory: int = 10):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"LossGuard alpha={alpha}: must be in [0, 1)")
        if horizon < 1:
            raise ValueError(f"LossGuard horizon={horizon}: must be >= 1")
        if max_backoff < 1:
            raise ValueError(f"LossGuard max_backoff={max_backoff}: must be >= 1")
        if confirm < 1:
            raise ValueError(f"LossGuard confirm={confirm}: must be >= 1")
        if memory < 1:
            raise ValueError(f"LossGuard memory={memory}: must be >= 1")
        self.alpha, self.fade = alpha, 1.0 - 1.0 / horizon
        self.max_backoff = max_backoff
        self.saved: dict[int, float] = {}  # bucket -> seconds saved by speculation (faded)
        self.spent: dict[int, float] = {}  # bucket -> seconds of decode steps (faded)
        self.allowance: dict[int, float] = {}  # bucket -> seconds it may lose (faded)
        self.backoff: dict[int, int] = {}  # bucket -> divisor of alpha (absent: 1)
        self.owed: dict[int, float] = {}  # bucket -> overhead seconds not earned back yet
        self.refused = 0  # speculative steps refused
        self.underestimate: dict[int, float] = {}  # bucket -> real / modelled worst loss
        self.confirm = confirm
        self._ratios: dict[int, deque] = {}  # bucket -> the last ``confirm`` steps' ratios
        self.recent: dict[int, float] = {}  # bucket -> recent speculative steps' savings
        self._recent_fade = 1.0 - 1.0 / memory

    def slack(self, batch: int) -> float:
        """Seconds a step of ``batch`` sequences may still lose: ``saved + allowance``."""
        b = batch_bucket(batch)
        return self.saved.get(b, 0.0) + self.allowance.get(b, 0.0)

    def covers(self, batch: int, worst_loss: float) -> bool:
        """True when a step of ``batch`` sequences that may lose ``worst_loss`` seconds against
        no speculation (as modelled; times the bucket's ``underestimate``) keeps the bucket's
        slack non-negative."""
        worst_loss *= self.underestimate.get(batch_bucket(batch), 1.0)
        return worst_loss <= 0.0 or self.slack(batch) >= worst_loss

    def steps_to_cover(self, batch: int, worst_loss: float, step_seconds: float) -> int:
        """A lower bound on the plain steps of ``step_seconds`` (at most) each, at ``batch``
        sequences, after which the slack could cover ``worst_loss`` (as ``covers`` asks it):
        0 when it covers it now; the allowance grows by at most ``alpha / backoff`` of a
        step's seconds per plain step (fading only shrinks it)."""
        b = batch_bucket(batch)
        need = worst_loss * self.underestimate.get(b, 1.0) - self.slack(batch)
        rate = self.alpha / self.backoff.get(b, 1) * step_seconds
        if need <= 0.0:
            return 0
        return int(need / rate) if rate > 0.0 else 1 << 30

    def affords(self, batch: int, worst_loss: float) -> bool:
        """``covers``, counting a refusal when it does not."""
        if self.covers(batch, worst_loss):
            return True
        self.refused += 1
        return False

    def observe(self, batch: int, step_seconds: float, saved_seconds: float,
                worst_loss: float | None = None, noise: float = 0.0,
                overhead: float = 0.0, expected_saved: float | None = None) -> None:
        """A decode step of ``batch`` sequences took ``step_seconds`` and saved
        ``saved_seconds`` against no speculation (0 for a step without it); a speculative
        step the policy modelled also gives the ``worst_loss`` it was allowed on (seconds, as
        modelled) and the ``noise`` of one step's time (seconds: how much slower than usual
        a plain step of this size can be with nothing changed). ``saved`` takes the whole
        loss, but only the part beyond ``noise`` counts as the model underestimating it or as
        a loss for ``backoff``: one step's loss is a sample, and on a busy CPU a plain step
        alone can be 20% slower than the median. ``overhead``: the seconds of ``saved``'s loss
        that every step pays whether it speculates or not (the policy's own time, storing
        features for the drafter); ``backoff`` divides only the rest of the allowance, the
        part left for exploring, so a bucket that backed off still earns its overhead back
        (else, where the overhead exceeds ``alpha / backoff`` of a step, it would never
        speculate again). A step earns back at most ``alpha`` of its seconds; the rest of
        its overhead is owed (``owed``, fading as the sums do) and earned back by the next
        steps first: a policy that learns in one 2.5 ms burst every 64 plain steps of 10 ms
        pays 0.04 ms a step on average, well within ``alpha``'s 0.2 ms, but earning back only
        0.2 ms of each burst had kept a bucket's slack from ever growing.

        ``expected_saved``: what the step would have saved at its strategy's mean acceptance
        (seconds; None: ``saved_seconds``). ``recent``, which decides ``backoff``, sums these:
        sparse probes at batch 1, each a single draw rejected about one time in three where
        speculation pays 1.4x, had backed a bucket off to 8 after two unlucky ones in a row
        and left it idle for 250 steps (qwen2.5-0.5B, an RL epoch's batch-1 tail). ``saved``
        takes the real saving, so the slack still bounds what speculation loses."""
        b = batch_bucket(batch)
        self.saved[b] = self.saved.get(b, 0.0) * self.fade + saved_seconds
        self.spent[b] = self.spent.get(b, 0.0) * self.fade + step_seconds
        share = self.alpha * step_seconds
        owed = self.owed.get(b, 0.0) * self.fade + max(overhead, 0.0)
        fixed = min(owed, share)
        self.owed[b] = owed - fixed
        self.allowance[b] = (self.allowance.get(b, 0.0) * self.fade
                             + fixed + (share - fixed) / self.backoff.get(b, 1))
        if worst_loss is None:
            return
        excess = -saved_seconds - max(noise, 0.0)  # the loss no plain step's spread explains
        recent = self.recent.get(b, 0.0) * self._recent_fade + (
            saved_seconds if expected_saved is None else expected_saved)
        self.recent[b] = recent
        if excess > 0 and recent < 0:
            self.backoff[b] = min(self.max_backoff, 2 * self.backoff.get(b, 1))
        elif recent > 0:
            self.backoff.pop(b, None)
        if worst_loss > 0:
            ratios = self._ratios.setdefault(b, deque(maxlen=self.confirm))
            ratios.append(excess / worst_loss)
            u = 1.0 + 0.9 * (self.underestimate.get(b, 1.0) - 1.0)
            self.underestimate[b] = max(u, min(ratios)) if len(ratios) == self.confirm else u

    def stats(self) -> dict:
        """``refused`` steps and, per bucket label, ``saved_s``, ``spent_s``,
        ``allowance_s``, ``owed_s`` (overhead not earned back yet), ``backoff`` and
        ``underestimate``."""
        return {"refused": self.refused,
                "buckets": {bucket_label(b): {"saved_s": round(self.saved[b], 4),
                                              "spent_s": round(self.spent[b], 4),
                                              "allowance_s": round(self.allowance[b], 4),
                                              "owed_s": round(self.owed.get(b, 0.0), 4),
                                              "backoff": self.backoff.get(b, 1),
                                              "underestimate": round(
                                                  self.underestimate.get(b, 1.0), 2)}
                            for b in sorted(self.saved)}}
