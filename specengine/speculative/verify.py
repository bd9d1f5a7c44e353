"""Lossless verification of one draft tree against the target's distributions.

Row ``r`` of the target's output for a tree is the distribution of the token that follows
``[root, nodes...][r]``: row 0 follows the root (the last committed token), row ``1 + i`` follows
node ``i``. Walking from the root, each step either accepts one child (and moves to it) or ends
with a bonus token; the committed tokens are the accepted nodes' tokens plus the bonus, so every
verification commits at least one token.

- Greedy: accept the child equal to the argmax; output equals non-speculative greedy decoding.
- Sampling, deterministic children (top-k / n-gram, ``tree.sampled == False``): try children in
  order, accept child x with probability p(x) under the current residual, on rejection set
  p(x) = 0 and renormalise; after the last rejection draw the bonus from the residual.
- Sampling, sampled children (``tree.sampled == True``): multi-round rejection sampling
  (SpecInfer arXiv 2305.09781; Leviathan et al. 2023 / Chen et al. 2023 for one round): accept
  x with probability min(1, p(x) / q(x)); on rejection p = norm(max(0, p - q)). Children drawn
  without replacement (Sequoia arXiv 2402.12374) also drop x from q and renormalise it.
- At a leaf the bonus is drawn from the leaf's own row (nothing was rejected there).

Each way, the committed tokens are distributed exactly as plain sequential sampling from the
target rows. Every random draw comes from the request's generator, so seeds reproduce.
"""

from __future__ import annotations

import torch

from specengine.sampling import SamplingParams, process_logits
from specengine.speculative.tree import DraftTree


def _check(tree: DraftTree, rows: torch.Tensor, name: str) -> None:
    m = tree.num_nodes
    if rows.dim() != 2 or rows.shape[0] != m + 1:
        raise ValueError(f"{name} must be [m + 1 = {m + 1}, V], got {tuple(rows.shape)}")
    if m and max(tree.tokens) >= rows.shape[1]:
        raise ValueError(f"a draft token {max(tree.tokens)} is outside the vocabulary "
                         f"V={rows.shape[1]} of {name}")


def _uniform(generator: torch.Generator) -> float:
    return torch.rand((), generator=generator, dtype=torch.float64).item()


def _draw(p: torch.Tensor, generator: torch.Generator,
          fallback: torch.Tensor | None = None) -> int:
    """One token from unnormalised float64 ``p`` by inverse CDF (zero-mass tokens are never
    drawn; cheaper than ``torch.multinomial`` for one draw); from ``fallback`` when ``p`` has
    no mass (a residual that rounded to zero)."""
    cdf = p.cumsum(0)
    total = cdf[-1].item()
    if not total > 0:
        if fallback is not None:
            return _draw(fallback, generator)
        raise RuntimeError("cannot sample from a distribution with no mass")
    i = int(torch.searchsorted(cdf, _uniform(generator) * total, right=True))
    return i if i < p.numel() else int(p.nonzero().max())  # u * total rounded up to total


def _without(p: torch.Tensor, x: int) -> torch.Tensor:
    """``p`` with token ``x`` removed and renormalised (all zeros when nothing is left)."""
    p = p.clone()
    p[x] = 0.0
    total = p.sum()
    return p / total if total > 0 else p


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` for float64 p, q summing to 1; ``p`` itself when that is all zero
    (only by rounding: a rejection needs p(x) < q(x), hence mass of p - q elsewhere)."""
    r = (p - q).clamp_min_(0.0)
    total = r.sum()
    return r / total if total > 0 else p


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance: follow the child whose token is the target's argmax.

    Args:
        tree: the draft tree (its q is not used).
        target_logits: ``[m + 1, V]`` float, row 0 = after the root, row ``1 + i`` = after node
            i. Argmax ties resolve as ``torch.argmax`` does, like non-speculative sampling.

    Returns:
        ``(accepted, bonus)``: node indices along the accepted path (root excluded) and the
        argmax token at the node where the walk stopped.

    Raises:
        ValueError: wrong row count, or a draft token outside the vocabulary.
    """
    _check(tree, target_logits, "target_logits")
    best = target_logits.argmax(dim=-1).tolist()
    accepted: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        node = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if node is None:
            return accepted, want
        accepted.append(node)


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor,
                    generator: torch.Generator) -> tuple[list[int], int]:
    """Lossless stochastic acceptance over one tree (see the module docstring for the rules).

    Args:
        tree: the draft tree; ``tree.sampled`` picks rejection against q (``tree.draft_probs``)
            or in-order trial of deterministic children.
        target_probs: ``[m + 1, V]`` float32 probabilities, already processed exactly as plain
            sampling would (temperature, top-k, top-p, min-p, then softmax). Rows (and
            ``draft_probs`` rows) are renormalised in float64, so rounding does not bias.
        generator: the request's own ``torch.Generator`` (CPU); every draw comes from it.

    Returns:
        ``(accepted, bonus)``: node indices along the accepted path and the bonus token.

    Raises:
        ValueError: wrong row count, a draft token outside the vocabulary, or ``draft_probs``
            whose vocabulary differs from ``target_probs``'s.
        RuntimeError: a target row with no mass.

    Edge cases: q(x) = 0 for a drafted x accepts it iff p(x) > 0; a residual that rounds to
    all zeros falls back to the row it came from.
    """
    _check(tree, target_probs, "target_probs")
    if tree.sampled and tree.draft_probs.shape[1] != target_probs.shape[1]:
        raise ValueError(f"draft_probs has V={tree.draft_probs.shape[1]}, "
                         f"target_probs V={target_probs.shape[1]}")
    accepted: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1].double()
        kids = tree.children(node)
        if not kids:
            return accepted, _draw(p, generator)
        us = torch.rand(len(kids), generator=generator, dtype=torch.float64).tolist()
        nxt = None
        if tree.sampled:
            p = p / p.sum()
            q = tree.draft_probs[kids[0]].double()
            q = q / q.sum()
            for c, u in zip(kids, us):
                x = tree.tokens[c]
                if u * q[x].item() < p[x].item():
                    nxt = c
                    break
                p = _residual(p, q)
                if not tree.replacement:
                    q = _without(q, x)
            bonus_row = p
        else:  # siblings are distinct: the residual after rejecting x_1..x_j is p without them
            toks = [tree.tokens[c] for c in kids]
            left = p.sum().item()
            for c, u, px in zip(kids, us, p[toks].tolist()):
                if u * left < px:
                    nxt = c
                    break
                left -= px
            bonus_row = p.index_fill(0, torch.tensor(toks), 0.0)
        if nxt is None:
            return accepted, _draw(bonus_row, generator, fallback=p)
        accepted.append(nxt)
        node = nxt


def verify_coupled(tree: DraftTree, target_probs: torch.Tensor,
                   noise: torch.Tensor) -> tuple[list[int], int]:
    """Sampling acceptance coupled to plain sampling by shared noise (the exponential race /
    Gumbel-max trick, as in ``specengine.sampling``): the token the target samples after a node
    at depth ``d`` is ``argmax(p / E_d)``; accept the child carrying it, else stop with it as the
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
