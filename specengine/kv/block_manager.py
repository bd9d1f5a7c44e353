"""Block tables of sequences over the reference-counted block allocator (vLLM's PagedAttention).

A sequence's K/V for position ``p`` live in block ``block_table[p // block_size]`` at offset
``p % block_size``. The ``n`` samples of one prompt share the prompt's blocks (reference counts);
the first sample that writes into a shared block gets its own copy (copy-on-write).
"""

from __future__ import annotations

from collections.abc import Callable

from specengine.kv.allocator import make_allocator
from specengine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Gives sequences KV blocks and takes them back.

    Args:
        num_blocks: size of the pool (blocks).
        block_size: tokens per block.
        copy_block: ``copy_block(src, dst)`` copies one block's K/V in every layer (used for
            copy-on-write of a shared partial block).
    """

    def __init__(self, num_blocks: int, block_size: int, copy_block: Callable[[int, int], None]):
        self.block_size = block_size
        self.allocator = make_allocator(num_blocks)
        self.copy_block = copy_block

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_to_grow(self, seq: Sequence, num_new: int) -> int:
        """Blocks that ``grow(seq, num_new)`` would take from the pool."""
        first, end = seq.num_cached, seq.num_cached + num_new
        need = max(0, cdiv(end, self.block_size) - len(seq.block_table))
        i = first // self.block_size
        if num_new and i < len(seq.block_table) and self.allocator.refcount(seq.block_table[i]) > 1:
            need += 1  # copy-on-write of the shared block we will write into
        return need

    def allocate_shared(self, seqs: list[Sequence]) -> None:
        """Give all ``seqs`` (samples of one prompt, same tokens) one set of blocks for their
        tokens. Raises RuntimeError when the pool is short (check ``num_free`` first)."""
        blocks = self.allocator.allocate_n(cdiv(len(seqs[0]), self.block_size))
        for _ in seqs[1:]:
            for b in blocks:
                self.allocator.incref(b)
        for s in seqs:
            s.block_table = list(blocks)

    def grow(self, seq: Sequence, num_new: int) -> None:
        """Make positions ``num_cached .. num_cached+num_new-1`` of ``seq`` writable: add blocks
        and un-share the block written first if it is shared."""
        i = seq.num_cached // self.block_size
        if num_new and i < len(seq.block_table) and self.allocator.refcount(seq.block_table[i]) > 1:
            old = seq.block_table[i]
            new = self.allocator.allocate()
            self.copy_block(old, new)
            self.allocator.free(old)
            seq.block_table[i] = new
        need = cdiv(seq.num_cached + num_new, self.block_size) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.allocator.allocate_n(need))

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first ``num_tokens`` positions of ``seq``."""
        keep = cdiv(num_tokens, self.block_size)
        for b in seq.block_table[keep:]:
            self.allocator.free(b)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release all blocks of ``seq`` (shared blocks stay with the other holders)."""
        for b in seq.block_table:
            self.allocator.free(b)
        seq.block_table = []
        seq.num_cached = 0

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat cache slots of positions ``start .. end-1`` of ``seq``."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
