"""Draft strategy: the shape of the token tree drafted for one step.

"No speculation" is ``None`` (the module constant ``OFF``): a policy returns
``Strategy | None`` and ``None`` means one plain decode token per sequence. A ``Strategy`` always
drafts at least one token, so there is no depth-0 strategy to confuse with it.
"""

from __future__ import annotations

from dataclasses import dataclass

OFF = None  # the "no speculation" strategy


@dataclass(frozen=True)
class Strategy:
    """Draft depth, branching and verify budget (EAGLE-2 arXiv 2406.16858 names: d, k, m).

    Attributes:
        depth: draft depth d (>= 1): the longest root-to-leaf path has at most d tokens.
        topk: branching k (>= 1): children expanded per node; 1 is a chain.
        budget: verify budget m: the most draft nodes sent to the target (depth <= m).
            ``None`` means ``depth * topk`` (a chain: ``depth``).

    Raises:
        ValueError: a field out of range, naming the field.
    """

    depth: int
    topk: int = 1
    budget: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"Strategy.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.depth, int) or self.depth < 1:
            raise bad("depth", "must be an integer >= 1")
        if not isinstance(self.topk, int) or self.topk < 1:
            raise bad("topk", "must be an integer >= 1")
        if self.budget is None:
            object.__setattr__(self, "budget", self.depth * self.topk)
        if not isinstance(self.budget, int) or self.budget < self.depth:
            raise bad("budget", f"must be an integer >= depth={self.depth}")

    @property
    def is_chain(self) -> bool:
        """True when the tree is a single path (k = 1)."""
        return self.topk == 1

    @property
    def num_nodes(self) -> int:
        """Largest number of draft nodes this strategy can produce (m, capped by the full tree)."""
        full = sum(self.topk ** i for i in range(1, self.depth + 1))
        return min(self.budget, full)

    def __str__(self) -> str:
        if self.is_chain:
            return f"chain(d={self.depth})"
        return f"tree(d={self.depth},k={self.topk},m={self.budget})"
