import pytest
import torch
from reference_verify import SampledTree
from trees import chain, from_paths, positions, tree_positions

from specengine.speculative.strategy import OFF, Strategy
from specengine.speculative.tree import DraftTree


def example():
    # root -> 10 (0) -> 12 (2) -> 14 (4)
    #      -> 11 (1) -> 13 (3)
    return DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 1, 2], [-0.1, -0.2, -0.3, -0.4, -0.5])


def test_structure():
    t = example()
    assert t.num_nodes == 5 and t.max_depth == 3
    assert t.depths == [1, 1, 2, 2, 3]
    assert t.children(-1) == [0, 1] and t.children(0) == [2] and t.children(4) == []
    assert t.path_to(4) == [0, 2, 4] and t.path_to(3) == [1, 3] and t.path_to(-1) == []
    empty = DraftTree([], [])
    assert empty.num_nodes == 0 and empty.max_depth == 0 and empty.children(-1) == []


def test_tree_mask_is_the_ancestor_relation():
    t = example()
    mask = t.tree_mask()
    assert mask.dtype == torch.bool and mask.shape == (5, 5)
    for i in range(5):
        for j in range(5):
            assert bool(mask[i, j]) == (j in t.path_to(i)), (i, j)
    full = t.tree_mask(include_root=True)
    assert full.shape == (6, 6)
    assert full[:, 0].all() and full[0, 1:].sum() == 0  # all see the root; the root sees itself
    assert torch.equal(full[1:, 1:], mask)


def test_positions():
    t = example()
    assert positions(t, 7) == [6, 7, 7, 8, 8, 9]
    assert tree_positions([t, None, chain([3])], [7, 4, 1]).tolist() == (
        [6, 7, 7, 8, 8, 9] + [3] + [0, 1])
    with pytest.raises(ValueError, match="context_len"):
        positions(t, 0)


def test_chain_and_from_paths():
    c = chain([5, 6, 7], [-1.0, -2.0, -3.0])
    assert c.parents == [-1, 0, 1] and c.depths == [1, 2, 3] and not isinstance(c, SampledTree)
    q = torch.full((2, 4), 0.25)
    s = SampledTree([1, 2], [-1, 0], draft_probs=q)  # the tests' tree of sampled children
    assert s.draft_probs is q and s.draft_logprobs == [0.0, 0.0]
    trie = from_paths([[1, 2, 3], [1, 2, 4], [5], [1, 6]])
    assert trie.tokens == [1, 2, 3, 4, 5, 6] and trie.parents == [-1, 0, 1, 1, -1, 0]
    assert trie.children(-1) == [0, 4] and trie.children(0) == [1, 5]


def test_validation_names_the_problem():
    cases = [
        (dict(tokens=[1, 2], parents=[-1]), "parents"),
        (dict(tokens=[1, 2], parents=[-1, 1]), "parents\\[1\\]=1"),
        (dict(tokens=[1, 2], parents=[-1, -2]), "parents\\[1\\]=-2"),
        (dict(tokens=[1], parents=[-1], draft_logprobs=[0.0, 0.0]), "draft_logprobs"),
        (dict(tokens=[-1], parents=[-1]), "tokens\\[0\\]"),
        (dict(tokens=[3, 3], parents=[-1, -1]), "sibling"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            DraftTree(**kwargs)
    for kwargs in [dict(tokens=[3], parents=[-1]),
                   dict(tokens=[3], parents=[-1], draft_probs=torch.ones(2, 4))]:
        with pytest.raises(ValueError, match="draft_probs"):
            SampledTree(**kwargs)
    with pytest.raises(TypeError, match="replacement"):  # sampled trees are test-side only
        DraftTree(tokens=[3], parents=[-1], replacement=True)
    # duplicate siblings are fine for i.i.d. sampled children; cousins may share tokens
    SampledTree([3, 3], [-1, -1], replacement=True, draft_probs=torch.ones(2, 4))
    DraftTree([3, 4, 5, 5], [-1, -1, 0, 1])


def test_strategy():
    s = Strategy(depth=4)
    assert s.topk == 1 and s.budget == 4 and s.is_chain and s.num_nodes == 4
    assert str(s) == "chain(d=4)"
    t = Strategy(depth=3, topk=2)
    assert t.budget == 6 and not t.is_chain and str(t) == "tree(d=3,k=2,m=6)"
    assert Strategy(depth=2, topk=2, budget=100).num_nodes == 6  # capped by the full tree
    assert OFF is None
    for kwargs, name in [({"depth": 0}, "depth"), ({"depth": -1}, "depth"),
                         ({"depth": 2, "topk": 0}, "topk"), ({"depth": 3, "budget": 2}, "budget"),
                         ({"depth": 1.5}, "depth")]:
        with pytest.raises(ValueError, match=f"Strategy.{name}"):
            Strategy(**kwargs)
    with pytest.raises(AttributeError):
        s.depth = 2  # frozen
    assert Strategy(3, 2) == Strategy(3, 2, 6) and len({Strategy(3, 2), Strategy(3, 2, 6)}) == 1


def test_child_with_finds_the_child_carrying_a_token():
    t = from_paths([[5, 6], [5, 7], [8]])  # root -> 5 -> {6, 7}; root -> 8
    assert [t.child_with(-1, 5), t.child_with(-1, 8), t.child_with(-1, 6)] == [0, 3, None]
    assert [t.child_with(0, 6), t.child_with(0, 7), t.child_with(0, 5)] == [1, 2, None]
    assert t.child_with(1, 6) is None  # a leaf
