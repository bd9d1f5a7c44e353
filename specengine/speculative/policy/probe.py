"""``ProbeSchedule``: when ``AutoPolicy`` runs a step its current choice would not (a chain for
a few sequences while speculation is off, no speculation on a close call), so both sides stay
measured."""

from __future__ import annotations

from specengine.speculative.strategy import Strategy


class ProbeSchedule:
    """When a step is a probe: it measures what the current choice cannot.

    Probes fall 4, 8, 16, ... steps after speculation was switched on or off (not between two
    strategies), then every ``every`` steps. While speculation is off, a probe runs the best
    chain for the sequences tied for the longest remaining output (as the policy counts them)
    and at least ``seqs`` in all (``drafted``: the rest those the drafter has the least to
    catch up on), so the acceptance statistics stay current at the cost of a few forward
    tokens and a short catch-up where the batch's finish hangs on a few sequences, and a probe
    of a batch that ends together (a GRPO group before any sample finished) is a step that can
    pay for itself. While speculating and
    predicted less than ``margin`` better than no speculation, a probe runs a step without it,
    so the latency model sees both sides of a close call instead of extrapolating to the one
    not taken.

    Args:
        candidates: the policy's candidates; an off probe runs the best chain among them.
        every: steps between probes once the schedule has spread out (0: never probe).
        seqs: the fewest sequences drafted for in an off probe.
        margin: relative margin below which speculation versus none is a close call.
    """

    def __init__(self, candidates: tuple, every: int = 50, seqs: int = 4, margin: float = 0.25):
        self.chains = [s for s in candidates if s is not None and s.is_chain]
        self.every, self.seqs, self.margin = every, seqs, margin
        self.active = False  # the step being run is a probe
        self.count = 0  # off probes so far (rotates the sequences they draft for)
        self.steps_held, self.next_probe = 0, 4  # steps since speculation went on/off; next probe

    def pick(self, previous: Strategy | None, current: Strategy | None,
             scores: dict[Strategy | None, float]) -> Strategy | None:
        """The step's strategy: ``current`` (the policy's choice; ``previous`` the one before
        it), or a probe when one is due; ``scores`` the step's score per candidate (tokens/s).
        Sets ``active``."""
        if (current is None) != (previous is None):  # on <-> off restarts the probes
            self.steps_held, self.next_probe = 0, 4
        self.active = False
        self.steps_held += 1
        if not self.every or self.steps_held < self.next_probe:
            return current
        self.next_probe = min(2 * self.next_probe, self.steps_held + self.every)
        if current is None:
            # the best chain: cheap, and it refreshes the rates every prior builds on
            if self.chains:
                self.active = True
                self.count += 1
                return max(self.chains, key=scores.get)
        elif scores[current] < (1 + self.margin) * scores[None]:
            self.active = True  # a close call: measure the baseline too
            return None
        return current

    def drafted(self, catch_up: list[int], tied: list[bool] | None = None) -> list[bool]:
        """Which decoding sequences (``catch_up``: per sequence, the tokens a stateful
        drafter would catch up on before drafting for it, ``Sequence.catch_up``; at least
        one) an off probe drafts for: every sequence ``tied`` marks (those tied for the
        longest expected remaining output, whose mean commit moves the batch's finish: a
        probe for a few of 16 tied sequences moved it by a few sixteenths of their acceptance
        and paid a verify's fixed costs in full, so each lost 10-25 ms in qwen2.5-0.5B
        rollouts and measured nothing a whole step would do), then up to ``seqs`` in all
        those with the least catch-up, so after the first probe the next ones feed the
        drafter only the tokens since the last (not each sequence's whole history); among
        equals, the next few along at each probe."""
        n = len(catch_up)
        keep = list(tied) if tied is not None else [False] * n
        k = min(self.seqs, n)
        first = self.count * k % n
        order = sorted((i for i in range(n) if not keep[i]),
                       key=lambda i: (catch_up[i], (i - first) % n))
        for i in order[:max(k - sum(keep), 0)]:
            keep[i] = True
        return keep
