"""Which drafter proposed each node of a token tree, and with what confidence.

Every drafter labels its trees (``DraftTree.sources``: ``"ngram"``, ``"eagle"``, ...). A tree
merged from several drafters (``drafters.merged``) is a ``MergedTree``: one node per distinct
token path, and per node the *votes* of every source that proposed it, each the source's own
cumulative draft log-probability of the path (its log *confidence*,
``policy.calibration``). A node proposed by several sources keeps all of them: each source's
calibration learns from every node it proposed (a node both proposed counts for both), so what
a source's node of a given confidence is worth is learnt without bias from the others.

``node_votes`` reads the votes of any tree; ``SourceStats`` counts, per source, the nodes
verified and accepted, overall and per depth (``get_metrics()["source_stats"]``).
"""

from __future__ import annotations

from dataclasses import dataclass

from specengine.speculative.tree import DraftTree

DEFAULT_SOURCE = "draft"  # the source of a tree that names none


@dataclass(eq=False)
class MergedTree(DraftTree):
    """A ``DraftTree`` built from several drafters' trees (``drafters.merged.merge_trees``).

    Attributes:
        votes: ``m`` dicts, per node ``{source: cumulative draft log-probability of the node's
            path under that source}`` (log confidence, <= 0 for a probability), one entry per
            source that proposed the node.

    The inherited fields describe the best vote (the source whose calibrated acceptance
    probability is highest): ``sources[i]`` names it, and ``draft_logprobs[i]`` is its
    cumulative log-probability minus that of the parent's best vote, so that ``exp`` of the
    cumulative sum along a path (``calibration.confidence_list``) is each node's best-vote
    confidence. (An entry can then be positive: the parent's best source may be less confident
    in the path than the child's.)

    Raises:
        ValueError: as ``DraftTree``, and ``votes`` of the wrong length or with an empty dict.
    """

    votes: list[dict[str, float]] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.votes is None:
            raise ValueError("MergedTree.votes is required")
        if len(self.votes) != self.num_nodes:
            raise ValueError(f"MergedTree.votes has {len(self.votes)} entries, tokens "
                             f"{self.num_nodes}")
        if any(not v for v in self.votes):
            raise ValueError("MergedTree.votes: every node needs at least one source")

    def subset(self, keep: list[int]) -> MergedTree | None:
        """As ``DraftTree.subset``, votes kept (a ``MergedTree``)."""
        if not keep:
            return None
        if len(keep) == self.num_nodes:
            return self
        sub = DraftTree.subset(self, keep)
        return MergedTree(sub.tokens, sub.parents, sub.draft_logprobs, sub.sources,
                          votes=[self.votes[i] for i in keep])


def cumulative_logprobs(tree: DraftTree) -> list[float]:
    """Per node the sum of ``draft_logprobs`` from the root's child down to it."""
    cum: list[float] = []
    for par, lp in zip(tree.parents, tree.draft_logprobs):
        cum.append(lp + (cum[par] if par >= 0 else 0.0))
    return cum


def node_votes(tree: DraftTree, default: str = DEFAULT_SOURCE) -> list[dict[str, float]]:
    """Per node ``{source: cumulative draft log-probability}``: a ``MergedTree``'s votes;
    otherwise one vote per node, from ``tree.sources`` (``default`` when None)."""
    votes = getattr(tree, "votes", None)
    if votes is not None:
        return votes
    cum = cumulative_logprobs(tree)
    names = tree.sources or [default] * tree.num_nodes
    return [{s: c} for s, c in zip(names, cum)]


def node_source_names(tree: DraftTree, default: str = DEFAULT_SOURCE) -> list[tuple[str, ...]]:
    """Per node the names of the sources that proposed it (votes' keys; no log-probabilities
    summed, so cheaper than ``node_votes`` for a plain tree)."""
    votes = getattr(tree, "votes", None)
    if votes is not None:
        return [tuple(v) for v in votes]
    return [(s,) for s in (tree.sources or [default] * tree.num_nodes)]


class SourceStats:
    """Per source, draft nodes verified and accepted, overall and per depth (depth 1 = a child
    of the root). A node proposed by several sources counts for each of them.

    Args:
        default: source of trees without ``sources``.
    """

    def __init__(self, default: str = DEFAULT_SOURCE):
        self.default = default
        self.verified: dict[str, list[int]] = {}  # source -> [d]: nodes verified at depth d+1
        self.accepted: dict[str, list[int]] = {}  # source -> [d]: of those, accepted

    def record(self, tree: DraftTree, accepted: list[int]) -> None:
        """One verified ``tree`` whose nodes ``accepted`` (indices) were accepted."""
        acc = set(accepted)
        for i, (names, depth) in enumerate(zip(node_source_names(tree, self.default),
                                               tree.depths)):
            for s in names:
                ver = self.verified.setdefault(s, [])
                hit = self.accepted.setdefault(s, [])
                if len(ver) < depth:
                    ver += [0] * (depth - len(ver))
                    hit += [0] * (depth - len(hit))
                ver[depth - 1] += 1
                hit[depth - 1] += i in acc

    def as_dict(self) -> dict[str, dict]:
        """``{source: {"nodes_verified", "nodes_accepted", "acceptance" (accepted / verified),
        "verified_per_depth", "accepted_per_depth", "acceptance_per_depth"}}``."""
        out = {}
        for s, ver in self.verified.items():
            hit = self.accepted[s]
            n, a = sum(ver), sum(hit)
            out[s] = {"nodes_verified": n, "nodes_accepted": a,
                      "acceptance": a / n if n else 0.0,
                      "verified_per_depth": list(ver), "accepted_per_depth": list(hit),
                      "acceptance_per_depth": [h / v if v else 0.0 for h, v in zip(hit, ver)]}
        return out
