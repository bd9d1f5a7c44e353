"""Block allocator: the C++ one and the pure-Python fallback behave the same."""

import pytest

from specengine.kv.allocator import BlockAllocator, make_allocator
from specengine.ops.extension import ext

IMPLS = ["python", "cpp"]


def new(impl: str, n: int):
    if impl == "python":
        return BlockAllocator(n)
    if ext() is None:
        pytest.skip("specengine._C is not built")
    return ext().BlockAllocator(n)


@pytest.mark.parametrize("impl", IMPLS)
def test_allocate_all_then_out_of_blocks(impl):
    a = new(impl, 5)
    assert (a.num_blocks, a.num_free) == (5, 5)
    ids = [a.allocate() for _ in range(5)]
    assert ids == [0, 1, 2, 3, 4]
    assert a.num_free == 0
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        a.allocate()


@pytest.mark.parametrize("impl", IMPLS)
def test_allocate_n_is_all_or_nothing(impl):
    a = new(impl, 6)
    assert a.allocate_n(4) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        a.allocate_n(3)
    assert a.num_free == 2
    assert a.allocate_n(0) == []
    assert sorted(a.allocate_n(2)) == [4, 5]
    with pytest.raises(ValueError):
        a.allocate_n(-1)


@pytest.mark.parametrize("impl", IMPLS)
def test_refcounts_and_reuse(impl):
    a = new(impl, 3)
    b = a.allocate()
    a.incref(b)
    a.incref(b)
    assert a.refcount(b) == 3
    a.free(b)
    a.free(b)
    assert a.refcount(b) == 1 and a.num_free == 2
    a.free(b)
    assert a.refcount(b) == 0 and a.num_free == 3
    assert a.allocate() == b  # last freed is reused first
    assert a.refcount(b) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_double_free_and_bad_ids(impl):
    a = new(impl, 2)
    b = a.allocate()
    a.free(b)
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free(b)
    with pytest.raises(RuntimeError, match="not allocated"):
        a.incref(1)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="out of range"):
            a.free(bad)
        with pytest.raises(ValueError, match="out of range"):
            a.refcount(bad)
    assert a.num_free == 2


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_pool_size(impl):
    if impl == "cpp" and ext() is None:
        pytest.skip("specengine._C is not built")
    cls = BlockAllocator if impl == "python" else ext().BlockAllocator
    with pytest.raises(ValueError):
        cls(0)


def test_make_allocator_prefers_cpp():
    a = make_allocator(4)
    expected = BlockAllocator if ext() is None else ext().BlockAllocator
    assert type(a) is expected
    assert a.num_blocks == 4
