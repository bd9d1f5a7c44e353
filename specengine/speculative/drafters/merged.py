"""One token tree from several drafters (``speculative_config={"method": ["ngram", "eagle"]}``).

Each part (any ``Drafter``: n-gram lookup, EAGLE, a draft model, rollout memory, ...) drafts its
own tree for every sequence under the step's strategy; ``merge_trees`` joins a sequence's trees
into one trie (the same token path from the root is one node, whichever sources proposed it)
and fills one verify budget (``strategy.budget`` nodes) best-first by each node's calibrated
acceptance probability: a node's probability is the best, over the sources that proposed it, of
that source's calibrated map (``policy.calibration.SourceCalibrators``) at the source's own
confidence in the node's path. A node proposed by several sources keeps all their votes
(``sources.MergedTree``), so each source's calibration learns from all its nodes; the tree's
``sources`` names the best one per node. Children are ordered by probability and siblings carry
distinct tokens (a trie), so the tree is deterministic and verification stays exact
(``sampling.verify``). The per-source merge follows the multi-drafter token trees of SpecInfer
(arXiv 2305.09781), with EAGLE-2's best-first budget fill (arXiv 2406.16858).

The drafter fills the budget with per-source calibrators the policy trains on the verified
nodes (``policy.make_policy`` wires them): with the ``auto`` policy its own, which then also cut
the merged tree further; with another policy a learner the policy feeds every step.
"""

from __future__ import annotations

import heapq
import math

import torch

from specengine.engine.sequence import Sequence
from specengine.speculative.drafters.base import Drafter
from specengine.speculative.policy.calibration import SourceCalibrators, bin_of
from specengine.speculative.sources import MergedTree, node_votes
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree


def merge_trees(trees: list[DraftTree | None], names: list[str], budget: int,
                scorer: SourceCalibrators, rates: dict[str, list[float]] | None = None,
                explore: bool = False, counts: dict | None = None,
                base: str | None = None) -> MergedTree | None:
    """One sequence's trees merged into one trie of at most ``budget`` nodes.

    Args:
        trees: one tree (or None) per source.
        names: per tree, the source name of nodes its tree does not label (``sources`` None).
        budget: most nodes kept (>= 1).
        scorer: the per-source calibrators that give each vote its acceptance probability.
        rates: a ``scorer.rates()`` snapshot (default: taken now).
        explore: fill the budget round-robin over the sources (each source's own best nodes in
            turn) instead of by probability, so every source keeps being verified at its own
            best nodes even when its calibration looks poor.
        counts: if given, ``counts["proposed"][source]`` and ``counts["kept"][source]`` are
            increased by the nodes each source proposed and the kept nodes it voted for.
        base: a source whose tree is kept first, whole (its first ``budget`` nodes when it has
            more); the rest of the budget is then filled from the other trees. Acceptance is the
            longest path of the tree that the target's own samples follow, so a tree holding the
            base's has at least the base's acceptance: the merge is never worse than that source
            alone at the same budget.

    Returns:
        A ``MergedTree`` (parents before children; children by descending probability; a
        lone tree within the budget keeps its own order), or None when no tree has a node.

    Raises:
        ValueError: ``budget < 1`` or ``trees``/``names`` of different lengths.
    """
    if budget < 1:
        raise ValueError(f"merge_trees budget={budget}: must be >= 1")
    if len(trees) != len(names):
        raise ValueError(f"merge_trees: {len(trees)} trees but {len(names)} names")
    present = [(t, n) for t, n in zip(trees, names) if t is not None and t.num_nodes]
    if len(present) == 1 and present[0][0].num_nodes <= budget:  # one source: kept whole
        return _lone_tree(*present[0], counts)
    union = _Union.of(trees, names)
    if not union.tok:
        return None
    rates = scorer.rates() if rates is None else rates
    per_vote = [_vote_probs(v, scorer, rates) for v in union.votes]
    best = [max(pv, key=pv.get) for pv in per_vote]  # ties: the first source
    prob = [pv[b] for pv, b in zip(per_vote, best)]
    conf = [max(v.values()) for v in union.votes]
    if explore:
        key = _explore_keys(union, per_vote, prob)
    else:
        key = [(-prob[u], -conf[u], union.depth[u], u) for u in range(len(union.tok))]
    start = union.nodes_of(trees[names.index(base)], budget) if base in names else []
    chosen = _best_first(union.par, key, budget, start)
    chosen.sort(key=lambda u: (union.depth[u], -prob[u], -conf[u], u))
    if counts is not None:
        _count(counts, "proposed", union.votes)
        _count(counts, "kept", [union.votes[u] for u in chosen])
    return union.tree(chosen, best)


