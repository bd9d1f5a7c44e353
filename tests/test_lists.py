"""``specengine.ops.lists``: tensors from Python lists equal ``torch.tensor``'s, and the flat
tree mask equals each tree's ``DraftTree.tree_mask`` at its rows."""

import random

import pytest
import torch

from specengine.ops.lists import ancestor_mask, int_tensor, padded_tensor
from specengine.speculative.tree import DraftTree


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_int_tensor_equals_torch_tensor(dtype):
    rng = random.Random(0)
    for values in ([], [7], [rng.randrange(0, 2 if dtype == torch.bool else 1 << 30)
                             for _ in range(500)], [[1, 0, 1], [0, 1, 1]]):
        if dtype == torch.bool:
            values = [[bool(v) for v in r] for r in values] if values and isinstance(
                values[0], list) else [bool(v) for v in values]
        got, want = int_tensor(values, dtype), torch.tensor(values, dtype=dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    with pytest.raises(OverflowError):
        int_tensor([1 << 40], torch.int32)


def _random_tree(rng: random.Random, m: int) -> DraftTree:
    parents = [rng.randrange(-1, i) for i in range(m)]
    return DraftTree(list(range(m)), parents)  # distinct tokens: siblings differ


def test_ancestor_mask_places_each_trees_mask_at_its_rows():
    rng = random.Random(1)
    trees = [_random_tree(rng, m) for m in (1, 5, 12, 3)]
    width = max(t.num_nodes for t in trees)
    rows, placed = 2, []  # a plain row first, then per tree its root row and its nodes
    for t in trees:
        placed.append((rows + 1, t))
        rows += 1 + t.num_nodes
    rows += 3  # plain rows at the end
    got = ancestor_mask([(r0, t.parents) for r0, t in placed], rows, width)
    want = torch.zeros(rows, width, dtype=torch.bool)
    for r0, t in placed:
        want[r0:r0 + t.num_nodes, :t.num_nodes] = t.tree_mask()
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert torch.equal(ancestor_mask([], 4, 0), torch.zeros(4, 0, dtype=torch.bool))


def test_padded_tensor_zero_pads_each_row_to_the_longest():
    got = padded_tensor([[3, 1], [], [7, 8, 9]], torch.int32)
    assert got.dtype == torch.int32
    assert torch.equal(got, torch.tensor([[3, 1, 0], [0, 0, 0], [7, 8, 9]], dtype=torch.int32))
    with pytest.raises(ValueError, match="no rows"):
        padded_tensor([])
