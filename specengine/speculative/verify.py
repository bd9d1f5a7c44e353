"""Lossless verification of one draft tree against the target's distributions.

Row ``r`` of the target's output for a tree is the distribution of the token that follows
``[root, nodes...][r]``: row 0 follows the root (the last committed token), row ``1 + i`` follows
node ``i``. Walking from the root, each step either accepts one child (and moves to it) or ends
with a bonus token; the committed tokens are the accepted nodes' tokens plus the bonus, so every
verification commits at least one token.

- ``verify_greedy``: accept the child equal to the row's argmax; the bonus is the argmax where
  the walk stops. Output equals non-speculative greedy decoding.
- ``verify_coupled`` (every sampled request): the target's sample at each position is fixed
  by the request's sampling noise (the exponential race / Gumbel-max trick of
  ``specengine.sampling.params``: ``argmax(p / E)`` with ``E ~ Exp(1)``, one noise row per output
  position); accept the child carrying that sample, else stop with it as the bonus. Every
  committed token is exactly the plain sample of its position, so output is token-identical
  to non-speculative sampling with the same seed; a deterministic child x is accepted with
  probability p(x), as the classic residual rule would (Leviathan et al. 2023, Chen et al.
  2023; trees: SpecInfer arXiv 2305.09781).
- ``verify``: picks one of the two from a request's ``SamplingParams``, processing the logits
  (temperature, top-k, top-p, min-p, softmax) exactly as plain sampling does.

The drafters' trees are deterministic (top-k / n-gram children, distinct siblings); the
rejection-sampling rules for trees drawn from the draft distribution live in
``tests/reference_verify.py`` as a reference for the statistical tests.
"""

from __future__ import annotations

import torch

from specengine.sampling.params import SamplingParams, process_logits
from specengine.speculative.tree import DraftTree


def _check(tree: DraftTree, rows: torch.Tensor, name: str) -> None:
    m = tree.num_nodes
    if rows.dim() != 2 or rows.shape[0] != m + 1:
        raise ValueError(f"{name} must be [m + 1 = {m + 1}, V], got {tuple(rows.shape)}")
    if m and max(tree.tokens) >= rows.shape[1]:
        raise ValueError(f"a draft token {max(tree.tokens)} is outside the vocabulary "
                         f"V={rows.shape[1]} of {name}")


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance: follow the child whose token is the target's argmax.

    Args:
        tree: the draft tree.
        target_logits: ``[m + 1, V]`` float, row 0 = after the root, row ``1 + i`` = after node
            i. Argmax ties resolve as ``torch.argmax`` does, like non-speculative sampling.

    Returns:
        ``(accepted, bonus)``: node indices along the accepted path (root excluded) and the
        argmax token at the node where the walk stopped.

    Raises:
        ValueError: wrong row count, or a draft token outside the vocabulary.
    """
    _check(tree, target_logits, "target_logits")
    return walk(tree, target_logits.argmax(dim=-1).tolist())


def walk(tree: DraftTree, best: list[int]) -> tuple[list[int], int]:
    """``verify_greedy``'s walk over given tokens: from the root, move to the child whose token
    is ``best[row]`` (row 0 = the root's, row ``1 + i`` = node i's) while there is one.

    Args:
        best: ``m + 1`` token ids, per row the target's token (the argmax, or for a sampled
            request its exponential-race draw).

    Returns:
        ``(accepted, bonus)`` as ``verify_greedy``.
    """
    accepted: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        node = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if node is None:
            return accepted, want
        accepted.append(node)


def verify_coupled(tree: DraftTree, target_probs: torch.Tensor,
                   noise: torch.Tensor) -> tuple[list[int], int]:
    """Sampling acceptance coupled to plain sampling by shared noise (the exponential race /
    Gumbel-max trick, as in ``specengine.sampling.params``): the token the target samples after a
    node at depth ``d`` is ``argmax(p / E_d)``; accept the child carrying it, else stop with it as
    the
    bonus. Every committed token is exactly the plain sample of its position, so the result is
    lossless and, for deterministic drafts, accepts child x with probability p(x) as the
    residual method does.

    Args:
        target_probs: ``[m + 1, V]`` float32 processed target probabilities (root row first).
        noise: ``[max_depth + 1, V]`` float32 ``Exp(1)`` noise, row ``d`` for the output
            position ``d`` tokens after the root's.

    Returns:
        ``(accepted, bonus)`` as ``verify_greedy``.
    """
    depths = torch.tensor([0] + tree.depths)
    return verify_greedy(tree, target_probs / noise[depths])


def verify(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
           noise: torch.Tensor | None = None) -> tuple[list[int], int]:
    """Verify with a request's sampling parameters: greedy, or ``process_logits`` + softmax on
    every row and then ``verify_coupled``.

    Args:
        target_logits: ``[m + 1, V]`` float32 raw logits (already masked for ``min_tokens``
            row by row: row r sits ``depth`` tokens further into the output).
        noise: ``[max_depth + 1, V]`` sampling noise (not needed when greedy).

    Returns:
        ``(accepted, bonus)`` as ``verify_greedy``.
    """
    if params.greedy:
        return verify_greedy(tree, target_logits)
    probs = torch.softmax(process_logits(target_logits, [params] * target_logits.shape[0]), -1)
    return verify_coupled(tree, probs, noise)


def committed_tokens(tree: DraftTree, accepted: list[int], bonus: int) -> list[int]:
    """Tokens to append to the sequence: the accepted nodes' tokens, then the bonus."""
    return [tree.tokens[i] for i in accepted] + [bonus]
