"""Reference sampling verification by rejection, for the statistical tests of ``test_verify.py``.

The engine verifies every sampled request with ``specengine.speculative.verify.verify_coupled``
(shared noise) over deterministic trees; no engine path draws a tree from the draft
distribution. The classic rejection rules are kept here, next to the tests that check them
(and ``verify_coupled``) against the exact joint distribution:

- deterministic children (a plain ``DraftTree``: top-k / n-gram): try children in order,
  accept child x with probability p(x) under the current residual, on rejection set p(x) = 0
  and renormalise; after the last rejection draw the bonus from the residual.
- sampled children (``SampledTree``): multi-round rejection sampling (SpecInfer arXiv
  2305.09781; Leviathan et al. 2023 / Chen et al. 2023 for one round): accept x with
  probability min(1, p(x) / q(x)); on rejection p = norm(max(0, p - q)). Children drawn
  without replacement (Sequoia arXiv 2402.12374) also drop x from q and renormalise it.
- at a leaf the bonus is drawn from the leaf's own row (nothing was rejected there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specengine.speculative.tree import DraftTree
from specengine.speculative.verify import _check


@dataclass(eq=False)
class SampledTree(DraftTree):
    """A ``DraftTree`` whose children were drawn from the draft distribution q.

    Attributes:
        draft_probs: ``[m, V]`` float, row i = the distribution node i's token was drawn from
            (q at its parent, the same row for all siblings). Required.
        replacement: siblings are i.i.d. draws from q (duplicates allowed, SpecInfer) rather
            than draws without replacement (Sequoia; the default). Either way the children of
            a node must be its first c draws in draw order, with c chosen without looking at
            them: keeping draws by their value breaks losslessness.

    ``subset`` returns a plain ``DraftTree`` (the tests never cut sampled trees).

    Raises:
        ValueError: as ``DraftTree`` (duplicate siblings only without ``replacement``), or a
            missing / misshaped ``draft_probs``.
    """

    draft_probs: torch.Tensor | None = None
    replacement: bool = False

    @property
    def _distinct_siblings(self) -> bool:
        return not self.replacement

    def __post_init__(self) -> None:
        super().__post_init__()
        m, q = self.num_nodes, self.draft_probs
        if q is None or q.dim() != 2 or q.shape[0] != m or not q.is_floating_point():
            shape = None if q is None else tuple(q.shape)
            raise ValueError(f"SampledTree.draft_probs must be a float [m={m}, V] tensor, "
                             f"got {shape}")


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


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor,
                    generator: torch.Generator) -> tuple[list[int], int]:
    """Lossless stochastic acceptance over one tree (see the module docstring for the rules).

    Args:
        tree: a ``SampledTree`` (rejection against its ``draft_probs``) or a plain
            ``DraftTree`` (in-order trial of deterministic children).
        target_probs: ``[m + 1, V]`` float32 probabilities, already processed exactly as plain
            sampling would (temperature, top-k, top-p, min-p, then softmax). Rows (and
            ``draft_probs`` rows) are renormalised in float64, so rounding does not bias.
        generator: a CPU ``torch.Generator``; every draw comes from it.

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
    sampled = isinstance(tree, SampledTree)
    if sampled and tree.draft_probs.shape[1] != target_probs.shape[1]:
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
        if sampled:
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
