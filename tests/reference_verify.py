"""Reference verifiers of one draft tree, for the tests (``test_verify.py`` and others).

The engine verifies the trees of a step in ``Sampler.verify_trees``: each row's target token
(argmax, or the exponential race with the request's noise), then ``specengine.sampling.verify``'s
``walk``. The per-tree forms of that rule are kept here:

- ``verify_greedy``: accept the child equal to the row's argmax; the bonus is the argmax where
  the walk stops. Output equals non-speculative greedy decoding.
- ``verify_coupled``: the target's sample at each position is fixed by the sampling noise
  (``argmax(p / E)`` with ``E ~ Exp(1)``, one noise row per output position); accept the child
  carrying that sample, else stop with it as the bonus. Lossless, and a deterministic child x
  is accepted with probability p(x), as the classic residual rule would (Leviathan et al. 2023,
  Chen et al. 2023; trees: SpecInfer arXiv 2305.09781).
- ``verify``: one of the two from a request's ``SamplingParams``, processing the logits
  (temperature, top-k, top-p, min-p, softmax) as plain sampling does.
- ``verify_tree``: ``Sampler.verify_trees`` of one tree.

No engine path draws a tree from the draft distribution. The classic rejection rules
(``verify_sampling``) are kept here too, next to the tests that check them (and
``verify_coupled``) against the exact joint distribution:

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

from specengine.sampling.batched import process_rows, softmax_rows
from specengine.sampling.params import SamplingParams
from specengine.sampling.verify import walk
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


def verify_coupled(tree: DraftTree, target_probs: torch.Tensor,
                   noise: torch.Tensor) -> tuple[list[int], int]:
    """Sampling acceptance coupled to plain sampling by shared noise (the exponential race /
    Gumbel-max trick, as in ``specengine.sampling.params``): the token the target samples after a
    node at depth ``d`` is ``argmax(p / E_d)``; accept the child carrying it, else stop with it as
    the bonus. Every committed token is exactly the plain sample of its position, so the result
    is lossless and, for deterministic drafts, accepts child x with probability p(x) as the
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
    """Verify with a request's sampling parameters: greedy, or the processing of every row
    (``batched.process_rows``) + softmax and then ``verify_coupled``.

    Args:
        target_logits: ``[m + 1, V]`` float32 raw logits (already masked for ``min_tokens``
            row by row: row r sits ``depth`` tokens further into the output).
        noise: ``[max_depth + 1, V]`` sampling noise (not needed when greedy).

    Returns:
        ``(accepted, bonus)`` as ``verify_greedy``.
    """
    if params.greedy:
        return verify_greedy(tree, target_logits)
    probs = softmax_rows(process_rows(target_logits, [params] * target_logits.shape[0]))
    return verify_coupled(tree, probs, noise)


def verify_tree(sampler, seq, tree: DraftTree, logits: torch.Tensor):
    """``sampler.verify_trees`` (a ``specengine.sampling.sampler.Sampler``) of one tree drafted
    after ``seq``'s last token, with the target's ``logits`` ``[1 + m, V]`` float32.

    Returns:
        ``(accepted, tokens, entries)`` as ``Sampler.verify_trees`` gives per tree.
    """
    return sampler.verify_trees([seq], [tree], [logits])[0]


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
        try_children = _try_sampled if sampled else _try_deterministic
        p, nxt, bonus_row = try_children(tree, p, kids, us)
        if nxt is None:
            return accepted, _draw(bonus_row, generator, fallback=p)
        accepted.append(nxt)
        node = nxt


def _try_sampled(tree: SampledTree, p: torch.Tensor, kids: list[int], us: list[float]
                 ) -> tuple[torch.Tensor, int | None, torch.Tensor]:
    """Rejection against the draft rows of sampled ``kids`` (uniforms ``us``, one per child):
    ``(p normalised, accepted child or None, the row the bonus is drawn from)``."""
    p = p / p.sum()
    q = tree.draft_probs[kids[0]].double()
    q = q / q.sum()
    for c, u in zip(kids, us):
        x = tree.tokens[c]
        if u * q[x].item() < p[x].item():
            return p, c, p
        p = _residual(p, q)
        if not tree.replacement:
            q = _without(q, x)
    return p, None, p


def _try_deterministic(tree: DraftTree, p: torch.Tensor, kids: list[int], us: list[float]
                       ) -> tuple[torch.Tensor, int | None, torch.Tensor]:
    """In-order trial of deterministic ``kids``: siblings are distinct, so the residual after
    rejecting x_1..x_j is p without them. Returns ``(p, accepted child or None, bonus row)``."""
    toks = [tree.tokens[c] for c in kids]
    left = p.sum().item()
    for c, u, px in zip(kids, us, p[toks].tolist()):
        if u * left < px:
            return p, c, None
        left -= px
    return p, None, p.index_fill(0, torch.tensor(toks), 0.0)
