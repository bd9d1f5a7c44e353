"""Acceptance model fitted online: expected tokens committed per sequence for a draft strategy.

Per depth i the model keeps the conditional acceptance rate
``alpha_i = P(accepted >= i | accepted >= i - 1)`` from decayed counts, so

    E[committed | strategy of depth d] = 1 + sum_{j<=d} prod_{i<=j} alpha_i

(the bonus token plus the expected accepted prefix; Leviathan et al. 2023 for i.i.d. alpha,
per-depth rates as in EAGLE-2 arXiv 2406.16858 and RLHFSpec arXiv 2512.04752). A sequence the
drafter found nothing for counts as a rejection at depth 1, so the estimate is what the
strategy actually yields with this drafter, n-gram misses included. Chains of every depth share
one set of rates (a deeper chain extends a shallower one); each tree shape has its own, with a
prior derived from the chain's (``tree_prior``). Counts decay by ``decay`` per observed step
(and per step without speculation if ``age`` is called), so the model follows a drafter or
target that changes (a weight update in RL, a sequence that starts repeating itself).

The expected number of draft nodes per sequence (``fill``) is learned per strategy too: an
n-gram drafter often drafts fewer nodes than the strategy allows, and the verify cost depends
on the nodes actually sent.
"""

from __future__ import annotations

import numpy as np

from specengine.speculative.strategy import Strategy


class DepthRates:
    """Decayed success/trial counts per depth 1..max_depth."""

    def __init__(self, max_depth: int):
        self.success = np.zeros(max_depth)
        self.trials = np.zeros(max_depth)

    def observe(self, accepted: np.ndarray, depth: int, decay: float) -> None:
        """Sequences drafted ``depth`` deep accepted ``accepted`` tokens each."""
        self.success *= decay
        self.trials *= decay
        d = np.arange(1, depth + 1)[:, None]  # [depth, 1]
        a = accepted[None, :]  # [1, n]
        self.trials[:depth] += (d <= a + 1).sum(axis=1)  # depth i is tried if i-1 accepted
        self.success[:depth] += (d <= a).sum(axis=1)

    def rates(self, prior: np.ndarray, prior_count: float) -> np.ndarray:
        """Posterior mean rate per depth: ``prior`` carries ``prior_count`` pseudo-trials; an
        unobserved depth takes the rate of the depth before it (optimistic but data-driven)."""
        out = np.empty(len(self.trials))
        prev = prior[0]
        for i in range(len(out)):
            p = max(prior[i], prev) if self.trials[i] < 1 else prior[i]
            out[i] = (self.success[i] + prior_count * p) / (self.trials[i] + prior_count)
            prev = out[i]
        return out


def tree_prior(chain: np.ndarray, strategy: Strategy) -> np.ndarray:
    """Prior conditional rates of a tree from the chain's: at each depth the tree offers
    ``w = min(k, m / d)`` candidates on average; counted as ``sqrt(w)`` independent tries
    (candidates of one parent are correlated), ``1 - (1 - alpha_i) ** sqrt(w)``. The square
    root is what the shipped EAGLE drafter measured on held-out prompts (bench_spec): GSM T = 0
    chain alpha_1 0.75 -> trees k = 2, 3, 4 reach 0.86, 0.91, 0.92 (exponents 1.4, 1.7, 1.8);
    chat T = 1 0.32 -> k = 2, 4 reach 0.43, 0.51 (1.5, 1.9). Counted as w full tries the prior
    promised a k = 4 tree 5.8 tokens per step where it committed 2.0, and trying it cost
    more than the gains. The prior also anchors the tree's own counts once it has been run."""
    w = min(strategy.topk, strategy.budget / strategy.depth)
    return 1.0 - (1.0 - chain) ** np.sqrt(max(w, 1.0))


