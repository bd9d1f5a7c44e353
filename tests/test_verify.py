"""Verification is lossless: speculative output is distributed exactly like plain sampling.

A tiny synthetic "model" over V=8 tokens: the target's logits are a fixed random function of
the previous two tokens; the draft is a different one. The first three generated tokens are
drawn (a) exactly (their joint distribution is computed in closed form) and (b) by drafting
trees and verifying them; a chi-square test compares the two, and deliberately broken
verifiers must fail the same test (the test has power).
"""

import math
import random

import pytest
import reference_verify
import torch
from reference_sampling import process_logits
from reference_verify import SampledTree, verify, verify_coupled, verify_greedy, verify_sampling
from trees import chain

from specengine.sampling.params import SamplingParams
from specengine.sampling.verify import committed_tokens
from specengine.speculative.tree import DraftTree

V = 8
PROMPT = (3, 5)
_g = torch.Generator().manual_seed(1234)
TARGET = torch.randn(V, V, V, generator=_g) * 1.5  # logits of the next token given (t-2, t-1)
DRAFT = 0.5 * TARGET + torch.randn(V, V, V, generator=_g)  # a correlated, different draft
Q = torch.softmax(DRAFT, -1)  # the draft is unfiltered: it proposes tokens the target excludes


def target_probs(temperature: float) -> torch.Tensor:
    """``[V, V, V]``: processed target distribution (T, top-p 0.9, top-k 5) given (t-2, t-1)."""
    params = SamplingParams(temperature=temperature, top_p=0.9, top_k=5)
    flat = process_logits(TARGET.view(-1, V), [params] * (V * V))
    return torch.softmax(flat, -1).view(V, V, V)


def exact_joint(P: torch.Tensor) -> torch.Tensor:
    """``[V, V, V]`` float64 probability of the first three generated tokens."""
    a, b = PROMPT
    P = P.double()
    return P[a, b][:, None, None] * P[b][:, :, None] * P


# python lists: drafting stays cheap so the test can afford many draws
QL = Q.tolist()
QCUM = Q.cumsum(-1).tolist()
QTOP = Q.argsort(-1, descending=True).tolist()


def draft_tree(seq: list[int], depth: int, topk: int, budget: int, mode: str,
               rng: random.Random) -> DraftTree:
    """Breadth-first tree; each node gets min(topk, budget left) children, so the shape never
    depends on drawn tokens. mode: "topk" (deterministic), "sample" (without replacement) or
    "replace" (i.i.d. draws)."""
    tokens, parents, ctx = [], [], []
    frontier = [(-1, seq[-2], seq[-1])]
    for _ in range(depth):
        nxt = []
        for node, a, b in frontier:
            q = QL[a][b]
            n = min(topk, budget - len(tokens))
            if mode == "topk":
                picks = QTOP[a][b][:n]
            elif mode == "replace":
                picks = rng.choices(range(V), cum_weights=QCUM[a][b], k=n)
            else:  # sequential draws without replacement
                picks, left = [], list(q)
                for _ in range(n):
                    picks.append(rng.choices(range(V), left)[0])
                    left[picks[-1]] = 0.0
            for t in picks:
                nxt.append((len(tokens), b, t))
                tokens.append(t)
                parents.append(node)
                ctx.append(a * V + b)
        frontier = nxt
    if mode == "topk":
        return DraftTree(tokens, parents)
    return SampledTree(tokens, parents, draft_probs=Q.view(-1, V)[torch.tensor(ctx)],
                       replacement=mode == "replace")


def node_rows(P: torch.Tensor, seq: list[int], tree: DraftTree) -> torch.Tensor:
    """``[m + 1, V]`` target rows for the root and every node."""
    last2 = [(seq[-2], seq[-1])]
    for i, par in enumerate(tree.parents):
        last2.append((last2[par + 1][1], tree.tokens[i]))
    return P.view(-1, V)[torch.tensor([a * V + b for a, b in last2])]


