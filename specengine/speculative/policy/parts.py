"""The mechanisms ``AutoPolicy`` is wired from, each a class with its own state.

- ``ProbeSchedule``: when to run a step the current choice would not (a chain for a few
  sequences while off, no speculation on a close call), so both sides stay measured.
- ``RescoreBudget``: for how many steps the scores of an unchanged batch size are reused, so
  that re-scoring (and the learning batched into it) costs a fixed share of step time.
- ``CorrectionTable``: per batch-size bucket and candidate, observed over modelled committed
  tokens per second: what the latency and acceptance models miss.
- ``TreeCutter``: which nodes of a scored draft tree are worth verifying, from each node's
  calibrated acceptance probability (``calibration.SourceCalibrators``, one ``Calibrator`` per
  draft source, which it also trains).
"""

from __future__ import annotations

import math

import numpy as np

from specengine.speculative.policy.base import StepRecord, batch_bucket
from specengine.speculative.policy.calibration import (
    Calibrator,
    SourceCalibrators,
    bin_of,
    is_scored,
    keep_worth,
)
from specengine.speculative.sources import DEFAULT_SOURCE, node_votes
from specengine.speculative.strategy import Strategy


class ProbeSchedule:
    """When a step is a probe: it measures what the current choice cannot.

    Probes fall 4, 8, 16, ... steps after speculation was switched on or off (not between two
    strategies), then every ``every`` steps. While speculation is off, a probe runs the best
    chain for ``seqs`` of the sequences only (``drafted``: a different few each probe), so the
    acceptance statistics stay current at the cost of a few forward tokens, not a speculative
    step of the whole batch. While speculating and predicted less than ``margin`` better than
    no speculation, a probe runs a step without it, so the latency model sees both sides of a
    close call instead of extrapolating to the one not taken.

    Args:
        candidates: the policy's candidates; an off probe runs the best chain among them.
        every: steps between probes once the schedule has spread out (0: never probe).
        seqs: sequences drafted for in an off probe.
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

    def drafted(self, n: int) -> list[bool]:
        """Which of ``n`` decoding sequences (``n >= 1``) an off probe drafts for: ``seqs`` of
        them, the next few along at each probe."""
        k = min(self.seqs, n)
        first = self.count * k % n
        return [(i - first) % n < k for i in range(n)]


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


class CorrectionTable:
    """Per batch-size bucket (``batch_bucket``) and candidate, the moving average of observed
    over modelled committed tokens per second of the steps that candidate ran: what the
    latency and acceptance models miss (e.g. a drafter's real cost). Each step that updates a
    bucket first fades all its factors 1% back towards 1, so a strategy judged on another
    workload is tried again.

    A cell with little evidence (``evidence`` below 1: fewer than ~10 recent steps) borrows,
    in proportion to what it lacks, from the nearest cell that has it (``_borrowed``): nearest
    in bucket first, then the same candidate, then nearest in candidate order; speculative
    candidates borrow only from speculative ones, no speculation only from itself in another
    bucket; 1 when nothing is measured.
    The models' errors are shared that way (a drafter's cost they miss at depth 1 they also
    miss at depth 2 and one bucket up), so a strategy never run is not preferred just
    because nothing has corrected it yet.

    Args:
        num_candidates: factors per bucket (indexed in the policy's candidate order; index 0
            is no speculation).
    """

    FADE = 0.01  # per update of a bucket, of every factor towards 1 and of every evidence
    RATE = 0.1  # weight of one step's ratio in its cell's moving average

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
        w = np.minimum(self.evidence.get(b, np.zeros(n)), 1.0)
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
                 if e[j] >= 1.0 and (j > 0) == spec and (k, j) != (bucket, i)]
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
        corr[index] = (1.0 - self.RATE) * corr[index] + self.RATE * ratio
        ev[index] += self.RATE


class TreeCutter:
    """Cuts scored draft trees (EAGLE, draft model, n-gram, merged) to the nodes worth verifying.

    A node stays when its acceptance probability ``p`` reaches the bar ``cut`` is given:
    ``p`` is its confidence mapped through the calibrator of the source that proposed it
    (``sources``, a ``SourceCalibrators``; for a node several sources proposed, the best of
    theirs), times the request's own factor (``Calibrator.request_factor``); ``keep_worth``
    keeps every kept node's ancestors. One tree in ``verify_whole_every`` (rotating over the
    sequences; 0: none) is left whole: the calibrators learn only from verified nodes, and
    nodes below the bar would otherwise never be verified, so a too pessimistic rate for their
    confidence bins (the prior, or counts from another workload) would never be corrected.
    ``learn`` trains each source's calibrator on the verified nodes it proposed.

    Args:
        verify_whole_every: one scored tree in this many is left whole (0: none).
        default_source: source of trees that name none (``DraftTree.sources`` None).
    """

    def __init__(self, verify_whole_every: int = 8, default_source: str = DEFAULT_SOURCE):
        self.sources = SourceCalibrators(default_source)
        self.verify_whole_every = verify_whole_every
        self.calls = 0  # cuts so far (rotates the tree left whole)
        self.nodes_seen = 0  # draft nodes of the scored trees given to ``cut``
        self.nodes_cut = 0  # of those, the nodes removed

    @property
    def calibrator(self) -> Calibrator:
        """The default source's ``Calibrator`` (the only one for a single unnamed drafter)."""
        return self.sources.get(self.sources.default)

    @calibrator.setter
    def calibrator(self, cal: Calibrator) -> None:
        self.sources.calibrators[self.sources.default] = cal

    @staticmethod
    def scored(trees: list) -> list[int]:
        """Indices of the trees (``DraftTree | None`` each) whose nodes the drafter scored
        (some draft log-probability not 0); others are never cut."""
        return [i for i, t in enumerate(trees) if t is not None and is_scored(t)]

    def probabilities(self, seq, tree, rates: dict[str, list[float]] | None = None
                      ) -> list[float]:
        """Calibrated acceptance probability of each node of the scored ``tree`` drafted for
        ``seq``: its best source's map (``rates``, a ``sources.rates()`` snapshot, default
        taken now) at that source's confidence, times the request's factor, capped at 1; what
        ``cut`` compares with its bar."""
        factor = self.calibrator.request_factor(seq)
        return [min(q * factor, 1.0) for q in self.sources.node_probs(tree, rates)]

    def cut(self, seqs: list, trees: list, scored: list[int], bar: float | list[float]) -> list:
        """``trees`` (one ``DraftTree | None`` per sequence of ``seqs``) with each tree of
        ``scored`` (``scored(trees)``) cut to the nodes whose ``p >= bar`` (one bar for all, or
        one per tree of ``trees``), except the one in ``verify_whole_every`` left whole; a tree
        cut to nothing is None."""
        self.calls += 1
        if every := self.verify_whole_every:
            whole = [i for i in scored if (self.calls + i) % every == 0]
            self.nodes_seen += sum(trees[i].num_nodes for i in whole)
            scored = [i for i in scored if (self.calls + i) % every]
        rates = self.sources.rates()
        bars = bar if isinstance(bar, list) else None
        out = list(trees)
        for i in scored:
            tree = trees[i]
            p = self.probabilities(seqs[i], tree, rates)
            out[i] = tree.subset(keep_worth(tree, p, bar if bars is None else bars[i]))
            self.nodes_seen += tree.num_nodes
            self.nodes_cut += tree.num_nodes - (out[i].num_nodes if out[i] else 0)
        return out

    @property
    def cut_frac(self) -> float:
        """Share of the scored trees' nodes removed so far (0 before any)."""
        return self.nodes_cut / self.nodes_seen if self.nodes_seen else 0.0

    def learn(self, recs: list[StepRecord]) -> None:
        """Each source's calibrator update from the scored trees' nodes it proposed, verified
        in ``recs`` (one update per source and step), and each request's predicted/accepted
        node counts (``calib_predicted``, ``calib_accepted`` on the sequence, with the maps as
        they were before them: one lookup for all)."""
        cals = self.sources
        rates = None
        for rec in recs:
            per_source: dict[str, tuple[list[int], list[bool]]] = {}
            for seq, tree, accepted in rec.verified:
                if not is_scored(tree):
                    continue
                if rates is None:
                    rates = cals.rates()
                votes = node_votes(tree, cals.default)
                seq.calib_predicted += sum(p for p, _ in cals.vote_probs(votes, rates))
                seq.calib_accepted += len(accepted)
                acc = set(accepted)
                for j, v in enumerate(votes):
                    hit = j in acc
                    for s, logc in v.items():
                        node_bins, hits = per_source.setdefault(s, ([], []))
                        node_bins.append(bin_of(math.exp(logc)))
                        hits.append(hit)
            cals.observe(per_source)

    def stats(self) -> dict:
        """``policy_calibration_per_source``: per source, the calibrated acceptance probability
        per confidence bin (``calibration.NUM_BINS`` log-spaced bins from 1e-4 to 1)."""
        return {"policy_calibration_per_source": self.sources.maps()}
