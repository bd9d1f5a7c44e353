"""The policy interface and the fixed policies.

A policy decides, step by step, what the engine speculates. The engine calls, per step:
``choose(num_running)`` for the step's ``Strategy`` (or None: no speculation), then, when it
speculates, ``select(seqs, strategy)`` for which sequences draft and ``refine(seqs, trees,
base_tokens)`` for the nodes of the drafted trees worth verifying, and after the step
``record(StepRecord)`` with what the step did and cost; ``finished(seq)`` whenever a sequence
leaves the engine. ``warm_start(engine)`` runs once after the engine is built; ``stats()`` gives
the metrics.

Here: ``StepRecord``, the ``Policy`` base (which tallies steps per strategy for ``stats``),
``StaticPolicy`` (always one strategy), ``BucketPolicy`` (a fixed strategy per batch-size bucket;
the benchmark's oracle) and the batch-size buckets they and ``BanditPolicy`` share. The adaptive
policies are in ``auto.py`` and ``bandit.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specengine.speculative.strategy import Strategy


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
        num_proposed: draft nodes the drafter built (before the policy's ``refine`` cut any;
            None: ``num_drafted``).
        num_catch_up: tokens the drafter caught up on before drafting: those committed while
            it was not drafting for the sequences it drafted for now (``Sequence.catch_up``);
            a stateful drafter (EAGLE, a draft model) feeds them through its own layers.
        num_committed: tokens committed by the decode sequences (accepted + bonus/plain).
        accepted_per_seq: accepted draft tokens per decode sequence with a tree.
        draft_time, forward_time, other_time: seconds spent drafting, in the target forward,
            and sampling/verifying/bookkeeping.
        verified: per verified tree ``(sequence, tree, accepted node indices)``.
        thread_probe: the kernels ran at a thread count being probed
            (``specengine.ops.threads.ThreadTuner``), not the one such steps use: its times
            are not this strategy's.
        observe_time: seconds of ``other_time`` spent storing the target's features and
            handing them to the drafter (``phases.observe``): what an attached drafter costs
            a step that does not speculate.
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
    verified: list = field(default_factory=list)
    num_proposed: int | None = None
    num_catch_up: int = 0
    thread_probe: bool = False
    observe_time: float = 0.0

    @property
    def step_time(self) -> float:
        """Seconds of the whole step."""
        return self.draft_time + self.forward_time + self.other_time

    @property
    def is_decode_only(self) -> bool:
        """True for a step with decode sequences and no prompt tokens (a clean measurement)."""
        return self.num_decode > 0 and self.num_prefill_tokens == 0


def batch_bucket(num_seqs: int) -> int:
    """Batch-size bucket: ``b`` holds ``2**(b-1) <= num_seqs < 2**b`` (0 holds 0)."""
    return int(num_seqs).bit_length()


def bucket_label(bucket: int) -> str:
    """``"4-7"`` for bucket 3."""
    if bucket <= 1:
        return str(bucket)
    return f"{2 ** (bucket - 1)}-{2 ** bucket - 1}"


def strategy_name(s: Strategy | None) -> str:
    """The label of ``s`` in the metrics: ``"off"`` for no speculation, else ``str(s)``."""
    return "off" if s is None else str(s)


class Policy:
    """Base of the policies: the calls the engine makes, and the tally behind ``stats``.

    ``choose`` is abstract; ``select``, ``refine`` and ``warm_start`` default to drafting for
    every sequence, verifying whole trees and nothing. The base counts steps, committed tokens
    and seconds per strategy, and the time spent deciding (``decision_time``, which subclasses
    add to); a subclass that overrides ``record`` calls ``_tally`` from it.
    """

    name = "base"

    def __init__(self) -> None:
        self.per_strategy: dict[str, dict] = {}
        self.decision_time = 0.0  # seconds deciding and learning (choose, record, ...)
        self.step_time = 0.0  # seconds of all recorded steps
        # per decode-only step when keep_trace: (end time in step seconds since start, batch,
        # strategy name, committed tokens, step seconds)
        self.trace: list[tuple[float, int, str, int, float]] = []
        self.keep_trace = False
        self._predicted: float | None = None  # tok/s predicted for the step being run
        # a policy without its own tree cutter still trains a merged drafter's per-source
        # calibration (``policy.wire_calibration`` sets it): a ``TreeCutter``
        self.calibration_learner = None

    def choose(self, num_running: int) -> Strategy | None:
        """Strategy for the next step (None: no speculation), given the number of running
        sequences. Called once per step, before drafting."""
        raise NotImplementedError

    def select(self, seqs: list, strategy: Strategy) -> list[bool]:
        """Which of the decoding ``seqs`` draft this step under ``strategy`` (one bool each);
        the base drafts for all of them."""
        return [True] * len(seqs)

    def refine(self, seqs: list, trees: list, base_tokens: int) -> list:
        """The drafted ``trees`` (one ``DraftTree | None`` per sequence of ``seqs``) cut to the
        nodes worth verifying, given ``base_tokens`` tokens already in the forward; the base
        keeps them whole."""
        return trees

    def record(self, rec: StepRecord) -> None:
        """Learn from the step just run (every step, speculative or not, prefill included)."""
        self._tally(rec)

    def warm_start(self, engine) -> None:
        """Called once after the engine is built, before serving (e.g. to profile it); the
        base does nothing."""

    def finished(self, seq) -> None:
        """``seq`` (a ``Sequence``) left the engine: finished (``finish_reason`` set) or
        aborted; ``AutoPolicy`` learns output lengths from it. The base does nothing."""

    def _tally(self, rec: StepRecord, label: str | None = None) -> None:
        """Count the step under ``label`` (default: its strategy's name); with a
        ``calibration_learner``, train it on the step's verified trees."""
        self.step_time += rec.step_time
        if self.calibration_learner is not None and rec.verified:
            self.calibration_learner.learn([rec])
        if not rec.is_decode_only:
            return
        label = label or strategy_name(rec.strategy)
        st = self.per_strategy.setdefault(label, {
            "steps": 0, "tokens": 0, "seconds": 0.0, "predicted_sum": 0.0, "predicted_n": 0})
        st["steps"] += 1
        st["tokens"] += rec.num_committed
        st["seconds"] += rec.step_time
        if self._predicted is not None:
            st["predicted_sum"] += self._predicted
            st["predicted_n"] += 1
        if self.keep_trace:
            self.trace.append((self.step_time, rec.num_decode, label,
                               rec.num_committed, rec.step_time))

    def stats(self) -> dict:
        """Metrics: ``policy``, ``policy_decision_s`` and ``policy_decision_frac`` (seconds
        spent choosing and learning, ``AutoPolicy``'s ``choose``, ``select``, ``refine`` and
        ``record``, and their share of step time), ``policy_strategies``: per strategy the
        decode-only ``steps``, ``observed_tok_s`` (committed tokens / seconds of those steps) and
        ``predicted_tok_s`` (mean prediction when chosen; None if the policy predicts none);
        with a ``calibration_learner``, its ``policy_calibration_per_source``."""
        table = {}
        for name, st in self.per_strategy.items():
            table[name] = {
                "steps": st["steps"],
                "observed_tok_s": st["tokens"] / st["seconds"] if st["seconds"] else None,
                "predicted_tok_s": st["predicted_sum"] / st["predicted_n"]
                if st["predicted_n"] else None}
        d = {"policy": self.name, "policy_decision_s": self.decision_time,
             "policy_decision_frac": self.decision_time / self.step_time
             if self.step_time else 0.0, "policy_strategies": table}
        if self.calibration_learner is not None:
            d.update(self.calibration_learner.stats())
        return d


class StaticPolicy(Policy):
    """Always the same strategy (``None``: never speculate)."""

    name = "static"

    def __init__(self, strategy: Strategy | None):
        super().__init__()
        self.strategy = strategy

    def choose(self, num_running: int) -> Strategy | None:
        return self.strategy


class BucketPolicy(Policy):
    """A fixed strategy per batch-size bucket (``batch_bucket``); the oracle of the benchmark
    is this with the best static strategy per bucket found in hindsight."""

    name = "bucket"

    def __init__(self, table: dict[int, Strategy | None], default: Strategy | None = None):
        super().__init__()
        self.table, self.default = table, default

    def choose(self, num_running: int) -> Strategy | None:
        return self.table.get(batch_bucket(num_running), self.default)