def speculative_counts(P, depth, topk, budget, mode, n, seed, verifier=verify_sampling):
    """Counts ``[V, V, V]`` of the first three tokens over n speculative generations."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for _ in range(n):
        seq = list(PROMPT)
        while len(seq) < len(PROMPT) + 3:
            tree = draft_tree(seq, depth, topk, budget, mode, rng)
            accepted, bonus = verifier(tree, node_rows(P, seq, tree), g)
            seq += committed_tokens(tree, accepted, bonus)
        a, b, c = seq[2:5]
        counts[(a * V + b) * V + c] += 1
    return counts.view(V, V, V)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at alpha = 1e-4); cells expected < 5 are pooled; a draw in
    a zero-probability cell gives an infinite statistic."""
    counts, probs = counts.flatten(), probs.flatten()
    n = float(counts.sum())
    if counts[probs == 0].sum() > 0:
        return math.inf, 0.0
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum().view(1)])
    exp = torch.cat([exp[big], exp[~big & (probs > 0)].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    z = 3.719  # one-sided normal quantile for 1e-4; Wilson-Hilferty chi-square quantile
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat, crit


CASES = [  # (depth, topk, budget, mode)
    (3, 1, 3, "topk"),      # deterministic chain
    (3, 1, 3, "sample"),    # sampled chain
    (2, 2, 6, "topk"),      # full binary tree, top-2 children
    (2, 4, 6, "sample"),    # partial tree (4 + 2 nodes), children drawn without replacement
    (2, 3, 7, "replace"),   # i.i.d. children, duplicates kept
]


@pytest.mark.parametrize("temperature", [0.6, 1.0])
@pytest.mark.parametrize("case", CASES, ids=[f"d{c[0]}k{c[1]}m{c[2]}-{c[3]}" for c in CASES])
def test_sampling_is_lossless(case, temperature):
    P = target_probs(temperature)
    seed = CASES.index(case) * 10 + int(temperature * 10)
    counts = speculative_counts(P, *case, n=10_000, seed=seed)
    stat, crit = chi_square(counts, exact_joint(P))
    assert stat < crit, (stat, crit)


# Each broken verifier must fail the very test above (same statistic and threshold, at most the
# same number of draws; at 10k draws the statistics were 2412, 174, 2121 and 1772 against
# critical values 91, 91, 51 and 51, so the cheap ones run 3k draws).
BROKEN = [
    # rejection without the residual: resample from p instead of norm(max(0, p - q))
    ("_residual", lambda p, q: p, (3, 1, 3, "sample"), 3_000),
    # children drawn without replacement, verified as if q were unchanged
    ("_without", lambda p, x: p, (2, 4, 6, "sample"), 10_000),
]


@pytest.mark.parametrize("name,broken,case,n", BROKEN, ids=["no-residual", "no-q-update"])
def test_broken_verifier_fails_the_test(monkeypatch, name, broken, case, n):
    monkeypatch.setattr(reference_verify, name, broken)
    P = target_probs(1.0)
    counts = speculative_counts(P, *case, n=n, seed=7)
    stat, crit = chi_square(counts, exact_joint(P))
    assert stat > crit, (stat, crit)


def walk(tree, probs, g, step):
    """A verifier skeleton for broken rules: ``step(tree, p, kids, g) -> (child | None, bonus)``
    at each node."""
    accepted, node = [], -1
    while True:
        kids = tree.children(node)
        p = probs[node + 1].double()
        if not kids:
            return accepted, int(torch.multinomial(p, 1, generator=g))
        child, bonus = step(tree, p, kids, g)
        if child is None:
            return accepted, bonus
        accepted.append(child)
        node = child


def no_residual_bonus(tree, p, kids, g):
    """Accept with min(1, p/q), but draw the bonus from plain p (the classic bug)."""
    x, q = tree.tokens[kids[0]], tree.draft_probs[kids[0]].double()
    if torch.rand((), generator=g).item() * q[x] < p[x]:
        return kids[0], None
    return None, int(torch.multinomial(p, 1, generator=g))


def no_renormalisation(tree, p, kids, g):
    """Try deterministic children with p(x) of the original row; rejected tokens stay in p."""
    for c in kids:
        if torch.rand((), generator=g).item() < p[tree.tokens[c]]:
            return c, None
    return None, int(torch.multinomial(p, 1, generator=g))


@pytest.mark.parametrize("step,case", [(no_residual_bonus, (3, 1, 3, "sample")),
                                       (no_renormalisation, (2, 2, 6, "topk"))],
                         ids=["no-residual-bonus", "no-renorm-topk"])
def test_broken_rule_fails_the_test(step, case):
    P = target_probs(0.6)
    broken = lambda tree, probs, g: walk(tree, probs, g, step)
    stat, crit = chi_square(speculative_counts(P, *case, 3_000, 3, broken), exact_joint(P))
    assert stat > crit, (stat, crit)


def test_same_seed_same_tokens():
    P = target_probs(1.0)
    a = speculative_counts(P, 2, 4, 6, "sample", 200, seed=11)
    b = speculative_counts(P, 2, 4, 6, "sample", 200, seed=11)
    c = speculative_counts(P, 2, 4, 6, "sample", 200, seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_edge_cases_zero_q_and_zero_residual():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    # q(x) = 0 for a drafted x with p(x) > 0: accepted (min(1, p/0) = 1)
    q = torch.tensor([[1.0, 0.0, 0.0]])
    tree = SampledTree([1], [-1], draft_probs=q)
    assert verify_sampling(tree, p, g)[0] == [0]
    # p == q: acceptance is certain, the (all-zero) residual is never needed
    tree = SampledTree([0], [-1], draft_probs=torch.tensor([[0.2, 0.3, 0.5]]))
    for _ in range(50):
        assert verify_sampling(tree, p[[1, 1]], g)[0] == [0]
    # a drafted token the target excludes is never accepted; the bonus is p's only token
    tree = chain([0, 2])
    for _ in range(50):
        assert verify_sampling(tree, torch.tensor([[0.0, 1.0, 0.0]] * 3), g) == ([], 1)
    # residual helper: all-zero residual falls back to p
    r = reference_verify._residual(torch.tensor([0.5, 0.5], dtype=torch.float64),
                                   torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert r.tolist() == [0.5, 0.5]


def test_shape_errors():
    tree = chain([1, 2])
    with pytest.raises(ValueError, match="m \\+ 1 = 3"):
        verify_greedy(tree, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_greedy(chain([9]), torch.zeros(2, 4))
    sampled = SampledTree([1], [-1], draft_probs=torch.full((1, 5), 0.2))
    with pytest.raises(ValueError, match="V=5"):
        verify_sampling(sampled, torch.full((2, 4), 0.25), torch.Generator())


def one_hot_logits(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return out


def test_greedy_follows_the_argmax_path():
    # root -> 4 (0) -> 7 (2) ; root -> 5 (1) -> 6 (3) ; 5 -> 2 (4)
    tree = DraftTree([4, 5, 7, 6, 2], [-1, -1, 0, 1, 1])
    # argmax after root = 5, after node1 (5) = 2, after node4 (2) = 9 (not drafted)
    logits = one_hot_logits([5, 0, 2, 0, 0, 9])
    assert verify_greedy(tree, logits) == ([1, 4], 9)
    assert committed_tokens(tree, [1, 4], 9) == [5, 2, 9]
    # argmax after root is not drafted: nothing accepted, bonus = that argmax
    assert verify_greedy(tree, one_hot_logits([3, 0, 0, 0, 0, 0])) == ([], 3)
    # verify() with greedy params dispatches to the greedy rule, no RNG needed
    assert verify(tree, logits, SamplingParams(temperature=0), torch.Generator()) == ([1, 4], 9)


def test_self_draft_accepts_everything_and_adds_the_bonus():
    seq = list(PROMPT)
    path = []
    for _ in range(4):  # the target's own argmax chain
        path.append(int(TARGET[seq[-2], seq[-1]].argmax()))
        seq.append(path[-1])
    tree = chain(path)
    logits = node_rows(TARGET, list(PROMPT), tree)
    accepted, bonus = verify_greedy(tree, logits)
    assert accepted == [0, 1, 2, 3] and bonus == int(TARGET[seq[-2], seq[-1]].argmax())
    # stochastic: a draft equal to a one-hot target is always accepted too
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), V).float()
    assert verify_sampling(tree, onehot, torch.Generator())[0] == [0, 1, 2, 3]


def test_greedy_speculation_equals_plain_greedy():
    plain = list(PROMPT)
    for _ in range(20):
        plain.append(int(TARGET[plain[-2], plain[-1]].argmax()))
    rng = random.Random(0)
    for depth, topk, budget, mode in CASES:
        seq, steps = list(PROMPT), 0
        while len(seq) < len(plain):
            tree = draft_tree(seq, depth, topk, budget, mode, rng)
            accepted, bonus = verify_greedy(tree, node_rows(TARGET, seq, tree))
            seq += committed_tokens(tree, accepted, bonus)
            steps += 1
        assert seq[:len(plain)] == plain
        assert steps < 20  # the draft is right sometimes


def coupled(tree, probs, g, shared=False):
    """``verify_coupled`` with fresh Exp(1) noise per position (one row shared if ``shared``)."""
    noise = torch.empty(tree.max_depth + 1, probs.shape[1]).exponential_(generator=g)
    if shared:
        noise = noise[:1].expand_as(noise)
    return verify_coupled(tree, probs.float(), noise)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["chain", "tree"])
def test_coupled_sampling_is_lossless(case):
    P = target_probs(1.0)
    counts = speculative_counts(P, *case, n=10_000, seed=3, verifier=coupled)
    stat, crit = chi_square(counts, exact_joint(P))
    assert stat < crit, (stat, crit)


def test_coupled_sampling_with_shared_noise_fails_the_test():
    P = target_probs(1.0)
    counts = speculative_counts(P, *CASES[0], n=10_000, seed=3,
                                verifier=lambda t, p, g: coupled(t, p, g, shared=True))
    stat, crit = chi_square(counts, exact_joint(P))
    assert stat > crit, (stat, crit)


@pytest.mark.parametrize("inference", [False, True])
def test_shared_rows_index_the_rows_in_place_and_copy_only_when_they_must(inference):
    from specengine.sampling.sampler import shared_rows

    torch.set_grad_enabled(True)
    with torch.inference_mode(inference):  # the engine's logits are inference tensors
        _check_shared_rows(shared_rows, torch.randn(9, 7))


def _check_shared_rows(shared_rows, logits):
    for case in ([logits[3:4], logits[0:1], logits[7:8]],  # out of order, with gaps
                 [logits[5:6]],
                 [logits[2:3], logits[2:3]],  # one row twice
                 [logits[0:1, :5], logits[5:6, :5]]):  # column slices at whole-row offsets
        x, rows = shared_rows(case)
        assert rows is not None and torch.equal(x[rows], torch.cat(case))
        assert x.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()  # no copy
    for case in ([logits[0:1], logits[3:4].clone()],  # a masked clone
                 [logits[0:2], logits[4:5]],  # a block of two rows
                 [logits[0:1, :5], logits[1:2, :5]]):  # column slices off the row grid
        x, rows = shared_rows(case)
        assert rows is None and torch.equal(x, torch.cat(case))
