"""The step's draft budget spread over its sequences: one greedy pass over all scored draft
nodes by weighted marginal value (``allocate``), and the tally of how budgets were spread
(``BudgetSpread``, in the policy's metrics).

``AutoPolicy.refine`` keeps a node when its calibrated acceptance probability ``p`` pays for its
verify token: ``p >= bar`` with ``bar = rate * dT/dn`` (the step's predicted committed tokens
per second times the latency model's marginal seconds per forward token). ``allocate`` turns
that into a budget handed out by makespan value (Seer arXiv 2511.14617's marginal-benefit
allocation with priorities; DAS arXiv 2511.13841's length-aware budgets):

- the step's total token budget ``G`` is the number of nodes the unweighted cut keeps, i.e.
  the verify tokens the latency model says pay at this rate;
- each node's value is ``v = p_path * w``, with ``p_path`` the smallest ``p`` on its path from
  the root (a node is verified only with its ancestors) and ``w`` its sequence's weight
  (``remaining.length_weights``: larger for longer expected remaining output);
- nodes are taken in decreasing ``v`` while ``v >= bar`` and fewer than ``G`` are taken.

The result is one threshold ``v*`` and per-tree bars ``v* / w``: what ``TreeCutter.cut`` applies.
With equal weights the taken set is exactly the unweighted cut (``v* = bar``); with unequal
ones the budget moves to the sequences whose tokens shorten the rollout's tail, and a sequence
may get no node at all.
"""

from __future__ import annotations

import math

#: lower edges of the nodes-per-sequence histogram bins: 0, 1, 2-3, 4-7, 8-15, 16-31, 32+
HIST_EDGES = (0, 1, 2, 4, 8, 16, 32)


def path_min(p: list[float], parents: list[int]) -> list[float]:
    """Per node, the smallest of ``p`` along its path from the root (parents precede
    children)."""
    out: list[float] = []
    for x, par in zip(p, parents):
        out.append(x if par < 0 else min(x, out[par]))
    return out


def allocate(probs: list[list[float]], parents: list[list[int]], weights: list[float],
             bar: float) -> tuple[list[float], int]:
    """The per-tree bars that keep the ``G`` highest-value nodes of all trees (see the module
    docstring), and ``G``.

    Args:
        probs: per tree, its nodes' acceptance probabilities (``TreeCutter.probabilities``).
        parents: per tree, its nodes' parent indices (``DraftTree.parents``).
        weights: per tree, its sequence's weight (> 0).
        bar: the step's unweighted bar (committed tokens a verify token must win back).

    Returns:
        ``(bars, G)``: one bar per tree, to compare that tree's ``p`` with (``keep_worth``),
        and the budget ``G`` (nodes the unweighted cut keeps). Nodes tied at the last value
        taken are all kept, so the total may exceed ``G`` by such ties.

    Raises:
        ValueError: lists of different lengths, or a weight that is not > 0.
    """
    if not len(probs) == len(parents) == len(weights):
        raise ValueError(f"allocate: {len(probs)} probability lists, {len(parents)} parent "
                         f"lists and {len(weights)} weights; need one of each per tree")
    if any(not w > 0 for w in weights):
        raise ValueError(f"allocate weights={weights}: every weight must be > 0")
    budget, values = 0, []
    for p, par, w in zip(probs, parents, weights):
        for x in path_min(p, par):
            budget += x >= bar
            if x * w >= bar:
                values.append(x * w)
    if len(values) <= budget:
        top = bar
    else:
        values.sort(reverse=True)
        top = values[budget - 1] if budget else math.inf
    if math.isinf(top):
        return [math.inf] * len(weights), 0
    # the division may round either way: keep the node that set ``top`` (and exact ties)
    return [top if w == 1.0 else top / w * (1 - 1e-9) for w in weights], budget


