import random

import numpy as np
import pytest

from specengine.speculative.drafters.ngram import NgramIndex, TokenHistory
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree


def shape(tree):
    return tree.tokens, tree.parents


def test_longest_suffix_match_gives_a_chain():
    # last 3 tokens [1, 2, 3] occurred at the start, followed by 4, 1, 2
    tree = NgramIndex().propose([1, 2, 3, 4, 1, 2, 3], Strategy(depth=3))
    assert shape(tree) == ([4, 1, 2], [-1, 0, 1])
    assert type(tree) is DraftTree and tree.sources == ["ngram"] * 3  # deterministic
    # scored: one 3-token match (weight 3, one pseudo-match of weight 1) -> confidence 3/4
    assert np.exp(np.cumsum(tree.draft_logprobs)) == pytest.approx([0.75] * 3)
    # depth caps the chain; the continuation may end at the sequence's end
    assert shape(NgramIndex().propose([1, 2, 3, 4, 1, 2, 3], Strategy(depth=2))) == (
        [4, 1], [-1, 0])


def test_distinct_matches_become_branches_most_recent_first():
    seq = [5, 1, 2, 7, 8, 1, 2, 9, 6, 1, 2]
    tree = NgramIndex().propose(seq, Strategy(depth=2, topk=2))
    assert shape(tree) == ([9, 6, 7, 8], [-1, 0, -1, 2])
    # k = 1: only the most recent continuation
    assert shape(NgramIndex().propose(seq, Strategy(depth=2))) == ([9, 6], [-1, 0])


def test_common_prefixes_are_shared_and_budget_is_respected():
    seq = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    # continuations [3, 5, 1] (recent) and [3, 4, 1] share the 3
    tree = NgramIndex().propose(seq, Strategy(depth=3, topk=2))
    assert shape(tree) == ([3, 5, 1, 4, 1], [-1, 0, 1, 0, 3])
    assert tree.num_nodes == 5 and tree.max_depth == 3
    # scored by the share of match weight through each node: matches [1, 2] (n = 2) at both
    # earlier places plus one pseudo-match; both continue with 3, one each with 5 and 4
    from specengine.speculative.policy.calibration import confidence_list
    assert confidence_list(tree) == pytest.approx([4 / 5, 2 / 5, 2 / 5, 2 / 5, 2 / 5])
    for budget in (3, 4):
        tree = NgramIndex().propose(seq, Strategy(depth=3, topk=2, budget=budget))
        assert tree.num_nodes == budget
        assert shape(tree) == ([3, 5, 1, 4][:budget], [-1, 0, 1, 0][:budget])


def test_longer_matches_come_before_more_recent_shorter_ones():
    # [1, 2, 3] occurred once (-> 9); only [2, 3] occurred more recently (-> 4)
    seq = [7, 1, 2, 3, 9, 6, 2, 3, 4, 8, 1, 2, 3]
    assert shape(NgramIndex().propose(seq, Strategy(depth=1))) == ([9], [-1])
    assert shape(NgramIndex().propose(seq, Strategy(depth=1, topk=2))) == ([9, 4], [-1, -1])
    # with min_n = 3 the shorter match does not count
    tree = NgramIndex(min_n=3).propose(seq, Strategy(depth=1, topk=2))
    assert shape(tree) == ([9], [-1])


def test_extending_a_leaf_is_not_a_new_branch():
    # the most recent match's continuation is cut by the sequence end ([2, 1]); an older match
    # continues it to [2, 1, 2, 1], which a chain (k = 1) may take
    tree = NgramIndex(max_n=2).propose([1, 2, 1, 2, 1], Strategy(depth=4))
    assert shape(tree) == ([2, 1, 2, 1], [-1, 0, 1, 2])


def test_no_match_gives_none():
    p = NgramIndex()
    assert p.propose([1, 2, 3, 4], Strategy(depth=3)) is None
    assert p.propose([7], Strategy(depth=3)) is None
    assert p.propose([], Strategy(depth=3)) is None
    assert p.propose([1, 2, 1], None) is None  # strategy OFF
    assert NgramIndex(min_n=2).propose([1, 2, 3, 1], Strategy(depth=2)) is None
    assert shape(NgramIndex(min_n=1).propose([1, 2, 3, 1], Strategy(depth=2))) == (
        [2, 3], [-1, 0])


