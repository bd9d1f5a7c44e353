"""Speculation policy: which strategy (tree shape, or none) each step uses.

``StaticPolicy`` always uses the configured strategy. Adaptive policies (cost model, bandit)
implement the same two calls: ``choose`` before the step, ``record`` after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specengine.spec.strategy import Strategy


@dataclass
class StepRecord:
    """What one engine step did and cost (tokens, seconds).

    Attributes:
        strategy: the strategy used (None: no speculation).
        num_decode: sequences decoded (each verified one tree or took one plain token).
        num_prefill_tokens: prompt tokens in the same forward.
        num_forward_tokens: all tokens in the target forward (prefill + roots + draft nodes).
        context_tokens: sum of the decode sequences' context lengths (KV positions attended).
        num_drafted: draft nodes sent to the target.
        num_committed: tokens committed by the decode sequences (accepted + bonus/plain).
        accepted_per_seq: accepted draft tokens per decode sequence with a tree.
        draft_time, forward_time, other_time: seconds spent drafting, in the target forward,
            and sampling/verifying/bookkeeping.
    """

    strategy: Strategy | None
    num_decode: int
    num_prefill_tokens: int
    num_forward_tokens: int
    context_tokens: int
    num_drafted: int
    num_committed: int
    accepted_per_seq: list[int]
    draft_time: float
    forward_time: float
    other_time: float


class StaticPolicy:
    """Always the same strategy (``None``: never speculate)."""

    name = "static"

    def __init__(self, strategy: Strategy | None):
        self.strategy = strategy

    def choose(self, num_running: int) -> Strategy | None:
        """Strategy for the next step, given the number of running sequences."""
        return self.strategy

    def record(self, rec: StepRecord) -> None:
        """Learn from the step just run (nothing for a static policy)."""
