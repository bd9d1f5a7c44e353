"""Token trees the tests build, and the positions of their nodes.

Builders of ``specengine.speculative.tree.DraftTree`` that only the tests use (the drafters
build their trees node by node): ``chain`` (a single path), ``from_paths`` (a trie of token
paths); and ``positions`` / ``tree_positions``, the position rule the model runner applies
(``engine.model_runner``: the root at ``L - 1``, node ``i`` at ``L - 1 + depths[i]``).
"""

from __future__ import annotations

import torch

from specengine.speculative.tree import DraftTree


def chain(tokens: list[int], logprobs: list[float] | None = None) -> DraftTree:
    """A single path ``root -> tokens[0] -> tokens[1] ...`` (``logprobs``: its
    ``draft_logprobs``, zeros when None)."""
    return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)),
                     None if logprobs is None else list(logprobs))


def from_paths(paths: list[list[int]]) -> DraftTree:
    """A deterministic trie of token paths from the root; shared prefixes become one path.

    Children keep the order in which paths first reach them (earlier paths are tried first).
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for path in paths:
        par = -1
        for tok in path:
            node = index.get((par, tok))
            if node is None:
                node = index[(par, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(par)
            par = node
    return DraftTree(tokens, parents)


def positions(tree: DraftTree, context_len: int) -> list[int]:
    """Positions of ``[root, nodes...]`` for a sequence of ``context_len`` committed tokens
    (the root included): ``[L - 1, L - 1 + depths[0], ...]``.

    Raises:
        ValueError: ``context_len < 1``.
    """
    if context_len < 1:
        raise ValueError(f"context_len={context_len}: must be >= 1 (the root is a token)")
    return [context_len - 1] + [context_len - 1 + d for d in tree.depths]


def tree_positions(trees: list[DraftTree | None], context_lens: list[int]) -> torch.Tensor:
    """Positions of every sequence's ``[root, nodes...]`` packed back to back.

    Args:
        trees: one tree per sequence; ``None`` (no draft) contributes the root only.
        context_lens: committed tokens per sequence, the root included.

    Returns:
        ``[sum_i (m_i + 1)]`` int64.
    """
    out: list[int] = []
    for tree, length in zip(trees, context_lens, strict=True):
        out += positions(tree, length) if tree is not None else [length - 1]
    return torch.tensor(out, dtype=torch.int64)
