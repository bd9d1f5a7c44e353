"""Token tree drafted for one sequence (SpecInfer arXiv 2305.09781; EAGLE arXiv 2401.15077).

The root is the sequence's last committed token and is not a node. Nodes are numbered
``0..m-1`` with parents before children, so a single forward pass over them works. A chain is a
tree of width 1. Node ``i`` sits at position ``L - 1 + depths[i]`` of a sequence of ``L``
committed tokens and attends to the committed context and to its own ancestors only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass(eq=False)
class DraftTree:
    """Draft nodes of one sequence, chosen deterministically (top-k, n-gram lookup): siblings
    carry distinct tokens and the verifier tries them in order.

    Attributes:
        tokens: ``m`` token ids, one per node.
        parents: ``m`` parent indices; ``-1`` is the root; ``parents[i] < i``.
        draft_logprobs: ``m`` floats, log q of each node's token given its parent path
            (0.0 for deterministic drafters such as n-gram lookup; for a sampled sequence the
            model drafters give those of q perturbed by the sampling noise,
            ``specengine.speculative.drafters.coupling``). Default: zeros.
        sources: ``m`` drafter names, the source that proposed each node (``"eagle"``,
            ``"ngram"``, ``"suffix"``, ...), for per-source calibration and metrics; None
            when the tree has one unnamed source.
        depths: ``m`` ints, computed; a child of the root has depth 1.

    Raises:
        ValueError: inconsistent lengths, a parent that does not precede its child, a negative
            token, or duplicate sibling tokens.
    """

    tokens: list[int]
    parents: list[int]
    draft_logprobs: list[float] | None = None
    sources: list[str] | None = None
    depths: list[int] = field(init=False)
    _children: list[list[int]] = field(init=False, repr=False)
    # Siblings must differ; a test-side subclass whose children are i.i.d. draws from the draft
    # distribution (tests/reference_verify.py) turns this off.
    _distinct_siblings: ClassVar[bool] = True

    def __post_init__(self) -> None:
        m = len(self.tokens)
        if len(self.parents) != m:
            raise ValueError(f"DraftTree.parents has {len(self.parents)} entries, tokens {m}")
        if self.draft_logprobs is None:
            self.draft_logprobs = [0.0] * m
        if len(self.draft_logprobs) != m:
            raise ValueError(f"DraftTree.draft_logprobs has {len(self.draft_logprobs)} entries, "
                             f"tokens {m}")
        if self.sources is not None and len(self.sources) != m:
            raise ValueError(f"DraftTree.sources has {len(self.sources)} entries, tokens {m}")
        tokens, depths = self.tokens, []
        children: list[list[int]] = [[] for _ in range(m + 1)]  # 0 = root, 1 + i = node i
        pairs = set()  # (parent, token) of the nodes so far: siblings must differ
        for i, par in enumerate(self.parents):
            tok = tokens[i]
            if not -1 <= par < i:
                raise ValueError(f"DraftTree.parents[{i}]={par}: must be -1 or a node < {i}")
            if tok < 0:
                raise ValueError(f"DraftTree.tokens[{i}]={tok}: must be >= 0")
            if self._distinct_siblings:
                n = len(pairs)
                pairs.add((par, tok))
                if len(pairs) == n:
                    raise ValueError(f"DraftTree.tokens[{i}]={tok} repeats a sibling's token")
            children[par + 1].append(i)
            depths.append(depths[par] + 1 if par >= 0 else 1)
        self.depths, self._children = depths, children

    def subset(self, keep: list[int]) -> DraftTree | None:
        """The tree restricted to node indices ``keep`` (ascending, every kept node's parent
        kept too); None when ``keep`` is empty."""
        if not keep:
            return None
        if len(keep) == self.num_nodes:
            return self
        new = {old: j for j, old in enumerate(keep)}
        return DraftTree(
            [self.tokens[i] for i in keep], [new.get(self.parents[i], -1) for i in keep],
            [self.draft_logprobs[i] for i in keep],
            None if self.sources is None else [self.sources[i] for i in keep])

    @property
    def num_nodes(self) -> int:
        """m, the number of draft nodes (the root excluded)."""
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        """Length of the longest root-to-leaf path in nodes (0 for an empty tree)."""
        return max(self.depths, default=0)

    def children(self, i: int) -> list[int]:
        """Children of node ``i`` (``-1`` = the root), in the order the verifier tries them."""
        return self._children[i + 1]

    def child_with(self, i: int, token: int) -> int | None:
        """The child of node ``i`` (``-1`` = the root) carrying ``token``, or None (siblings
        carry distinct tokens, so there is at most one)."""
        return next((c for c in self._children[i + 1] if self.tokens[c] == token), None)

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root's child down to node ``i`` (``[]`` for the root)."""
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]

    def tree_mask(self, include_root: bool = False) -> torch.Tensor:
        """Ancestor mask: ``mask[i, j]`` is True iff node j is node i or one of its ancestors.

        Returns:
            ``[m, m]`` bool; with ``include_root``, ``[m + 1, m + 1]`` bool over
            ``[root, nodes...]`` where the root sees itself and every node sees the root.
        """
        m = self.num_nodes
        off = 1 if include_root else 0
        mask = torch.eye(m + off, dtype=torch.bool)
        if include_root:
            mask[:, 0] = True
        for i, par in enumerate(self.parents):
            if par >= 0:
                mask[i + off] |= mask[par + off]
        return mask