def _count(counts: dict, what: str, votes: list[dict[str, float]]) -> None:
    """Add one to ``counts[what][source]`` per node of ``votes`` per source that voted."""
    for v in votes:
        for s in v:
            counts[what][s] = counts[what].get(s, 0) + 1


def _lone_tree(tree: DraftTree, name: str, counts: dict | None) -> MergedTree:
    """The only source's tree, kept whole (its own node order)."""
    votes = node_votes(tree, name)
    if counts is not None:
        for v in votes:
            for s in v:
                counts["proposed"][s] = counts["proposed"].get(s, 0) + 1
                counts["kept"][s] = counts["kept"].get(s, 0) + 1
    return MergedTree(tree.tokens, tree.parents, tree.draft_logprobs,
                      list(tree.sources or [name] * tree.num_nodes), votes=votes)


class _Union:
    """The trie of several trees: per node its token, parent (-1: the root), depth and votes
    (source -> that source's cumulative log-confidence in the node's path)."""

    def __init__(self):
        self.tok: list[int] = []
        self.par: list[int] = []
        self.depth: list[int] = []
        self.votes: list[dict[str, float]] = []
        self.index: dict[tuple[int, int], int] = {}  # (parent, token) -> union node

    @classmethod
    def of(cls, trees: list[DraftTree | None], names: list[str]) -> _Union:
        u = cls()
        for tree, name in zip(trees, names):
            if tree is not None:
                u.add(tree, name)
        return u

    def add(self, tree: DraftTree, name: str) -> None:
        """Join ``tree`` (unlabelled nodes are ``name``'s) into the trie."""
        where: list[int] = []  # tree node -> union node
        for j, (t, v) in enumerate(zip(tree.tokens, node_votes(tree, name))):
            p = where[tree.parents[j]] if tree.parents[j] >= 0 else -1
            u = self.index.get((p, t))
            if u is None:
                u = self.index[(p, t)] = len(self.tok)
                self.tok.append(t)
                self.par.append(p)
                self.depth.append(self.depth[p] + 1 if p >= 0 else 1)
                self.votes.append({})
            for s, logc in v.items():
                self.votes[u][s] = max(logc, self.votes[u].get(s, -math.inf))
            where.append(u)

    def nodes_of(self, tree: DraftTree | None, limit: int) -> list[int]:
        """The union nodes of ``tree``'s first ``limit`` nodes (parents first, as the tree)."""
        where: list[int] = []
        for j in range(min(limit, tree.num_nodes if tree is not None else 0)):
            p = where[tree.parents[j]] if tree.parents[j] >= 0 else -1
            where.append(self.index[(p, tree.tokens[j])])
        return where

    def tree(self, chosen: list[int], best: list[str]) -> MergedTree:
        """The ``chosen`` nodes (parents first) as a tree labelled and scored by their best
        source ``best[u]``."""
        new = {u: i for i, u in enumerate(chosen)}
        par, votes = self.par, self.votes
        lps = []
        for u in chosen:
            p = par[u]
            lps.append(votes[u][best[u]] - (votes[p][best[p]] if p >= 0 else 0.0))
        return MergedTree([self.tok[u] for u in chosen],
                          [new[par[u]] if par[u] >= 0 else -1 for u in chosen],
                          lps, [best[u] for u in chosen], votes=[votes[u] for u in chosen])


def _vote_probs(votes: dict[str, float], scorer: SourceCalibrators,
                rates: dict[str, list[float]]) -> dict[str, float]:
    """Per source of one node's ``votes``: its calibrated acceptance probability at its
    confidence (a source missing from ``rates`` is added to it)."""
    pv = {}
    for s, logc in votes.items():
        r = rates.get(s)
        if r is None:
            r = rates[s] = scorer.get(s).rate_per_bin().tolist()
        pv[s] = r[bin_of(math.exp(logc))]
    return pv