class BudgetSpread:
    """How the draft budget was spread over the sequences of the speculative steps: nodes
    verified per sequence per step (a histogram, mean, max, share of sequences drafted for)
    and, where remaining lengths were estimated, nodes against expected remaining output
    (Pearson correlation; mean nodes in the longer and the shorter half of each step)."""

    def __init__(self):
        self.seq_steps = 0  # (sequence, speculative step) pairs
        self.nodes = 0
        self.max_nodes = 0
        self.drafted = 0  # pairs with at least one node
        self.hist = [0] * len(HIST_EDGES)
        self.weighted_steps = 0  # steps whose weights differed between sequences
        self._n = 0  # pairs with an estimate: moments for the correlation
        self._sx = self._sy = self._sxx = self._syy = self._sxy = 0.0
        self._long = [0, 0]  # (nodes, sequences) in the longer half of a step
        self._short = [0, 0]

    def observe(self, nodes: list[int], remaining: list[float] | None = None,
                weighted: bool = False) -> None:
        """One speculative step: ``nodes`` verified per decoding sequence (0 for those with no
        tree), their expected remaining output tokens (``remaining``; None: not estimated) and
        whether their weights differed (``weighted``)."""
        self.seq_steps += len(nodes)
        self.nodes += sum(nodes)
        self.max_nodes = max(self.max_nodes, max(nodes, default=0))
        self.weighted_steps += weighted
        for k in nodes:
            self.drafted += k > 0
            self.hist[sum(k >= e for e in HIST_EDGES) - 1] += 1
        if remaining is None or len(remaining) != len(nodes):
            return
        for x, y in zip(remaining, nodes):
            self._n += 1
            self._sx += x
            self._sy += y
            self._sxx += x * x
            self._syy += y * y
            self._sxy += x * y
        if len(nodes) > 1:
            order = sorted(range(len(nodes)), key=remaining.__getitem__)
            half = len(order) // 2
            for i in order[:half]:
                self._short[0] += nodes[i]
                self._short[1] += 1
            for i in order[len(order) - half:]:
                self._long[0] += nodes[i]
                self._long[1] += 1

    def observe_step(self, rec, step_weights: dict) -> None:
        """Count how a speculative step's nodes (``rec``, a ``StepRecord``) were spread over its
        decoding sequences; ``step_weights``: ``select``'s id -> (expected remaining, weight)
        of this step's sequences (``{}`` or partial: no select this step, so the sequences
        without a tree drafted nothing)."""
        given = {id(seq): tree.num_nodes for seq, tree, _ in rec.verified}
        if len(step_weights) == rec.num_decode:
            nodes = [given.get(k, 0) for k in step_weights]
            rem = [r for r, _ in step_weights.values()]
            self.observe(nodes, None if None in rem else rem,
                         len({w for _, w in step_weights.values()}) > 1)
        else:
            nodes = list(given.values())
            self.observe(nodes + [0] * max(rec.num_decode - len(nodes), 0))

    def correlation(self) -> float | None:
        """Pearson correlation of nodes with expected remaining output (None: undefined)."""
        n = self._n
        if n < 2:
            return None
        vx = self._sxx - self._sx ** 2 / n
        vy = self._syy - self._sy ** 2 / n
        if vx <= 1e-12 * max(self._sxx, 1.0) or vy <= 1e-12 * max(self._syy, 1.0):
            return None
        return (self._sxy - self._sx * self._sy / n) / math.sqrt(vx * vy)

    def stats(self) -> dict:
        """``seq_steps``, ``nodes_per_seq_mean``, ``nodes_per_seq_max``, ``drafted_frac``,
        ``nodes_hist`` (bin label -> sequence-steps), ``weighted_steps``,
        ``corr_nodes_remaining``, ``nodes_longer_half`` and ``nodes_shorter_half`` (mean nodes
        per sequence in the half of each step with the longer / shorter expected remaining
        output; None before any)."""
        n = self.seq_steps
        labels = [f"{a}-{b - 1}" if b - 1 > a else str(a)
                  for a, b in zip(HIST_EDGES, HIST_EDGES[1:])] + [f"{HIST_EDGES[-1]}+"]
        corr = self.correlation()
        return {
            "seq_steps": n, "nodes_per_seq_mean": self.nodes / n if n else 0.0,
            "nodes_per_seq_max": self.max_nodes, "drafted_frac": self.drafted / n if n else 0.0,
            "nodes_hist": dict(zip(labels, self.hist)), "weighted_steps": self.weighted_steps,
            "corr_nodes_remaining": None if corr is None else round(corr, 4),
            "nodes_longer_half": self._long[0] / self._long[1] if self._long[1] else None,
            "nodes_shorter_half": self._short[0] / self._short[1] if self._short[1] else None}
