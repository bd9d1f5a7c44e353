"""Draft confidence, calibrated online: how likely a drafted node is to be accepted.

A model drafter (EAGLE, a draft model) scores every node of its tree; ``exp`` of the node's
cumulative draft log-probability (the product along its path, EAGLE-2 arXiv 2406.16858) is its
*confidence* c, which predicts acceptance well but not exactly (an undertrained drafter is
over-confident, a target that drifted in RL makes every drafter so). The calibrator maps c to
the observed acceptance rate: decayed counts of verified nodes and of accepted ones in 16
log-spaced confidence bins, with c itself as the prior (a perfectly calibrated drafter), made
monotone in c (pool-adjacent-violators, isotonic regression). Per request, a factor
``(accepted + k) / (predicted + k)`` over the request's own verified nodes scales the global map
(a request whose text the drafter knows well, or not at all).

``SourceCalibrators`` keeps one calibrator per draft source (``"ngram"``, ``"eagle"``, ...;
``speculative.sources``): the same confidence from two drafters can be worth different
acceptance, so each learns from its own nodes and a node's probability is that of its best
source. ``TreeCutter`` (``cutter.py``) uses it, for ``AutoPolicy.refine``, to cut each drafted tree
to the nodes worth verifying; a ``MergedDrafter`` uses it to fill one verify budget from
several drafters' trees.
"""

from __future__ import annotations

import math

import numpy as np

from specengine.speculative.sources import DEFAULT_SOURCE, node_votes
from specengine.speculative.tree import DraftTree

NUM_BINS = 16
MIN_LOG10 = -4.0  # confidences below 1e-4 share the lowest bin


def confidence_list(tree: DraftTree) -> list[float]:
    """Confidence per node, exp of its cumulative draft log-probability, as a Python list
    (per-tree arrays are too small for numpy to pay)."""
    cum: list[float] = []
    for par, lp in zip(tree.parents, tree.draft_logprobs):
        cum.append(lp + (cum[par] if par >= 0 else 0.0))
    return [math.exp(c) for c in cum]


def confidences(tree: DraftTree) -> np.ndarray:
    """``[m]`` float64 ``confidence_list``."""
    return np.array(confidence_list(tree), dtype=float)


def bin_of(conf: float) -> int:
    """Bin index (0..NUM_BINS-1) of one confidence: log-spaced from 10**MIN_LOG10 to 1."""
    x = (math.log10(max(conf, 1e-30)) - MIN_LOG10) / -MIN_LOG10 * NUM_BINS
    return min(max(int(x), 0), NUM_BINS - 1)


def is_scored(tree: DraftTree) -> bool:
    """True when the drafter scored the nodes (n-gram trees carry no log-probabilities)."""
    return any(lp != 0.0 for lp in tree.draft_logprobs)


def bins(conf: np.ndarray) -> np.ndarray:
    """``bin_of`` of each confidence, int array of ``conf``'s shape."""
    conf = np.asarray(conf, dtype=float)
    return np.array([bin_of(c) for c in conf.ravel().tolist()], dtype=int).reshape(conf.shape)


class Calibrator:
    """Online map from draft confidence to acceptance probability.

    Args:
        decay: factor applied to the counts per observed step (memory ~ 1 / (1 - decay) steps).
        prior_count: pseudo-observations per bin at the prior (rate = the bin's confidence).
        request_prior: ``k`` of the per-request factor.
    """

    def __init__(self, decay: float = 0.995, prior_count: float = 4.0,
                 request_prior: float = 8.0):
        self.decay, self.prior_count, self.request_prior = decay, prior_count, request_prior
        edges = MIN_LOG10 + -MIN_LOG10 * np.arange(NUM_BINS + 1) / NUM_BINS
        self.prior = 10.0 ** ((edges[:-1] + edges[1:]) / 2)  # bin centres
        self.tried = np.zeros(NUM_BINS)
        self.accepted = np.zeros(NUM_BINS)
        self._map: np.ndarray | None = None

    def rate_per_bin(self) -> np.ndarray:
        """``[NUM_BINS]`` calibrated acceptance probability, non-decreasing in confidence."""
        if self._map is None:
            w = self.tried + self.prior_count
            r = (self.accepted + self.prior_count * self.prior) / w
            self._map = isotonic(r, w)
        return self._map

    def predict(self, conf: np.ndarray, factor: float = 1.0) -> np.ndarray:
        """Acceptance probability of nodes of confidence ``conf`` (times a request's
        ``factor``, capped at 1)."""
        return np.minimum(self.rate_per_bin()[bins(conf)] * factor, 1.0)

    def observe(self, conf: np.ndarray, accepted: np.ndarray) -> None:
        """The nodes verified in one step (all its trees): ``conf`` ``[m]`` and ``accepted``
        ``[m]`` bool (on an accepted path). Decays the counts first, once per step."""
        self.observe_bins(bins(conf), accepted)

    def observe_bins(self, node_bins, accepted) -> None:
        """``observe`` with the nodes' bin indices (``bins``/``bin_of``) instead of their
        confidences: ``node_bins`` ``[m]`` ints, ``accepted`` ``[m]`` bools."""
        self.tried *= self.decay
        self.accepted *= self.decay
        self.tried += np.bincount(node_bins, minlength=NUM_BINS)
        self.accepted += np.bincount(node_bins, weights=np.asarray(accepted, dtype=float),
                                     minlength=NUM_BINS)
        self._map = None

    def request_factor(self, seq) -> float:
        """``seq``'s own accepted / predicted nodes, shrunk toward 1 (``request_prior``)."""
        k = self.request_prior
        return (seq.calib_accepted + k) / (seq.calib_predicted + k)


def isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of ``y`` (pool adjacent violators)."""
    vals, weights, sizes = [], [], []
    for v, wt in zip(y.tolist(), w.tolist()):
        vals.append(v)
        weights.append(wt)
        sizes.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v2, w2, n2 = vals.pop(), weights.pop(), sizes.pop()
            tot = weights[-1] + w2
            vals[-1] = (vals[-1] * weights[-1] + v2 * w2) / tot
            weights[-1] = tot
            sizes[-1] += n2
    return np.repeat(vals, sizes)


def keep_worth(tree: DraftTree, p_accept: np.ndarray, threshold: float) -> list[int]:
    """Nodes of ``tree`` to verify: those whose acceptance probability reaches ``threshold``
    and whose parent is kept (parents precede children, so the result is a tree)."""
    kept: set[int] = set()
    out = []
    for i, par in enumerate(tree.parents):
        if p_accept[i] >= threshold and (par < 0 or par in kept):
            kept.add(i)
            out.append(i)
    return out


class SourceCalibrators:
    """One ``Calibrator`` per draft source, made on first use.

    A node's acceptance probability is the best over the sources that proposed it
    (``speculative.sources.node_votes``) of that source's calibrated rate at its own confidence
    (a node is accepted or not whoever proposed it, so the most optimistic well-calibrated
    estimate is the one to act on); learning updates every proposing source's calibrator with
    the node's outcome at that source's confidence.

    Args:
        default: source of trees that name none (``DraftTree.sources`` None).
        **calibrator_args: passed to each ``Calibrator``.
    """

    def __init__(self, default: str = DEFAULT_SOURCE, **calibrator_args):
        self.default = default
        self.calibrator_args = calibrator_args
        self.calibrators: dict[str, Calibrator] = {}

    def get(self, source: str) -> Calibrator:
        """The calibrator of ``source`` (a new one, at the prior, the first time)."""
        cal = self.calibrators.get(source)
        if cal is None:
            cal = self.calibrators[source] = Calibrator(**self.calibrator_args)
        return cal

    def rates(self) -> dict[str, list[float]]:
        """Per source seen so far, ``rate_per_bin`` as a list (one lookup for a whole step)."""
        return {s: c.rate_per_bin().tolist() for s, c in self.calibrators.items()}

    def vote_probs(self, votes: list[dict[str, float]],
                   rates: dict[str, list[float]] | None = None) -> list[tuple[float, str]]:
        """Per node ``(acceptance probability, best source)`` for ``votes`` (``node_votes``);
        ``rates`` a ``rates()`` snapshot (default: taken now). Ties keep the first source."""
        rates = self.rates() if rates is None else rates
        out = []
        for v in votes:
            best, name = -1.0, ""
            for s, logc in v.items():
                r = rates.get(s)
                if r is None:
                    r = rates[s] = self.get(s).rate_per_bin().tolist()
                p = r[bin_of(math.exp(logc))]
                if p > best:
                    best, name = p, s
            out.append((best, name))
        return out

    def node_probs(self, tree: DraftTree, rates: dict[str, list[float]] | None = None
                   ) -> list[float]:
        """``[m]`` acceptance probability per node of ``tree`` (best source's)."""
        return [p for p, _ in self.vote_probs(node_votes(tree, self.default), rates)]

    def observe(self, per_source: dict[str, tuple[list[int], list[bool]]]) -> None:
        """One step's verified nodes per source: ``{source: (bin indices, accepted)}``; each
        source's calibrator is updated (and decayed) once."""
        for s, (node_bins, hits) in per_source.items():
            self.get(s).observe_bins(node_bins, hits)

    def maps(self) -> dict[str, list[float]]:
        """Per source that has verified nodes, the calibrated acceptance probability per
        confidence bin, rounded to 3 decimals."""
        return {s: [round(x, 3) for x in c.rate_per_bin().tolist()]
                for s, c in self.calibrators.items() if c.tried.any()}