class AcceptanceModel:
    """Online acceptance statistics for one drafter.

    Args:
        max_depth: deepest strategy that will be asked about.
        decay: factor applied to all counts per observed step (memory ~ 1/(1-decay) steps).
        prior_count: pseudo-trials of the prior per depth.
        prior_rate: prior acceptance rate at depth 1 before any data.
    """

    def __init__(self, max_depth: int, decay: float = 0.97, prior_count: float = 2.0,
                 prior_rate: float = 0.5):
        self.max_depth, self.decay, self.prior_count = max_depth, decay, prior_count
        self.prior = np.full(max_depth, prior_rate)
        self.chain = DepthRates(max_depth)
        self.trees: dict[Strategy, DepthRates] = {}
        self.fill: dict[Strategy, float] = {}  # mean fraction of strategy.num_nodes verified
        self.proposed_fill: dict[Strategy, float] = {}  # ... drafted (before the policy's cuts)
        self._cache: dict = {}  # cleared by observe: per-strategy results, "chain" rates

    def rates(self, strategy: Strategy) -> np.ndarray:
        """Conditional acceptance rate per depth ``1..max_depth`` for ``strategy``'s shape."""
        chain = self._cache.get("chain")
        if chain is None:
            chain = self._cache["chain"] = self.chain.rates(self.prior, self.prior_count)
        if strategy.is_chain:
            return chain
        prior = tree_prior(chain, strategy)
        tree = self.trees.get(strategy)
        return prior if tree is None else tree.rates(prior, self.prior_count)

    def expected_accepted(self, strategy: Strategy | None) -> float:
        """Expected accepted draft tokens per sequence (0 for no speculation)."""
        if strategy is None:
            return 0.0
        got = self._cache.get(strategy)
        if got is None:
            got = self._cache[strategy] = float(
                np.cumprod(self.rates(strategy)[:strategy.depth]).sum())
        return got

    def expected_committed(self, strategy: Strategy | None) -> float:
        """Expected tokens committed per sequence in one step (accepted + the bonus token)."""
        return 1.0 + self.expected_accepted(strategy)

    def expected_nodes(self, strategy: Strategy | None) -> float:
        """Expected draft nodes sent to the target per sequence."""
        if strategy is None:
            return 0.0
        return self.fill.get(strategy, 1.0) * strategy.num_nodes

    def expected_proposed(self, strategy: Strategy | None) -> float:
        """Expected draft nodes the drafter builds per sequence (before the policy cuts any)."""
        if strategy is None:
            return 0.0
        return self.proposed_fill.get(strategy, 1.0) * strategy.num_nodes

    def age(self) -> None:
        """One step without speculation: decay all counts, so statistics that are no longer
        refreshed drift back to the prior and the policy tries speculating again."""
        for rates in (self.chain, *self.trees.values()):
            rates.success *= self.decay
            rates.trials *= self.decay
        self._cache.clear()

    def expected(self, strategies: tuple) -> tuple[np.ndarray, np.ndarray]:
        """``(expected_committed, expected_nodes, expected_proposed)`` per strategy of
        ``strategies`` as arrays, cached until the next ``observe``."""
        got = self._cache.get(strategies)
        if got is None:
            got = self._cache[strategies] = (
                np.array([self.expected_committed(s) for s in strategies]),
                np.array([self.expected_nodes(s) for s in strategies]),
                np.array([self.expected_proposed(s) for s in strategies]))
        return got

    def observe(self, strategy: Strategy, accepted_per_seq: list[int], num_decode: int,
                num_drafted: int, num_proposed: int | None = None) -> None:
        """One verify step with ``strategy``: ``accepted_per_seq`` for the sequences that had a
        tree, ``num_decode`` sequences in all (the rest drafted nothing), ``num_drafted`` nodes
        sent in all, ``num_proposed`` nodes drafted (default ``num_drafted``)."""
        if num_decode == 0 or strategy.depth > self.max_depth:
            return
        missing = num_decode - len(accepted_per_seq)
        accepted = np.array(list(accepted_per_seq) + [0] * missing)
        rates = self.chain if strategy.is_chain else self.trees.setdefault(
            strategy, DepthRates(self.max_depth))
        # a sequence with no tree was "rejected" at depth 1: same as accepted = 0
        rates.observe(accepted, strategy.depth, self.decay)
        for fills, n in ((self.fill, num_drafted), (self.proposed_fill, num_proposed)):
            fill = (num_drafted if n is None else n) / (num_decode * strategy.num_nodes)
            old = fills.get(strategy)
            fills[strategy] = fill if old is None else 0.9 * old + 0.1 * fill
        self._cache.clear()
