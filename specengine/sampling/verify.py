"""The verifier the engine runs: the walk of one draft tree along the target's tokens.

Row ``r`` of the target's output for a tree is the distribution of the token that follows
``[root, nodes...][r]``: row 0 follows the root (the last committed token), row ``1 + i`` follows
node ``i``. ``Sampler.verify_trees`` (``specengine.sampling.sampler``) fixes the target's token
of every row, then ``walk`` goes down the tree from the root: each step accepts the child that
carries the row's token (and moves to it) or ends with that token as the bonus token; the
committed tokens (``committed_tokens``) are the accepted nodes' tokens plus the bonus, so every
verification commits at least one token (tree verification as in SpecInfer arXiv 2305.09781 and
Sequoia arXiv 2402.12374).

- greedy walk: the row's token is its argmax; output equals non-speculative greedy decoding.
- coupled acceptance (every sampled request): the row's token is the target's sample at that
  position, fixed by the request's sampling noise through the exponential race (the
  Gumbel-max trick, ``argmax(p / E)`` with ``E ~ Exp(1)``, one noise row per output position,
  ``specengine.sampling.params``); every committed token is exactly the plain sample of its
  position, so output is token-identical to non-speculative sampling with the same seed, and a
  deterministic child x is accepted with probability p(x), as the classic residual rule would
  (Leviathan et al. 2023, Chen et al. 2023).

The drafters' trees are deterministic (top-k / n-gram children, distinct siblings). The
per-tree references (``verify_greedy``, ``verify_coupled``, ``verify``) and the rejection rules
for trees drawn from the draft distribution live in ``tests/reference_verify.py``, next to the
statistical tests that check them.
"""

from __future__ import annotations

import torch

from specengine.speculative.tree import DraftTree


def check_tree_logits(num_seqs: int, trees: list[DraftTree], logits: list[torch.Tensor]) -> None:
    """Check the inputs of a step's verification: one sequence (``num_seqs`` of them) and one
    ``[1 + m, V]`` logits tensor per tree, every draft token inside the vocabulary.

    Raises:
        ValueError: the three counts differ, a tree's logits are not ``[1 + m, V]``, or a draft
            token is ``>= V``.
    """
    if not num_seqs == len(trees) == len(logits):
        raise ValueError(f"seqs, trees and logits must have one entry per tree, got "
                         f"{num_seqs}, {len(trees)} and {len(logits)}")
    for t, (tree, lg) in enumerate(zip(trees, logits)):
        if lg.dim() != 2 or lg.shape[0] != tree.num_nodes + 1:
            raise ValueError(f"logits[{t}] must be [m + 1 = {tree.num_nodes + 1}, V] for "
                             f"its tree, got {tuple(lg.shape)}")
        if tree.num_nodes and max(tree.tokens) >= lg.shape[1]:
            raise ValueError(f"tree {t}: a draft token {max(tree.tokens)} is outside the "
                             f"vocabulary V={lg.shape[1]}")


def walk(tree: DraftTree, best: list[int]) -> tuple[list[int], int]:
    """The walk over given tokens: from the root, move to the child whose token is
    ``best[row]`` (row 0 = the root's, row ``1 + i`` = node i's) while there is one.

    Args:
        tree: the draft tree.
        best: ``m + 1`` token ids, per row the target's token (the argmax, or for a sampled
            request its exponential-race draw).

    Returns:
        ``(accepted, bonus)``: node indices along the accepted path (root excluded) and the
        row's token at the node where the walk stopped (the bonus token).
    """
    accepted: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        node = tree.child_with(node, want)
        if node is None:
            return accepted, want
        accepted.append(node)


def committed_tokens(tree: DraftTree, accepted: list[int], bonus: int) -> list[int]:
    """Tokens to append to the sequence: the accepted nodes' tokens, then the bonus."""
    return [tree.tokens[i] for i in accepted] + [bonus]