def _explore_keys(union: _Union, per_vote: list[dict[str, float]],
                  prob: list[float]) -> list[tuple]:
    """Fill keys for a round-robin over the sources: each node's best rank within a source
    that proposed it, then probability, depth, index."""
    n, votes = len(union.tok), union.votes
    rank = [math.inf] * n
    for s in {s for v in votes for s in v}:
        mine = sorted((u for u in range(n) if s in votes[u]),
                      key=lambda u: (-per_vote[u][s], -votes[u][s], union.depth[u], u))
        for r, u in enumerate(mine):
            rank[u] = min(rank[u], r)
    return [(rank[u], -prob[u], union.depth[u], u) for u in range(n)]


def _best_first(par: list[int], key: list[tuple], budget: int,
                start: list[int] | None = None) -> list[int]:
    """Up to ``budget`` nodes by ascending ``key`` (its last item is the node), a node
    entering only once its parent did; the nodes of ``start`` (closed under parents) first."""
    children: list[list[int]] = [[] for _ in range(len(par) + 1)]  # slot 0 = root
    for u, p in enumerate(par):
        children[p + 1].append(u)
    chosen = list(start or [])
    taken = set(chosen)
    heap = [key[c] for u in [-1, *chosen] for c in children[u + 1] if c not in taken]
    heapq.heapify(heap)
    while heap and len(chosen) < budget:
        u = heapq.heappop(heap)[-1]
        chosen.append(u)
        for c in children[u + 1]:
            heapq.heappush(heap, key[c])
    return chosen


def matched_length(tree: DraftTree | None, tokens: list[int]) -> int:
    """How many of ``tokens`` (what the target committed after the draft's root) ``tree``
    drafted: the depth of its longest path that they follow. Verification accepts exactly the
    nodes on that path (a node is accepted when it carries the target's own token,
    ``sampling.verify``), so this is what verifying ``tree`` would have given, whichever tree was
    verified instead (a counterfactual acceptance, exact up to the tokens committed)."""
    node, depth = -1, 0
    if tree is None:
        return 0
    for t in tokens:
        node = tree.child_with(node, t)
        if node is None:
            break
        depth += 1
    return depth


