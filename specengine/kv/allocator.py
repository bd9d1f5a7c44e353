"""Reference-counted KV block allocator: a free list and a count per block (vLLM PagedAttention).

``make_allocator`` returns the C++ ``specengine._C.BlockAllocator`` when the extension is built
and the pure-Python ``BlockAllocator`` below otherwise; both have the same API and errors.
"""

from __future__ import annotations

from specengine.ops.extension import ext


class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks-1`` and takes them back when unreferenced.

    Args:
        num_blocks: pool size (> 0), in blocks.

    Errors: ``allocate``/``allocate_n`` raise RuntimeError ("out of KV blocks") when the pool is
    short; ``incref``/``free`` of a block that is not allocated raise RuntimeError (double free);
    an id outside ``[0, num_blocks)`` or a negative ``n`` raise ValueError.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self._refcounts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pops 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_blocks(self) -> int:
        return len(self._refcounts)

    def allocate(self) -> int:
        """A free block id with refcount 1."""
        if not self._free:
            raise RuntimeError("out of KV blocks")
        block = self._free.pop()
        self._refcounts[block] = 1
        return block

    def allocate_n(self, n: int) -> list[int]:
        """``n`` block ids, or none at all when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"allocate_n: n must be >= 0, got {n}")
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self._free)} free")
        return [self.allocate() for _ in range(n)]

    def incref(self, block_id: int) -> None:
        self._check_live(block_id, "incref")
        self._refcounts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; the block returns to the free list at zero."""
        self._check_live(block_id, "free")
        self._refcounts[block_id] -= 1
        if self._refcounts[block_id] == 0:
            self._free.append(block_id)

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id, "refcount")
        return self._refcounts[block_id]

    def _check_id(self, block_id: int, op: str) -> None:
        if not 0 <= block_id < len(self._refcounts):
            raise ValueError(f"{op}: block id {block_id} out of range [0, {len(self._refcounts)})")

    def _check_live(self, block_id: int, op: str) -> None:
        self._check_id(block_id, op)
        if self._refcounts[block_id] == 0:
            raise RuntimeError(f"{op}: block {block_id} is not allocated (double free?)")

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, num_free={self.num_free})"


def make_allocator(num_blocks: int):
    """The C++ allocator when ``specengine._C`` is built, else the Python one (same API)."""
    mod = ext()
    return mod.BlockAllocator(num_blocks) if mod is not None else BlockAllocator(num_blocks)
