"""``RescoreBudget``: for how many steps ``AutoPolicy`` reuses the scores of an unchanged batch
size, so that re-scoring (and the learning batched into it) costs a fixed share of step time."""

from __future__ import annotations

import math


class RescoreBudget:
    """How often the candidates are scored again for an unchanged batch size.

    Scores are recomputed when the batch size changes, else after ``every`` steps: as many as
    keep re-scoring within ``budget`` of step time (the models move little per step), at most
    32, and at most 1 + (decode steps so far) / 2 while the models are young. ``AutoPolicy``
    learns from its recorded steps at each re-scoring, or once ``every`` steps are pending, so
    the policy's own time stays a small share of a step even on a CPU.

    Args:
        budget: share of step time re-scoring may cost (0.0025: 0.25%).
    """

    def __init__(self, budget: float = 0.0025):
        self.budget = budget
        self.every = 1
        self.cost = 0.0  # seconds per re-scoring (moving average)
        self.mean_step = 0.0  # seconds per decode step (moving average)
        self.decode_steps = 0
        self.scored_for: tuple[int, int] = (-1, 0)  # (batch, steps since scored)

    def reuse(self, batch: int, have_scores: bool) -> bool:
        """True (and the step counted) when the last scores, if any (``have_scores``), still
        serve a step of ``batch`` sequences."""
        last_batch, age = self.scored_for
        if last_batch == batch and age < self.every and have_scores:
            self.scored_for = (batch, age + 1)
            return True
        return False

    def age(self) -> None:
        """A step passed without the scores (the policy had nothing to choose): they count
        one step older."""
        batch, age = self.scored_for
        self.scored_for = (batch, age + 1)

    def rescored(self, batch: int, seconds: float) -> None:
        """The scores for ``batch`` sequences were just computed, in ``seconds``: ``every`` is
        set again from the costs so far."""
        self.scored_for = (batch, 1)
        self.cost = seconds if not self.cost else 0.9 * self.cost + 0.1 * seconds
        if self.mean_step:  # young models change fast: re-scored more often at first
            self.every = min(32, 1 + self.decode_steps // 2, max(1, math.ceil(
                self.cost / (self.budget * self.mean_step))))

    def observe_step(self, seconds: float) -> None:
        """A decode-only step (those the re-scoring is spread over) took ``seconds``."""
        self.decode_steps += 1
        self.mean_step = seconds if not self.mean_step else \
            0.9 * self.mean_step + 0.1 * seconds
