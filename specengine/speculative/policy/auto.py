"""``AutoPolicy``: RLHFSpec's criterion (arXiv 2512.04752), the most expected committed tokens
per second for the whole batch, from an online latency model (``latency.py``, warm-started by
``profiling.py``) and an online acceptance model (``acceptance.py``).

The criterion, the per-sequence choice (``select``) and the bar a draft node must clear to be
verified (``refine``) are here; the mechanisms around them are its parts, a module each: the
probe schedule (``probe.py``), the re-scoring budget (``rescore.py``), the observed/modelled
correction table (``correction.py``), the tree cutter (``cutter.py``) and the loss budget
that keeps it never slower than no speculation (``guard.py``); the expected
remaining output per sequence and the weights it gives are in ``remaining.py``, the weighted
spread of the step's node budget in ``budget.py``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from specengine.speculative.policy.acceptance import AcceptanceModel
from specengine.speculative.policy.base import Policy, StepRecord, strategy_name
from specengine.speculative.policy.budget import BudgetSpread
from specengine.speculative.policy.correction import CorrectionTable
from specengine.speculative.policy.cutter import TreeCutter
from specengine.speculative.policy.guard import LossGuard
from specengine.speculative.policy.latency import LatencyModel
from specengine.speculative.policy.probe import ProbeSchedule
from specengine.speculative.policy.remaining import RemainingLength, length_weights
from specengine.speculative.policy.rescore import RescoreBudget
from specengine.speculative.strategy import Strategy


class AutoPolicy(Policy):
    """Cost-model policy: maximise expected committed tokens per second for the batch.

    For each candidate s and a batch of B sequences with total context C:
    ``score(s) = B * E[committed | s] / T(B, C, s)``, with ``E[committed]`` from the
    ``AcceptanceModel`` and ``T`` from the ``LatencyModel`` (draft + verify forward of
    ``B*(1+E[nodes|s])`` tokens, plus the rest), times the bucket's observed/modelled factor
    (``correction``, a ``CorrectionTable``). The current strategy is kept unless another
    scores ``hysteresis`` better, or no speculation scores better at all (switching
    speculation on costs a drafter its catch-up on the tokens it did not see; switching
    it off costs nothing, so a losing strategy is not kept for the margin's sake). A tree
    shape never run is predicted from the chain's rates (``acceptance.tree_prior``), so trees
    compete only once the chain has been measured on ``min_chain_trials`` sequences. With
    probes disabled the acceptance statistics decay towards the prior while speculation is
    off (``AcceptanceModel.age``) so it is retried.

    Its parts, each with its own state:

    - ``probes`` (``ProbeSchedule``): steps that measure what the current choice cannot;
    - ``rescore`` (``RescoreBudget``): scores are recomputed when the batch size changes, else
      as often as re-scoring stays within 0.25% of step time; the updates from recorded steps
      are batched into those re-scorings (``flush``), so the policy's own time, choosing and
      learning, stays ~1-2% of a step even on a CPU;
    - ``correction`` (``CorrectionTable``): what the two models miss, per batch bucket;
    - ``cutter`` (``TreeCutter``): after drafting, ``refine`` cuts each scored tree to the
      nodes whose calibrated acceptance probability pays for the verify time they add;
    - ``guard`` (``LossGuard``): per batch bucket, the seconds speculation saved against the
      no-speculation rate plus ``max_loss`` of the time spent there; a speculative step
      (probes included) whose worst case, its modelled extra seconds over a plain step plus
      the drafter's catch-up on the tokens it did not see (``LatencyModel.catch_up_time``)
      less what its accepted tokens save with high probability (``_assured``, a lower
      confidence bound), exceeds that slack is not run (the best candidate it covers is, or
      none), so each
      bucket stays at least ``1 - max_loss`` as fast as no speculation, the policy's own time
      counted as loss (the conservative bandit's rule); a speculative step's savings are
      counted against a plain step's measured seconds at its batch size, so while
      speculation runs on, one step in ``PLAIN_EVERY`` at that batch size is plain (a stale
      measure, 12 ms where plain steps now took 10.4, had credited batch-4 n-gram steps with
      savings the wall clock never saw);
    - ``remaining`` (``RemainingLength``): expected remaining output per sequence from its
      prompt group's finished lengths (``finished``), across ``generate`` calls; it weights
      each sequence's draft nodes (``remaining.length_weights``) in ``select`` and ``refine``,
      so the step's node budget goes first to the sequences the rollout's finish waits on
      (``budget.allocate``); ``budget`` (``BudgetSpread``) tallies how it was spread.

    Args:
        candidates: strategies to choose from; ``None`` (no speculation) is always added.
        hysteresis: relative margin a new strategy must win by (0.05 = 5%).
        probe_every: steps with speculation off between probes (0: never probe).
        probe_seqs: sequences drafted for in a probe step.
        latency, acceptance: the models to start from (default: new ones).
        per_sequence: let ``select`` skip sequences whose own acceptance does not pay.
        length_weight: exponent ``alpha`` of the remaining-length weights (0: every sequence
            weighs 1, the unweighted cut).
        remaining: the remaining-length estimator to use (default: a new one).
        max_loss: the share of no speculation's speed the ``guard`` lets speculation risk
            (0.02: every bucket at least 0.98x; 0 speculates only on savings already made,
            which at the start is never); None: no guard, the criterion alone decides. The
            guard budgets ``GUARD_SHARE`` of it and keeps the rest for what its books do not
            see (the overshoot of the last step it allowed, the engine's costs outside the
            policy's clock, one run's timing noise).
        clock: seconds; times the policy's own work (``decision_time``, the re-scoring cost
            ``rescore`` spaces out) and the start-up profile. Tests pass a fake one.
    """

    name = "auto"
    IDLE_LEARN_EVERY = 64  # recorded steps learnt from at once while ``_idle``
    PLAIN_EVERY = 64  # the most decode steps at one batch size between plain ones (guarded)
    # of max_loss, the share the guard spends: with all of it, auto's EAGLE rows ran 0.976-0.979x
    # of no speculation on SmolLM2's quick RL epochs (bench/rl_epochs.py --quick, 2-core Xeon)
    # against a 0.98 promise, the guard's own books at 2% and one run's noise ~0.5%
    GUARD_SHARE = 0.75
    # the lower confidence bound on a step's accepted tokens the guard counts on: this many
    # standard deviations below their mean (``_assured``)
    GUARD_Z = 2.0
    # and whatever that bound, a speculative step needs slack for this share of its loss with
    # nothing accepted (so the guard's ``underestimate`` still learns from its losses)
    GUARD_FLOOR = 0.1
    # expected remaining outputs (tokens) this close to the longest tie for it (``_progress``,
    # ``_tied``)
    TIE = 0.5

    def __init__(self, candidates: list[Strategy | None], hysteresis: float = 0.05,
                 probe_every: int = 50, probe_seqs: int = 4,
                 latency: LatencyModel | None = None,
                 acceptance: AcceptanceModel | None = None, per_sequence: bool = True,
                 clock: Callable[[], float] = time.perf_counter, length_weight: float = 1.0,
                 remaining: RemainingLength | None = None,
                 max_loss: float | None = 0.02):
        super().__init__()
        self.candidates = (None, *(s for s in dict.fromkeys(candidates) if s is not None))
        max_depth = max((s.depth for s in self.candidates if s is not None), default=1)
        self.latency = latency or LatencyModel()
        self.acceptance = acceptance or AcceptanceModel(max_depth)
        self.hysteresis = hysteresis
        self.clock = clock
        self.per_sequence, self.prior_steps = per_sequence, 4.0
        self.min_chain_trials = 8.0  # sequences drafted for by a chain before trees compete
        self.probes = ProbeSchedule(self.candidates, probe_every, probe_seqs)
        self.rescore = RescoreBudget()
        self.correction = CorrectionTable(len(self.candidates))
        self.cutter = TreeCutter()
        self.remaining = remaining or RemainingLength()
        self.length_weight = length_weight
        self.budget = BudgetSpread()
        self.guard = LossGuard(max_loss * self.GUARD_SHARE) if max_loss is not None else None
        self._extra: dict[Strategy | None, float] = {}  # modelled seconds over a plain step
        self._decided = 0.0  # decision_time when the last step was recorded
        self._running: Callable[[], list] | None = None  # the engine's running sequences
        self.idle_steps = 0  # steps ``choose`` left off without scoring (``_idle``)
        self._idle_skip = (0, 0)  # (batch, steps): idle that long without checking again
        self._was_idle = False  # the step chosen last was idle
        self._idle_worst: float | None = None  # the worst case ``_idle`` priced last
        self._worst = 0.0  # the modelled worst loss of the step chosen last (seconds)
        self._ties = 1  # decoding sequences tied for the longest remaining output (``_tied``)
        self._tied_ids: set[int] = set()  # and their ids, as last counted
        self._plain_seconds: dict[int, deque] = {}  # batch size -> recent plain steps' seconds
        self._plain_age: dict[int, int] = {}  # batch size -> decode steps since its last plain
        # a plain step's noise over its median (``_spread``), last measured; None before any
        # batch size had 5 plain steps: no speculative step runs until a loss can be told
        # from noise
        self._noise_frac: float | None = None
        # this step's decoding sequences (``select``): id -> (expected remaining, weight)
        self._step_weights: dict[int, tuple[float | None, float]] = {}
        self._step_seqs: list = []  # and the sequences themselves
        self._step_capped: set[int] = set()  # ids of those running to max_tokens (``weights``)
        self.current: Strategy | None = None
        self.context_per_seq = 0.0  # context tokens per decode sequence, last step
        self.last_scores: dict[Strategy | None, float] = {}
        self._raw: dict[Strategy | None, float] = {}  # model scores before the correction
        self.accept_ratio = 0.0  # accepted per drafted node, all sequences (moving average)
        self._offered: int | None = None  # sequences ``select`` kept this step
        self._select_calls = 0
        self._depths = np.array([s.depth if s else 0 for s in self.candidates], dtype=float)
        self._is_tree = np.array([s is not None and not s.is_chain for s in self.candidates])
        self._index = {s: i for i, s in enumerate(self.candidates)}
        self._pending: list[tuple] = []  # recorded steps not learnt from yet (``flush``)

    # ---- the criterion ------------------------------------------------------------------------
    def score(self, s: Strategy | None, batch: int, context: float) -> float:
        """Modelled committed tokens per second of one step of candidate ``s`` (tokens/s;
        before the observed/modelled correction ``scores`` applies)."""
        return float(self.model_rates(batch, context)[self._index[s]])

    def model_rates(self, batch: int, context: float) -> np.ndarray:
        """Modelled committed tokens per second (``[len(candidates)]``, in ``candidates``
        order): batch x expected committed tokens over the modelled step time of each."""
        return self.model_steps(batch, context)[0]

    def model_steps(self, batch: int, context: float) -> tuple[np.ndarray, np.ndarray]:
        """``(rates, seconds)``, each ``[len(candidates)]`` in ``candidates`` order: the
        modelled committed tokens per second and step seconds of each candidate."""
        per_seq_committed, per_seq_nodes, per_seq_built = self.acceptance.expected(self.candidates)
        committed, nodes = batch * per_seq_committed, batch * per_seq_nodes
        seconds = self.latency.step_times(batch, context, self._depths, nodes, committed,
                                          batch * per_seq_built)
        return committed / np.maximum(seconds, 1e-9), seconds

    def scores(self, batch: int, context: float,
               rates: np.ndarray | None = None) -> dict[Strategy | None, float]:
        """What the choice compares (tokens/s): the modelled ``rates`` (default
        ``model_rates``) times the bucket's observed/modelled correction; trees 0 until the
        chain has been measured."""
        rate = self.model_rates(batch, context) if rates is None else rates
        rate = rate * self.correction.factors(batch)
        if self.acceptance.chain.trials[0] < self.min_chain_trials:
            rate[self._is_tree] = 0.0  # a tree's prior is the chain's rates: measure those first
        return dict(zip(self.candidates, rate.tolist()))

    def choose(self, num_running: int) -> Strategy | None:
        """The best-scoring candidate for ``num_running`` sequences (kept unless beaten by
        ``hysteresis``) among those whose worst case the ``guard``'s slack covers, or the
        probe ``probes`` schedules instead (if the guard covers it). While that slack could
        not cover any candidate (``_idle``), nothing is scored."""
        t0 = self.clock()
        batch = max(num_running, 1)
        skip_batch, skip = self._idle_skip
        self._was_idle = (skip > 0 and skip_batch == batch) or self._idle(batch)
        if self._was_idle:
            self._idle_skip = (batch, skip - 1) if skip > 0 and skip_batch == batch else \
                (batch, self._steps_idle(batch))
            self.idle_steps += 1
            self.probes.active = False
            self._predicted = self.last_scores.get(None)
            self.rescore.age()  # the scores grow older all the same
            self.decision_time += self.clock() - t0
            return None
        fresh = not self.rescore.reuse(batch, bool(self.last_scores))
        if not fresh:
            scores = self.last_scores  # re-scored when the batch changes, else every few steps
        else:
            self.flush()
            context = self.context_per_seq * batch
            rates, seconds = self.model_steps(batch, context)
            self._raw = dict(zip(self.candidates, rates.tolist()))
            self._extra = dict(zip(self.candidates, (seconds - seconds[0]).tolist()))
            scores = self.scores(batch, context, rates)
            self.rescore.rescored(batch, self.clock() - t0)
        pool = scores  # the candidates this step may run: all, or what the guard covers
        worst: dict[Strategy | None, float] = {}
        if self.guard is not None:
            # the worst case: the extra seconds and the catch-up, less what the accepted tokens
            # all but surely save (their lower confidence bound, ``_assured``)
            catch_ups = self._pending_catch_up()
            catch_up = self.latency.catch_up_time(sum(catch_ups))
            if fresh:
                self._ties = self._tied(batch)
            assured = self._assured(batch)
            worst = {c: self._worst_loss(self._extra.get(c, 0.0) + catch_up, assured[c])
                     for c in scores if c is not None}
            known = self._noise_frac is not None  # else no loss could be judged yet
            pool = {c: v for c, v in scores.items()
                    if c is None or known and self.guard.covers(batch, worst[c])}
            if len(pool) < len(scores) and max(scores, key=scores.get) not in pool:
                self.guard.refused += 1
        best = max(pool, key=pool.get)
        current = self.current if self.current in pool else None
        if pool[best] > pool[current] * (1 + self.hysteresis):
            current = best
        elif current is not None and pool[None] > pool[current]:
            current = None  # turning speculation off costs nothing: no margin needed
        choice = self.probes.pick(self.current, current, scores)
        if choice is not None and worst:
            self._worst = worst[choice]
            if self.probes.active:  # the tied sequences, or a few with the least catch-up
                share, probe_catch_up, tied = self._probe(batch)
                self._worst = self._worst_loss(
                    share * self._extra.get(choice, 0.0) + probe_catch_up,
                    assured[choice] if tied else 0.0)
            if self._noise_frac is None or not self.guard.affords(batch, self._worst) or \
                    self._plain_age.get(batch, 0) >= self.PLAIN_EVERY:  # measure one now
                choice, self.probes.active = None, False
        self.current = current
        self._predicted = scores[choice]
        self.last_scores = scores
        self.decision_time += self.clock() - t0
        return choice

    def _steps_idle(self, batch: int) -> int:
        """After ``_idle`` found ``batch`` idle: plain steps it stays idle for sure (the
        guard's ``steps_to_cover`` of the worst case ``_idle`` priced, each step taken as twice
        the median plain step at this batch size; at most ``IDLE_LEARN_EVERY``), which
        ``choose`` then skips checking: a probe never comes earlier than the slack allows."""
        plain = self._plain_seconds.get(batch)
        if not plain or self._idle_worst is None:
            return 0
        return min(self.IDLE_LEARN_EVERY, self.guard.steps_to_cover(
            batch, self._idle_worst, 2.0 * statistics.median(plain)))

    def _idle(self, batch: int) -> bool:
        """True when the guard's slack for ``batch`` sequences covers not even the cheapest
        candidate's worst case at the last scoring of this batch size (its extra seconds plus
        the drafter's catch-up less its ``_assured`` saving, as ``choose`` prices them; or a
        probe's share of them, ``_probe``): no step
        could speculate, so none is scored, and ``record`` learns in bigger batches (the
        policy's own time is the guard's loss too)."""
        self._idle_worst = None
        if self.guard is None or not self._extra or self.rescore.scored_for[0] != batch:
            return False
        everyone = self.latency.catch_up_time(sum(self._pending_catch_up()))  # all drafted
        share, probe_catch_up, tied = self._probe(batch)
        assured = self._assured(batch)
        self._idle_worst = min(
            min(self._worst_loss(share * v + probe_catch_up, assured[c] if tied else 0.0),
                self._worst_loss(v + everyone, assured[c]))
            for c, v in self._extra.items() if c is not None)
        return not self.guard.covers(batch, self._idle_worst)

    def _probe(self, batch: int) -> tuple[float, float, bool]:
        """What an off probe at ``batch`` sequences would draft for (``probes.drafted``: the
        sequences tied for the longest remaining output, ``_tied``, else a few with the least
        catch-up): ``(share, catch_up, tied)``, the share of the batch (of a step's extra
        seconds), the seconds of its catch-up and whether it drafts for tied sequences (so
        the ``_assured`` saving counts)."""
        seqs = self._decoding()
        if not seqs:
            return min(1.0, self.probes.seqs / max(batch, 1)), 0.0, False
        tied = [id(s) in self._tied_ids for s in seqs]
        catch_ups = [s.catch_up for s in seqs]
        drafted = self.probes.drafted(catch_ups, tied)
        catch_up = sum(c for c, d in zip(catch_ups, drafted) if d)
        return (min(1.0, sum(drafted) / max(batch, 1)), self.latency.catch_up_time(catch_up),
                any(tied))

    def _worst_loss(self, nothing_accepted: float, assured: float) -> float:
        """The loss a speculative step is allowed on (seconds): its loss with nothing accepted
        less the seconds its accepted tokens all but surely save, at least ``GUARD_FLOOR`` of
        the former."""
        return max(nothing_accepted - assured, self.GUARD_FLOOR * nothing_accepted)

    def _assured(self, batch: int) -> dict[Strategy | None, float]:
        """Per candidate, the seconds of plain steps a step of ``batch`` sequences saves by its
        accepted tokens with high probability: a plain step's seconds at this batch size
        (``_plain_seconds``' median; none measured: 0) times a lower confidence bound on the
        mean accepted tokens over the ``_ties`` sequences whose mean ``_progress`` counts,
        ``GUARD_Z`` standard deviations below the ``acceptance`` model's mean ``a``. The
        variance counts both the step's draw over those sequences and the estimate's own error
        (over the sequences it was measured on, the depth-1 trials; a tree never run has none
        of its own, hence no credit); a count in ``[0, depth]`` with mean ``a`` varies by at
        most ``a (depth - a)``. The conservative bandit's rule plays an arm on the lower
        confidence bound of its reward (Wu et al., "Conservative Bandits", ICML 2016); with
        nothing accepted as the worst case, a depth-1 chain at 16 qwen2.5-0.5B sequences
        (+19-30 ms over a 67 ms plain step, 1.64 tokens per sequence: 1.2x measured with the
        chain forced) was never affordable, and the whole full-batch phase of the rollout ran
        plain."""
        plain = self._plain_seconds.get(batch)
        t_off = statistics.median(plain) if plain else 0.0
        out = dict.fromkeys(self.candidates, 0.0)
        if not t_off:
            return out
        acc, ties = self.acceptance, max(self._ties, 1)
        for c in self.candidates:
            if c is None:
                continue
            rates = acc.chain if c.is_chain else acc.trees.get(c)
            trials = float(rates.trials[0]) if rates is not None else 0.0
            if trials < 1.0:
                continue
            a = acc.expected_accepted(c)
            sd = math.sqrt(a * max(c.depth - a, 0.0) * (1.0 / ties + 1.0 / trials))
            out[c] = t_off * max(a - self.GUARD_Z * sd, 0.0)
        return out

    def _tied(self, batch: int) -> int:
        """Of the engine's decoding sequences, how many tie for the longest expected remaining
        output (within half a token) as ``_progress`` will count them: the step moves the
        batch's finish by the mean of what those commit; 1 where one of them runs to
        ``max_tokens`` (its own count is what moves it) or the sequences are not known."""
        seqs = self._decoding()
        self._tied_ids = set()
        if len(seqs) != batch:
            return 1
        est = self.remaining
        rem = self._expected_remaining(seqs) or \
            [s.params.max_tokens - s.num_output_tokens for s in seqs]
        top = max(rem)
        tied = [s for s, r in zip(seqs, rem) if r >= top - self.TIE]
        self._tied_ids = {id(s) for s in tied}
        if est.observed and any(est.runs_to_cap(s) for s in tied):
            return 1
        return len(tied)

    def _expected_remaining(self, seqs: list) -> list[float] | None:
        """Per sequence, ``remaining``'s expected remaining output (tokens); None before any
        sequence finished, with ``length_weight`` 0 or without sequences."""
        est = self.remaining
        if not (self.length_weight and seqs and est.observed):
            return None
        rem = [est.expected(s) for s in seqs]
        return None if any(r is None for r in rem) else rem

    def _decoding(self) -> list:
        """The engine's decoding sequences (none before ``warm_start`` connected it)."""
        if self._running is None:
            return []
        return [s for s in self._running() if s.num_cached >= len(s) - 1]

    def _pending_catch_up(self) -> list[int]:
        """Per decoding sequence, the tokens the drafter would catch up on if it were drafted
        for now (``Sequence.catch_up``)."""
        return [s.catch_up for s in self._decoding()]

    def weights(self, seqs: list) -> list[float]:
        """This step's weight per decoding sequence of ``seqs``: ``length_weights`` of their
        expected remaining output (``remaining``), relative to the batch; 1 for all before any
        sequence finished or with ``length_weight`` 0. Kept for ``refine`` and ``record``, with
        the sequences whose group's finished outputs all ran to ``max_tokens``
        (``RemainingLength.runs_to_cap``, for ``_progress``)."""
        est, n = self.remaining, len(seqs)
        rem = self._expected_remaining(seqs)
        w = length_weights(rem, self.length_weight) if rem else [1.0] * n
        self._step_seqs = seqs
        self._step_weights = {id(s): (None if rem is None else r, x)
                              for s, r, x in zip(seqs, rem or [None] * n, w)}
        self._step_capped = {id(s) for s in seqs if est.runs_to_cap(s)} if rem else set()
        return w

    def finished(self, seq) -> None:
        """A sequence left the engine: its output length feeds ``remaining``; an idle
        stretch ``_steps_idle`` priced stops here (the sequence that takes its place has less
        for a drafter to catch up on, so a probe may be affordable sooner)."""
        self.remaining.finished(seq)
        self._idle_skip = (0, 0)

    def select(self, seqs: list, strategy: Strategy) -> list[bool]:
        """Per-sequence choice (the engine drafts only for sequences marked True): a sequence
        is drafted for when its weighted expected accepted tokens pay for its draft nodes at
        the step's predicted rate, i.e. ``w_i * E[accepted_i] >= rate * dT/d(its nodes)``.
        ``E[accepted_i]`` is the batch estimate scaled by the request's own accepted-per-drafted
        ratio against the global one (``prior_steps`` pseudo-steps of the global ratio);
        ``w_i`` is its remaining-length weight (``weights``; 1 when all are equal, the
        unweighted choice). A probe drafts for the sequences ``probes.drafted`` names (those
        tied for the longest remaining output, ``_tied``, then the least catch-up)."""
        t0 = self.clock()
        keep = [True] * len(seqs)
        weight = self.weights(seqs)
        rate = self._predicted
        if self.probes.active:  # the tied sequences, then the few with the least catch-up
            keep = self.probes.drafted([s.catch_up for s in seqs],
                                       [id(s) in self._tied_ids for s in seqs])
        elif self.per_sequence and len(seqs) > 1 and rate and self.accept_ratio > 0:
            acc, n = self.acceptance, len(seqs)
            need = rate * self.latency.sequence_seconds(
                n, self.context_per_seq * n, strategy.depth, acc.expected_nodes(strategy),
                acc.expected_proposed(strategy))  # tokens one sequence's nodes must win back
            if need > 0:
                e_acc, r, c = acc.expected_accepted(strategy), self.accept_ratio, self.prior_steps
                self._select_calls += 1
                for i, s in enumerate(seqs):
                    own = (s.num_accepted + c * r) / (s.num_drafted + c)
                    # a skipped sequence is still drafted for one step in 16, to notice change
                    keep[i] = e_acc * own / r * weight[i] >= need or \
                        (self._select_calls + i) % 16 == 0
        self._offered = sum(keep)
        self.decision_time += self.clock() - t0
        return keep

    def refine(self, seqs: list, trees: list, base_tokens: int) -> list:
        """Per scored tree, keep the nodes whose acceptance probability ``p`` pays for its
        verify token: ``p >= rate * dT/dn``, with ``rate`` the step's predicted committed tokens
        per second and ``dT/dn`` the latency model's marginal seconds per forward token at this
        step's size (``base_tokens``: the forward's tokens besides draft nodes). Memory-bound,
        the bar is near 0 and trees stay whole; compute-bound, only confident nodes stay. The
        cut itself, and the tree in ``verify_whole_every`` left whole (while what its cut
        nodes cost at ``dT/dn`` each fits ``cutter``'s share of the modelled forward seconds),
        are ``cutter``'s.

        With remaining-length weights that differ (``weights``), the nodes that pay form the
        step's budget and ``budget.allocate`` hands it out by ``p * w`` in one greedy pass over
        all trees: the sequences with longer expected remaining output keep nodes below the
        bar, the ones about to finish lose theirs first (possibly all). Equal weights: the
        unweighted cut above, unchanged."""
        rate = self._predicted
        scored = self.cutter.scored(trees)
        if not scored or not rate:
            return trees
        t0 = self.clock()
        n = len(seqs)
        tokens = base_tokens + sum(t.num_nodes for t in trees if t is not None)
        ctx = self.context_per_seq * n
        lat = self.latency
        step = lat.forward_time(tokens, ctx, n)
        node = max(lat.forward_time(tokens + 1, ctx, n) - step, 0.0)  # seconds per node
        bar = rate * node
        known = self._step_weights
        if not all(id(s) in known for s in seqs):
            self.weights(seqs)  # refine without select (this step): weights of these alone
            known = self._step_weights
        out = self.cutter.cut_weighted(seqs, trees, scored, bar,
                                       [known[id(s)][1] for s in seqs], node, step)
        self.decision_time += self.clock() - t0
        return out

    def warm_start(self, engine) -> None:
        """Profile the engine's forwards (and drafter) for about two seconds into ``latency``
        (``Engine.profile_forward``, i.e. ``profiling.profile_forward``), and read the
        engine's running sequences from now on (the catch-up a switch to speculation costs)."""
        engine.profile_forward(self.latency, clock=self.clock)
        if hasattr(engine, "scheduler"):
            self._running = lambda: engine.scheduler.running

    # ---- learning -----------------------------------------------------------------------------
    def record(self, rec: StepRecord) -> None:
        """Tally the step; what it teaches the models is learnt at the next re-scoring
        (``flush``): a few steps' updates run back to back cost much less than each one alone
        right after a forward has evicted the CPU caches."""
        t0 = self.clock()
        probing = self.probes.active
        self._tally(rec, f"probe {strategy_name(rec.strategy)}" if probing else None)
        if rec.num_decode:
            self.context_per_seq = rec.context_tokens / rec.num_decode
        self._guard(rec)
        self._pending.append((rec, probing, self._offered, self._raw.get(rec.strategy)))
        self._offered = None
        if rec.strategy is not None and rec.num_decode:
            self.budget.observe_step(rec, self._step_weights)
        self._step_weights, self._step_seqs, self._step_capped = {}, [], set()
        if rec.is_decode_only:  # the steps the re-scoring is spread over
            self.rescore.observe_step(rec.step_time)
        idle = rec.strategy is None and self._was_idle  # spec: learnt soon
        if len(self._pending) >= (self.IDLE_LEARN_EVERY if idle else self.rescore.every):
            self.flush()
        self.decision_time += self.clock() - t0

    def _guard(self, rec: StepRecord) -> None:
        """The step's account in the ``guard``: a decode-only speculative step of ``B``
        sequences saved ``progress * t_off - seconds``, with ``progress`` from ``_progress``
        and ``t_off`` a plain step's seconds at this batch size (the median of the last 9
        plain steps run at it, which a thread-count probe or a stall does not move; else
        ``B / r_off``, ``r_off`` no speculation's score); a plain step saved 0 and is
        measured; how much slower than ``t_off`` the second slowest of those plain steps was
        (relative to ``t_off``, ``_spread``; at this batch size once it has 5 of them, else
        the last measured) is the step's ``noise`` (``LossGuard.observe``). The policy's own
        seconds (``decision_time``) since the last account and the step's ``observe_time``
        (storing features for the drafter, which a plain step pays only because a drafter is
        attached) count as loss, and are the ``overhead`` the guard earns back whatever its
        backoff. A step the thread tuner
        ran at a probed count (``rec.thread_probe``) counts what it saved or lost, but neither
        measures a plain step nor teaches the guard how far its model underestimates a
        speculative one: that loss is the tuner's. Whether speculation keeps losing
        (``LossGuard.observe``'s ``expected_saved``, which sets ``backoff``) is judged on the
        same step at the acceptance model's mean (its progress scaled by the expected over
        the committed tokens per drafted sequence): one draw of acceptance, a chain rejected
        at its first node about one step in three where speculation pays, is no evidence
        that it does not; the books (``saved``) take the draw."""
        own, self._decided = self.decision_time - self._decided, self.decision_time
        if self.guard is None or not rec.is_decode_only:
            return
        b, saved, noise, expected = rec.num_decode, 0.0, 0.0, None
        self._plain_age[b] = self._plain_age.get(b, 0) + 1
        if rec.strategy is None:  # what a plain step costs, measured, and its noise
            if not rec.thread_probe:
                self._plain_age[b] = 0
                plain = self._plain_seconds.setdefault(b, deque(maxlen=9))
                plain.append(rec.step_time)
                if self._noise_frac is None and len(plain) >= 5:  # the first measure
                    self._noise_frac = _spread(plain)
        else:
            off_rate = self.last_scores.get(None, 0.0)
            plain = self._plain_seconds.get(b)
            t_off = statistics.median(plain) if plain else \
                (b / off_rate if off_rate > 0 else 0.0)
            if t_off:
                progress = self._progress(rec)
                saved = progress * t_off - rec.step_time
                drafted = [1 + len(a) for _, _, a in rec.verified]
                if drafted:  # the same step at the acceptance model's mean, not this draw's
                    got = sum(drafted) / len(drafted)
                    mean = self.acceptance.expected_committed(rec.strategy)
                    expected = progress * mean / got * t_off - rec.step_time
            if plain and len(plain) >= 5:  # measured where the step ran, when it can be
                self._noise_frac = _spread(plain)
            noise = (self._noise_frac or 0.0) * t_off
        modelled = rec.strategy is not None and not rec.thread_probe  # a probe's loss: not ours
        fixed = own + rec.observe_time
        self.guard.observe(rec.num_decode, rec.step_time + own, saved - fixed,
                           self._worst if modelled else None, noise, fixed,
                           None if expected is None else expected - fixed)

    def _progress(self, rec: StepRecord) -> float:
        """How many plain steps' worth the speculative step ``rec`` moved the batch's finish:
        the drop of the longest expected remaining output over its sequences (``remaining``'s
        estimate, else what ``max_tokens`` leaves), each having committed ``1 + accepted``
        tokens. A batch ends with its longest sequence (the makespan, DAS arXiv 2511.13841):
        tokens accepted for a sequence that will finish early anyway only move work to a tail
        of smaller, less efficient steps, so they do not count as savings. Sequences whose
        expected remaining output ties for the longest (within half a token: a GRPO group
        before any sample finished, or siblings the estimate cannot tell apart) are each as
        likely to be the one that ends last, so the finish moves by the mean of what they
        committed (taking the least of them, as the maximum over the ties does, credited a
        chain of 1 at 16 sequences with a drop of 1 unless all 16 accepted, 0.65^16 at tau
        1.65, so the guard counted nearly every such step a loss). Not so for sequences the
        estimate has running to ``max_tokens`` because every finished output of their group
        that got as far reached it (``RemainingLength.runs_to_cap``; not the prior's guess
        that a sequence outliving every length seen goes on as long again): each of them ends
        last, so their remaining after the step is exact and the finish moves by the least
        they committed; the mean had credited steps that accepted tokens for a few of 16 such
        sequences with savings that never came (SmolLM2 quick epochs: 16
        samples of 256 tokens, suffix drafting at 0.97x by the wall clock while its books saw
        gains). Over the steps this is the drop of the longest remaining output: those that
        accepted lead, the rest tie, and theirs moves it next. At batch 1 it is the tokens
        committed. A sequence that finished in the step counts as moved by what it committed,
        not to 0: the plain steps reach the same stop too. Without the step's sequences
        (``select`` not called), the tokens committed per sequence."""
        seqs = self._step_seqs
        if len(seqs) != rec.num_decode:
            return rec.num_committed / max(rec.num_decode, 1)
        accepted = {id(s): len(a) for s, _, a in rec.verified}
        rows = []  # (remaining before the step, remaining after it, runs to max_tokens)
        for s in seqs:
            c = 1 + accepted.get(id(s), 0)
            cap = s.params.max_tokens - s.num_output_tokens + c  # max_tokens left, before
            rem = self._step_weights.get(id(s), (None, 1.0))[0]  # expected, before the step
            to_cap = id(s) in self._step_capped and rem is not None and rem >= cap - self.TIE
            if rem is None:
                rem = cap
            # one that finished in the step moved by what it committed, like the rest: its stop
            # is no saving (plain steps reach the same stop, c - 1 steps later), though it
            # drops its remaining output to 0 (one stopping at EOS far short of its estimate
            # had credited a single step with hundreds of plain steps)
            rows.append((rem, rem - c, to_cap))
        before = max(r for r, _, _ in rows)
        tied = [r - a for r, a, cap in rows if r >= before - self.TIE and not cap]
        after = max(([before - sum(tied) / len(tied)] if tied else []) +
                    [a for r, a, cap in rows if r < before - self.TIE or cap])
        return before - after

    def flush(self) -> None:
        """Learn from the recorded steps not learnt from yet (``record`` defers it)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        self.cutter.learn([rec for rec, *_ in pending])
        for rec, probing, offered, raw in pending:
            self._learn(rec, probing, offered, raw)
        # a probe that drafted for a few of the sequences adds too few tokens to measure what
        # a token costs: its forward is one noisy step a few tokens off the plain ones, and a
        # handful of them set the slope (2-3 ms a token at 16 qwen2.5-0.5B sequences, where a
        # whole depth-1 chain measured 0.7): the forward fit learns from the other steps
        recs = [(rec, probing, offered) for rec, probing, offered, _ in pending
                if not rec.thread_probe]
        self.latency.learn([rec for rec, *_ in recs], [
            not (probing and offered is not None and offered < rec.num_decode)
            for rec, probing, offered in recs])

    def _learn(self, rec: StepRecord, probing: bool, offered: int | None,
               raw: float | None) -> None:
        """One step's updates of the acceptance model and the correction table (``flush``
        updates the latency model for all steps at once); ``probing``, ``offered`` (sequences
        ``select`` kept) and ``raw`` (the strategy's model rate) as they were for that step."""
        if rec.strategy is not None:
            offered = rec.num_decode if offered is None else offered
            self.acceptance.observe(rec.strategy, rec.accepted_per_seq, offered,
                                    rec.num_drafted, rec.num_proposed)
            if rec.num_drafted:
                ratio = sum(rec.accepted_per_seq) / rec.num_drafted
                self.accept_ratio = ratio if self.accept_ratio == 0 else \
                    0.9 * self.accept_ratio + 0.1 * ratio
        elif rec.num_decode and not self.probes.every:
            self.acceptance.age()
        if not rec.is_decode_only or rec.thread_probe:
            return
        # the rate of a run of such steps: the catch-up is the switch's price, not the step's
        seconds = rec.step_time - self.latency.catch_up_time(rec.num_catch_up)
        if raw and not probing and seconds > 0:
            self.correction.observe(rec.num_decode, self._index[rec.strategy],
                                    rec.num_committed / seconds, raw)

    def stats(self) -> dict:
        """``Policy.stats`` plus ``policy_latency_knee_tokens``, ``policy_nodes_cut_frac``
        (share of scored trees' nodes ``refine`` cut), ``policy_calibration`` (acceptance
        probability per confidence bin, the default source's), ``policy_calibration_per_source``
        (``TreeCutter.stats``), ``policy_expected_committed`` per candidate,
        ``policy_budget`` (how the draft nodes were spread over sequences,
        ``BudgetSpread.stats``), ``policy_remaining`` (the remaining-length memory,
        ``RemainingLength.stats``) and ``policy_guard`` (``LossGuard.stats`` and ``idle_steps``,
        the steps chosen without scoring because no candidate was affordable)."""
        self.flush()
        d = super().stats()
        d["policy_latency_knee_tokens"] = self.latency.knee
        d["policy_nodes_cut_frac"] = self.cutter.cut_frac
        rates = self.cutter.calibrator.rate_per_bin().tolist()
        d["policy_calibration"] = [round(x, 3) for x in rates]
        d.update(self.cutter.stats())
        d["policy_expected_committed"] = {
            strategy_name(s): round(self.acceptance.expected_committed(s), 3)
            for s in self.candidates}
        d["policy_budget"] = self.budget.stats()
        d["policy_remaining"] = self.remaining.stats()
        if self.guard is not None:
            d["policy_guard"] = {**self.guard.stats(), "idle_steps": self.idle_steps}
        return d


def _spread(seconds) -> float:
    """How much slower than their median the second slowest of ``seconds`` (a few plain
    steps' times) is, relative to the median: a plain step's own noise."""
    return sorted(seconds)[-2] / statistics.median(seconds) - 1.0
