"""Continuous batching: which sequences run this step, and who gets KV blocks.

Every step runs one decode token for each running sequence and, inside the token budget,
admits waiting requests (whole prompts, all ``n`` samples of a prompt together sharing the
prompt's blocks). When the KV pool cannot hold the next decode tokens, the most recently
admitted sequence is preempted: its blocks are freed and it is recomputed later from its
tokens so far (vLLM's recompute preemption). Outputs do not change; nothing crashes.

With prefix caching, an admitted prompt's leading blocks found in the cache are attached, not
recomputed: its prefill entry feeds only the tokens after them (always the last one). Waiting
requests with exactly the same tokens (verl and TRL send a prompt as ``n`` separate requests)
are admitted together with it as one group: one prefill, every block shared.
"""

from __future__ import annotations

from collections import deque

from specengine.engine.batch import BatchEntry
from specengine.engine.config import EngineConfig
from specengine.engine.sequence import Sequence, SequenceStatus
from specengine.kv.block_manager import BlockManager, cdiv


class Scheduler:
    """Queues of waiting and running sequences over a ``BlockManager``."""

    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[list[Sequence]] = deque()  # groups: samples of one prompt
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, group: list[Sequence]) -> None:
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: int = 0) -> list[BatchEntry]:
        """Pick this step's work; reserves KV blocks for it, with room for ``lookahead`` draft
        tokens after each decode token (released again after verification).

        Raises:
            RuntimeError: a single sequence does not fit the whole KV pool.
        """
        entries = self._schedule_decodes(1 + lookahead)
        budget = self.config.max_num_batched_tokens - len(entries)
        while self.waiting and len(self.running) + len(self.waiting[0]) <= self.config.max_num_seqs:
            group = self.waiting[0]
            leader = group[0]
            need = cdiv(len(leader), self.blocks.block_size)
            if need > self.blocks.num_blocks:
                raise RuntimeError(
                    f"request {leader.request_id} needs {need} KV blocks for {len(leader)} tokens "
                    f"but the pool has only {self.blocks.num_blocks}; raise kv_cache_memory_bytes")
            # leading blocks found in the prefix cache
            hit = [] if leader.full_prefill else self.blocks.match(leader)
            need = self.blocks.admission_cost(leader, hit)
            num_new = len(leader) - self.blocks.cached_tokens(leader, hit)
            # keep one free block per running sequence so admitted work can keep decoding
            if num_new > budget and entries:
                break
            if self.blocks.num_free - need < len(self.running) and self.running:
                break
            if self.blocks.num_free < need:
                break
            self.waiting.popleft()
            group = group + self._take_same(leader, self.config.max_num_seqs -
                                            len(self.running) - len(group))
            self.blocks.allocate_shared(group, hit)
            for s in group:
                s.status = SequenceStatus.RUNNING
                self.running.append(s)
            entries.append(BatchEntry(leader, num_new, list(group), is_prefill=True))
            budget -= num_new
        if not entries and self.waiting:
            leader = self.waiting[0][0]
            raise RuntimeError(f"request {leader.request_id} ({len(leader)} tokens) cannot be "
                               "scheduled: raise max_num_batched_tokens or kv_cache_memory_bytes")
        return entries

    def _take_same(self, leader: Sequence, room: int) -> list[Sequence]:
        """Remove from the waiting queue, and return, the groups whose tokens equal
        ``leader``'s, as long as they fit in ``room`` more sequences (prefix caching only)."""
        if self.blocks.cache is None or room <= 0 or leader.full_prefill:
            return []
        taken, keep = [], deque()
        for g in self.waiting:
            if (len(g) <= room and len(g[0]) == len(leader) and not g[0].full_prefill
                    and g[0].token_ids == leader.token_ids):
                taken += g
                room -= len(g)
            else:
                keep.append(g)
        if taken:
            self.waiting.clear()
            self.waiting.extend(keep)
        return taken

    def _schedule_decodes(self, num_slots: int) -> list[BatchEntry]:
        """One decode token per running sequence, in admission order; preempts from the back
        (most recently admitted first) while the pool cannot hold the next token."""
        entries: list[BatchEntry] = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted while making room for an earlier sequence
            self.blocks.commit(seq)  # blocks filled by the last step join the prefix cache
            n = min(num_slots, self.config.max_model_len - seq.num_cached)
            while self.blocks.blocks_to_grow(seq, n) > self.blocks.num_free:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                self.blocks.grow(seq, n)
                entries.append(BatchEntry(seq, 1, [seq]))
        return entries

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it (first) for recomputation."""
        self.running.remove(seq)
        self.blocks.commit(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft([seq])
        self.num_preemptions += 1
        seq.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.commit(seq)
        self.blocks.free(seq)
