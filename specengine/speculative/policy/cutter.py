"""``TreeCutter``: which nodes of a scored draft tree are worth verifying, from each node's
calibrated acceptance probability (``calibration.SourceCalibrators``, one ``Calibrator`` per
draft source, which it also trains on the verified nodes)."""

from __future__ import annotations

import math

from specengine.speculative.policy.base import StepRecord
from specengine.speculative.policy.budget import allocate
from specengine.speculative.policy.calibration import (
    Calibrator,
    SourceCalibrators,
    bin_of,
    is_scored,
    keep_worth,
)
from specengine.speculative.sources import DEFAULT_SOURCE, node_votes


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

    That exploration is paid for out of ``explore_share`` of the forward seconds: each ``cut``
    given the step's modelled seconds adds that share of them to a credit (holding at most
    ``EXPLORE_STEPS`` calls' worth), and a tree is left whole only while the credit covers its
    nodes below the bar (their modelled seconds each). Memory-bound, where a node costs next
    to nothing, one tree in ``verify_whole_every`` stays whole as before; compute-bound, it is
    fewer: on a 2-core CPU at batch 1 a whole 24-node tree cost a 0.5B target 35 ms more than
    its cut (90 against 55 ms), i.e. 6% of every step at one tree in 8.

    Args:
        verify_whole_every: one scored tree in this many is left whole (0: none), at most.
        explore_share: the share of the forward seconds those whole trees' extra nodes may
            cost (given the seconds, ``cut``'s ``node_seconds`` and ``step_seconds``).
        default_source: source of trees that name none (``DraftTree.sources`` None).
    """

    EXPLORE_STEPS = 64  # the credit holds at most this many calls' share

    def __init__(self, verify_whole_every: int = 8, default_source: str = DEFAULT_SOURCE,
                 explore_share: float = 0.02):
        if explore_share < 0:
            raise ValueError(f"TreeCutter explore_share={explore_share}: must be >= 0")
        self.sources = SourceCalibrators(default_source)
        self.verify_whole_every = verify_whole_every
        self.explore_share = explore_share
        self.credit = 0.0  # seconds the next whole trees' extra nodes may cost
        self.whole_refused = 0  # trees due to be left whole that the credit did not cover
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

    def cut(self, seqs: list, trees: list, scored: list[int], bar: float | list[float],
            node_seconds: float = 0.0, step_seconds: float = 0.0) -> list:
        """``trees`` (one ``DraftTree | None`` per sequence of ``seqs``) with each tree of
        ``scored`` (``scored(trees)``) cut to the nodes whose ``p >= bar`` (one bar for all, or
        one per tree of ``trees``), except the one in ``verify_whole_every`` left whole while
        the exploration credit covers its cut nodes at ``node_seconds`` each (the modelled
        seconds of one more forward token; 0: free), the credit having gained
        ``explore_share`` of ``step_seconds`` (the step's modelled forward seconds); a tree cut
        to nothing is None."""
        self.calls += 1
        cap = self.EXPLORE_STEPS * self.explore_share * step_seconds
        self.credit = max(min(self.credit + self.explore_share * step_seconds, cap), 0.0)
        every = self.verify_whole_every
        rates = self.sources.rates()
        bars = bar if isinstance(bar, list) else None
        out = list(trees)
        for i in scored:
            tree = trees[i]
            p = self.probabilities(seqs[i], tree, rates)
            kept = tree.subset(keep_worth(tree, p, bar if bars is None else bars[i]))
            self.nodes_seen += tree.num_nodes
            extra = tree.num_nodes - (kept.num_nodes if kept else 0)
            if every and (self.calls + i) % every == 0:
                cost = extra * node_seconds
                if cost <= self.credit:
                    self.credit -= cost
                    continue  # left whole
                self.whole_refused += 1
            out[i] = kept
            self.nodes_cut += extra
        return out

    def cut_weighted(self, seqs: list, trees: list, scored: list[int], bar: float,
                     weights: list[float], node_seconds: float = 0.0,
                     step_seconds: float = 0.0) -> list:
        """``cut`` with per-sequence ``weights``: equal over ``scored``, one ``bar`` for all;
        else the nodes that pay form the step's budget and ``budget.allocate`` hands it out by
        ``p * w`` in one greedy pass over all trees (a bar per tree)."""
        if len({weights[i] for i in scored}) <= 1:
            return self.cut(seqs, trees, scored, bar, node_seconds, step_seconds)
        rates = self.sources.rates()
        bars, _ = allocate([self.probabilities(seqs[i], trees[i], rates) for i in scored],
                           [trees[i].parents for i in scored], [weights[i] for i in scored], bar)
        per_tree = [bar] * len(trees)
        for i, b in zip(scored, bars):
            per_tree[i] = b
        return self.cut(seqs, trees, scored, per_tree, node_seconds, step_seconds)

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
        per confidence bin (``calibration.NUM_BINS`` log-spaced bins from 1e-4 to 1);
        ``policy_whole_trees_refused``: trees due to be left whole that were cut because the
        exploration credit did not cover them."""
        return {"policy_calibration_per_source": self.sources.maps(),
                "policy_whole_trees_refused": self.whole_refused}