def test_arguments_are_validated():
    for kwargs, name in [({"min_n": 0}, "min_n"), ({"min_n": 3, "max_n": 2}, "max_n"),
                         ({"max_matches": 0}, "max_matches")]:
        with pytest.raises(ValueError, match=name):
            NgramIndex(**kwargs)


def reference_match_ends(seq, min_n, max_n):
    """Brute force: (match length capped at max_n, end) sorted longest then most recent."""
    last, found = len(seq) - 1, []
    for e in range(last):
        n = 0
        while n < max_n and e - n >= 0 and seq[e - n] == seq[last - n]:
            n += 1
        if n >= min_n:
            found.append((n, e))
    return [e for n, e in sorted(found, key=lambda t: (-t[0], -t[1]))]


def test_match_ends_equal_brute_force_on_random_sequences():
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        min_n, max_n = rng.choice([(1, 4), (2, 3), (1, 1), (3, 5)])
        p = NgramIndex(min_n, max_n, max_matches=1000)
        assert p.match_ends(seq) == reference_match_ends(seq, min_n, max_n), seq


def test_trees_are_valid_tries_within_the_strategy():
    rng = random.Random(1)
    p = NgramIndex()
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(2, 60))]
        s = Strategy(depth=rng.randrange(1, 6), topk=rng.randrange(1, 4))
        s = Strategy(s.depth, s.topk, rng.randrange(s.depth, s.budget + 1))
        tree = p.propose(seq, s)
        if tree is None:
            assert not p.match_ends(seq)
            continue
        leaves = sum(not tree.children(i) for i in range(tree.num_nodes))
        assert tree.num_nodes <= s.budget and tree.max_depth <= s.depth and leaves <= s.topk
        # every root-to-leaf path is a real continuation of an earlier match
        text = " " + " ".join(map(str, seq)) + " "
        for i in range(tree.num_nodes):
            path = [tree.tokens[j] for j in tree.path_to(i)]
            assert " " + " ".join(map(str, [seq[-1]] + path)) + " " in text


def test_token_history_follows_the_sequence():
    h = TokenHistory()
    seq = list(range(300))
    assert h.sync(seq).tolist() == seq
    seq += [1, 2, 3]
    assert h.sync(seq).tolist() == seq
    assert h.sync([9, 9]).tolist() == [9, 9]  # not an extension: rebuilt
    with pytest.raises(ValueError):
        h.sync([9, 9])[0] = 1  # read-only view
    # keyed proposals give the same trees as stateless ones as the sequence grows
    p, rng = NgramIndex(), random.Random(2)
    seq = [rng.randrange(5) for _ in range(50)]
    for _ in range(100):
        a, b = p.propose(seq, Strategy(3, 2), key="s"), p.propose(list(seq), Strategy(3, 2))
        assert (a is None and b is None) or shape(a) == shape(b)
        seq.append(rng.randrange(5))
    p.forget("s")
    assert not p._histories


class Tokens(list):
    """A token list that records how many tokens each slice of it takes (what a keyed
    ``propose`` converts to numpy)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.sliced: list[int] = []

    def __getitem__(self, i):
        out = super().__getitem__(i)
        if isinstance(i, slice):
            self.sliced.append(len(out))
        return out


def test_long_and_repetitive_sequences_are_drafted_with_bounded_python_work():
    """The per-call Python work does not grow with the sequence: a keyed sequence converts
    only its new tokens to numpy (the match itself is O(max_n * len) numpy), and a token
    repeated thousands of times has only max_matches match positions walked in Python.
    (Per-call times on long sequences: bench/bench_decisions.py.)"""
    rng = np.random.default_rng(0)
    seq = Tokens(rng.integers(0, 50, 8000).tolist())
    p = NgramIndex()
    p.propose(seq, Strategy(5, 3, 12), key=0)
    assert seq.sliced == [8000]
    for i in range(50):
        seq.append(i % 50)
        a = p.propose(seq, Strategy(5, 3, 12), key=0)
        b = p.propose(list(seq), Strategy(5, 3, 12))
        assert (a is None and b is None) or shape(a) == shape(b)
    assert seq.sliced == [8000] + [1] * 50
    # a token repeated thousands of times: max_matches bounds the Python work
    ends = p.match_ends([7] * 8000)
    assert ends == list(range(7998, 7998 - p.max_matches, -1))
    tree = p.propose([7] * 8000, Strategy(5, 3, 12))
    assert shape(tree) == ([7] * 5, [-1, 0, 1, 2, 3])