class MergedDrafter(Drafter):
    """Several drafters' trees merged into one token tree per sequence (``merge_trees``).

    Every part drafts for every sequence with the step's strategy, so each part's tree obeys
    its depth and budget; the merge keeps at most ``strategy.budget`` nodes in all (one verify
    budget; the width ``topk`` bounds each part's tree, not the merged one). One sequence in
    ``explore_every`` (rotating) is filled round-robin over the sources instead of by
    probability (``merge_trees(explore=True)``), so a source whose calibration is too
    pessimistic still has its best nodes verified and its map corrected.

    Each merged tree holds its best source's tree: every part's tree is scored against what
    the target then committed (``matched_length``: the tokens it would have had accepted). The
    part with the most per draft over all sequences is the *base* of every merge: its tree
    enters whole and the others fill the rest of the budget (``merge_trees(base=)``); a tree
    that holds the base's accepts at least what the base's would. A sequence's merges take
    another part as base only when that part's lead on the sequence's own drafts (the same
    drafts scored for both, paired) is ``Z`` standard errors above zero, so a lead that is
    noise does not make the weaker part the base. Each merged tree then holds the tree of the
    best source (overall, or clearly for its sequence), and the other sources add acceptance
    where that tree leaves budget unused. Over a whole rollout the totals can still differ by a
    token or so either way: once one row accepts a token more, its later drafts start at other
    positions (measured at one static budget: within 1 accepted token of EAGLE alone in
    2200-2500 per epoch, qwen2.5-0.5b and SmolLM2-135M RL epochs).

    The engine's hooks go to every part: ``observe`` to those that want hidden states,
    ``release`` and ``discard`` to all, ``features`` from the part that keeps them,
    ``publish`` (EAGLE's hot swap of drafter weights) to those with trainable weights
    and ``set_weight_version`` to all (the suffix drafter ages its history by it).
    Anything else of a part is reached through the part itself (``part(name)``,
    ``find(kind)``, ``walk()``).

    Args:
        parts: the drafters, each with a distinct ``name`` (their order breaks ties).
        strategy: default tree shape (default: the first part's).
        scorer: per-source calibrators used to fill the budget (default: new ones at their
            prior; ``policy.make_policy`` gives it the policy's through ``use_scorer``).
        explore_every: one sequence in this many is filled round-robin (0: never).

    Raises:
        ValueError: no parts, or two parts with the same name.
    """

    def __init__(self, parts: list[Drafter], strategy: Strategy | None = None,
                 scorer: SourceCalibrators | None = None, explore_every: int = 8):
        if not parts:
            raise ValueError("MergedDrafter.parts is empty: give at least one drafter")
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"MergedDrafter.parts: names {names} repeat; each source must be "
                             "distinct")
        super().__init__(strategy or parts[0].strategy)
        self.parts = list(parts)
        self.name = "+".join(names)
        self.wants_hidden = any(p.wants_hidden for p in parts)
        self.observes_at_draft = all(p.observes_at_draft for p in parts if p.wants_hidden)
        self.catches_up = any(p.catches_up for p in parts)
        self.scorer = scorer or SourceCalibrators()
        self.explore_every = explore_every
        self.calls = 0
        self.counts: dict[str, dict[str, int]] = {"proposed": {}, "kept": {}}
        # seq_id -> (tokens when drafted, each part's tree): scored at the next draft
        self._drafted: dict[int, tuple[int, list[DraftTree | None]]] = {}
        self._matched: dict[str, list[float]] = {n: [0.0, 0] for n in names}  # sum, drafts
        self._seq_matched: dict[int, _SeqScore] = {}  # seq_id -> its drafts' scores
        self._bases: dict[str, int] = {}  # source -> merges it was the base of

    Z = 2.0  # standard errors a sequence's own best part must lead the overall best by

    def use_scorer(self, scorer: SourceCalibrators) -> None:
        """Fill the budget with ``scorer`` from now on (calibrators a policy trains)."""
        self.scorer = scorer

    def part(self, name: str) -> Drafter:
        """The part called ``name``.

        Raises:
            KeyError: no part has that name.
        """
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"no drafter {name!r} among {[p.name for p in self.parts]}")

    def wrapped(self) -> list[Drafter]:
        """The parts, in order."""
        return list(self.parts)

    def propose(self, seqs: list[Sequence], strategy: Strategy) -> list[DraftTree | None]:
        per_part = [p.propose(seqs, strategy) for p in self.parts]
        names = [p.name for p in self.parts]
        rates = self.scorer.rates()
        self.calls += 1
        every = self.explore_every
        out = []
        for i, seq in enumerate(seqs):
            trees = [t[i] for t in per_part]
            self._score(seq)
            base = self.base_of(seq)
            if base is not None:
                self._bases[base] = self._bases.get(base, 0) + 1
            out.append(merge_trees(trees, names, strategy.budget, self.scorer, rates,
                                   bool(every) and (self.calls + i) % every == 0, self.counts,
                                   base))
            self._drafted[seq.seq_id] = (len(seq.token_ids), trees)
        return out

    def _score(self, seq: Sequence) -> None:
        """Score the parts' last trees for ``seq`` against the tokens committed since."""
        drafted = self._drafted.pop(seq.seq_id, None)
        if drafted is None or len(seq.token_ids) <= drafted[0]:
            return
        start, trees = drafted
        new = seq.token_ids[start:]
        matched = {p.name: matched_length(t, new) for p, t in zip(self.parts, trees)}
        for name, m in matched.items():
            self._matched[name][0] += m
            self._matched[name][1] += 1
        self._seq_matched.setdefault(seq.seq_id, _SeqScore()).add(matched)

    def base_of(self, seq: Sequence) -> str | None:
        """The part whose tree enters ``seq``'s merge whole: the most tokens matched per draft
        over all sequences, unless on ``seq``'s own drafts another part leads it by more than
        ``Z`` standard errors of the paired mean difference (then that part). None before any
        part was scored; ties: the first part."""
        if not any(n for _, n in self._matched.values()):
            return None
        names = [p.name for p in self.parts]
        overall = max(names, key=lambda n: self._matched[n][0] / max(self._matched[n][1], 1))
        mine = self._seq_matched.get(seq.seq_id)
        if mine is None:
            return overall
        own = max(names, key=lambda n: mine.sums[n])
        if own == overall:
            return overall
        lead, se = mine.lead(own, overall)
        return own if lead - self.Z * se > 0 else overall

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        for p in self.parts:
            if p.wants_hidden:
                p.observe(seq, start, hidden)

    def prefill(self, samples: list[Sequence]) -> list[Sequence]:
        """Every part's ``prefill``; the samples every part that keeps per-sequence state
        built it for (a part that keeps none, like the suffix drafter, has nothing to catch
        up on)."""
        built = [{id(s) for s in p.prefill(samples)} for p in self.parts if p.catches_up]
        return [s for s in samples if built and all(id(s) in b for b in built)]

    def observed(self, seq: Sequence) -> int:
        """The fewest positions any feature-reading part holds for ``seq`` (0 without one)."""
        return min((p.observed(seq) for p in self.parts if p.wants_hidden), default=0)

    def release(self, seq: Sequence) -> None:
        self._forget(seq)
        for p in self.parts:
            p.release(seq)

    def discard(self, seq: Sequence) -> None:
        self._forget(seq)
        for p in self.parts:
            p.discard(seq)

    def _forget(self, seq: Sequence) -> None:
        self._drafted.pop(seq.seq_id, None)
        self._seq_matched.pop(seq.seq_id, None)

    def set_weight_version(self, version: int) -> None:
        """Tell every part the target's new weight version."""
        for p in self.parts:
            p.set_weight_version(version)

    def features(self, seq: Sequence) -> torch.Tensor | None:
        """The first part's features for ``seq`` that are not None (EAGLE's), else None."""
        for p in self.parts:
            f = p.features(seq)
            if f is not None:
                return f
        return None

    def publish(self, state_dict: dict, version: int) -> None:
        """New drafter weights for the parts that take them (``EagleDrafter.publish``).

        Raises:
            ValueError: no part takes published weights.
        """
        takers = [p for p in self.parts if p.trainable_model() is not None]
        if not takers:
            raise ValueError(f"no part of {self.name!r} takes published weights")
        for p in takers:
            p.publish(state_dict, version)

    def stats(self) -> dict:
        """Every part's ``stats()`` (e.g. EAGLE's ``drafter_version``) merged, plus
        ``merged_nodes_proposed`` and ``merged_nodes_kept``: per source, the nodes it proposed
        and those of them the budget fill kept (a node several proposed counts for each);
        ``merged_base``: per source, the merges it was the base of; and
        ``merged_matched_per_draft``: per source, the tokens its own tree would have had
        accepted per draft (``matched_length``)."""
        out: dict = {}
        for p in self.parts:
            out.update(p.stats())
        out["merged_nodes_proposed"] = dict(self.counts["proposed"])
        out["merged_nodes_kept"] = dict(self.counts["kept"])
        out["merged_base"] = dict(self._bases)
        out["merged_matched_per_draft"] = {n: t / k if k else 0.0
                                           for n, (t, k) in self._matched.items()}
        return out


class _SeqScore:
    """One sequence's draft scores: per part the sum of tokens matched, and per pair of parts
    the sum of squared differences on the same drafts (for the paired standard error)."""

    def __init__(self):
        self.n = 0
        self.sums: dict[str, float] = {}
        self.squares: dict[tuple[str, str], float] = {}

    def add(self, matched: dict[str, int]) -> None:
        """One draft's tokens matched per part."""
        self.n += 1
        names = sorted(matched)
        for i, a in enumerate(names):
            self.sums[a] = self.sums.get(a, 0.0) + matched[a]
            for b in names[i + 1:]:
                diff = matched[a] - matched[b]
                self.squares[(a, b)] = self.squares.get((a, b), 0.0) + diff * diff

    def lead(self, a: str, b: str) -> tuple[float, float]:
        """``a``'s mean lead over ``b`` in tokens per draft and its standard error (inf below
        two drafts)."""
        d = (self.sums[a] - self.sums[b]) / self.n
        if self.n < 2:
            return d, math.inf
        var = self.squares[tuple(sorted((a, b)))] / self.n - d * d
        return d, math.sqrt(max(var, 0.0) / (self.n - 1))
