"""Expected remaining output per running sequence, from its prompt group's finished lengths, and
the per-sequence weights the policy's draft budget is spread by.

An RL rollout samples ``n`` responses per prompt (a GRPO group) and revisits the same prompts
over epochs, so the output lengths of a group's finished samples, in this ``generate`` call and
in earlier ones, predict how long the samples still running will go on. Seer (arXiv 2511.14617)
estimates a group's length from its finished siblings to schedule the long ones first; DAS
(arXiv 2511.13841) gives sequences with longer predicted remaining output bigger speculation
budgets, because the rollout ends when its longest sequence ends (the makespan). Here:

- ``RemainingLength``: per prompt group (the hash of the prompt's token ids: a request's ``n``
  samples and repeated requests with the same prompt share it) the last ``per_group`` finished
  output lengths, for at most ``max_groups`` groups (least recently used evicted), plus the last
  ``prior_lengths`` lengths of all groups as the prior; ``expected(seq)`` is
  ``E[L - c | L > c]`` for a sequence ``c`` tokens into its output;
- ``length_weights``: the weights ``AutoPolicy`` multiplies each sequence's draft-node value by.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict, deque

#: finish reasons whose output length is a real length (an aborted sequence's is not)
FINISHED = ("stop", "length")


class _Lengths:
    """Recent output lengths (tokens), with a sorted copy and its suffix sums built on demand
    so ``residual`` is one bisection."""

    __slots__ = ("recent", "_sorted", "_prefix")

    def __init__(self, maxlen: int | None):
        self.recent: deque[int] = deque(maxlen=maxlen)
        self._sorted: list[int] | None = None
        self._prefix: list[int] = []

    def add(self, length: int) -> None:
        self.recent.append(length)
        self._sorted = None

    def residual(self, c: int) -> tuple[int, int]:
        """``(count, sum of L - c)`` over the lengths ``L > c``."""
        if self._sorted is None:
            self._sorted = sorted(self.recent)
            self._prefix = list(itertools.accumulate(self._sorted, initial=0))
        i = bisect.bisect_right(self._sorted, c)
        count = len(self._sorted) - i
        return count, self._prefix[-1] - self._prefix[i] - count * c


class RemainingLength:
    """Expected remaining output tokens of running sequences, learnt from finished ones.

    For a sequence ``c`` output tokens in, with its group's finished lengths ``G`` and the prior
    ``P`` (recent lengths of every group):

        E = (sum over L in G, L > c of (L - c)  +  k * prior(c)) / (#{L in G : L > c} + k)

    with ``prior(c)`` = ``E[L - c | L > c]`` over ``P`` (or ``c`` itself when no length in ``P``
    exceeds ``c``: a sequence that outlived every length seen is taken to go on as long again,
    the median remaining life under a ``1/L`` tail) and ``k = prior_count``; then clipped to
    ``[1, max_tokens - c]``. Finished lengths are biased short while a group is still running
    (the short samples finish first); earlier rollouts of the same prompt are not.

    Memory is bounded: ``max_groups * per_group + prior_lengths`` lengths, plus the group key
    of at most ``max_running`` running sequences (dropped when one finishes; the oldest dropped
    beyond that, to be hashed again if still running).

    Args:
        max_groups: prompt groups remembered (least recently used evicted), >= 1.
        per_group: finished lengths kept per group (the most recent), >= 1.
        prior_lengths: lengths kept for the prior, over all groups, >= 1.
        prior_count: ``k``, pseudo-observations of the prior in each group's estimate, > 0.
        max_running: running sequences whose group key is cached, >= 1.

    Raises:
        ValueError: a size below 1 or ``prior_count <= 0``.
    """

    def __init__(self, max_groups: int = 4096, per_group: int = 64, prior_lengths: int = 4096,
                 prior_count: float = 1.0, max_running: int = 65536):
        for name, v in (("max_groups", max_groups), ("per_group", per_group),
                        ("prior_lengths", prior_lengths), ("max_running", max_running)):
            if int(v) < 1:
                raise ValueError(f"RemainingLength {name}={v!r}: must be >= 1")
        if not prior_count > 0:
            raise ValueError(f"RemainingLength prior_count={prior_count!r}: must be > 0")
        self.max_groups, self.per_group = int(max_groups), int(per_group)
        self.prior_count, self.max_running = float(prior_count), int(max_running)
        self.groups: OrderedDict[int, _Lengths] = OrderedDict()
        self.prior = _Lengths(int(prior_lengths))
        self._keys: dict[int, int] = {}  # seq_id -> group key, while the sequence runs
        self.observed = 0  # finished lengths seen

    @staticmethod
    def group_key(prompt_token_ids) -> int:
        """The prompt group of a prompt (token ids): a hash of the ids."""
        return hash(tuple(prompt_token_ids))

    def key(self, seq) -> int:
        """``seq``'s group key (cached per ``seq.seq_id`` while it runs)."""
        k = self._keys.get(seq.seq_id)
        if k is None:
            k = self._keys[seq.seq_id] = self.group_key(seq.prompt_token_ids)
            if len(self._keys) > self.max_running:
                del self._keys[next(iter(self._keys))]
        return k

    def add(self, key: int, length: int) -> None:
        """Remember one finished output of ``length`` tokens in group ``key`` (and the prior);
        the group becomes the most recently used, the least recently used one beyond
        ``max_groups`` is dropped. Raises ValueError for a negative ``length``."""
        if length < 0:
            raise ValueError(f"RemainingLength.add length={length}: must be >= 0")
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = _Lengths(self.per_group)
            if len(self.groups) > self.max_groups:
                self.groups.popitem(last=False)
        else:
            self.groups.move_to_end(key)
        g.add(int(length))
        self.prior.add(int(length))
        self.observed += 1

    def finished(self, seq) -> None:
        """``seq`` (a ``Sequence``) left the engine: its output length is remembered if it
        really finished (``finish_reason`` "stop" or "length"; not when aborted)."""
        key = self._keys.pop(seq.seq_id, None)
        if seq.finish_reason in FINISHED:
            self.add(self.group_key(seq.prompt_token_ids) if key is None else key,
                     seq.num_output_tokens)

    def estimate(self, key: int, c: int, room: int | None = None) -> float | None:
        """Expected remaining tokens of a sequence of group ``key`` with ``c`` output tokens
        (at most ``room`` more); None before any length was observed."""
        if not self.prior.recent:
            return None
        p_count, p_sum = self.prior.residual(c)
        prior = p_sum / p_count if p_count else float(max(c, 1))
        g = self.groups.get(key)
        count, total = g.residual(c) if g is not None else (0, 0)
        if g is not None:
            self.groups.move_to_end(key)
        k = self.prior_count
        e = (total + k * prior) / (count + k)
        if room is not None:
            e = min(e, float(max(room, 1)))
        return max(e, 1.0)

    def expected(self, seq) -> float | None:
        """``estimate`` for ``seq`` (``c`` = its output tokens, ``room`` = ``max_tokens - c``);
        None before any length was observed."""
        if not self.prior.recent:
            return None
        c = seq.num_output_tokens
        return self.estimate(self.key(seq), c, seq.params.max_tokens - c)

    def runs_to_cap(self, seq) -> bool:
        """True when ``seq``'s group has finished outputs longer than ``seq``'s so far and every
        one of them reached ``seq``'s ``max_tokens``: its siblings that got this far all ran
        to the cap (not a guess from the prior)."""
        g = self.groups.get(self.key(seq))
        if g is None:
            return False
        count, _ = g.residual(seq.num_output_tokens)
        return count > 0 and g._sorted[-count] >= seq.params.max_tokens

    def stats(self) -> dict:
        """``groups`` remembered, ``lengths`` held (groups and prior), ``observed`` in all."""
        return {"groups": len(self.groups),
                "lengths": sum(len(g.recent) for g in self.groups.values())
                + len(self.prior.recent), "observed": self.observed}


def length_weights(remaining: list[float], alpha: float = 1.0, low: float = 0.25,
                   high: float = 4.0) -> list[float]:
    """Per-sequence weights of draft nodes from expected remaining output (tokens):

        w_i = clip((R_i / mean(R)) ** alpha, low, high)

    over the sequences of one step. Equal ``R`` (or ``alpha = 0``) gives 1 everywhere, where
    ``AutoPolicy``'s allocation is the unweighted cut. A node's value is its acceptance
    probability times ``w``: a token accepted for a sequence with long expected remaining output
    shortens the rollout's tail (its finish time), one for a sequence about to finish mostly
    does not (DAS arXiv 2511.13841: budgets grow with predicted remaining length; Seer arXiv
    2511.14617: priority-weighted marginal benefit). The clip bounds what a wrong estimate can
    cost. Raises ValueError for a negative ``alpha`` or ``0 < low <= 1 <= high`` violated."""
    if alpha < 0:
        raise ValueError(f"length_weights alpha={alpha!r}: must be >= 0")
    if not 0 < low <= 1 <= high:
        raise ValueError(f"length_weights low={low!r}, high={high!r}: need 0 < low <= 1 <= high")
    if not remaining:
        return []
    mean = sum(remaining) / len(remaining)
    if mean <= 0 or alpha == 0:
        return [1.0] * len(remaining)
    return [min(max((r / mean) ** alpha, low), high) for r in remaining]
