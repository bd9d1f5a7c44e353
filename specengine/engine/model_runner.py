"""Runs the target model on one step's batch: packs tokens, positions and block tables, owns
the paged KV cache, and returns the logits of the positions that sample a token."""

from __future__ import annotations

import torch

from specengine.attention import AttentionBackend, AttentionMetadata, make_backend
from specengine.engine.batch import BatchEntry
from specengine.kv.block_manager import BlockManager
from specengine.ops import kernels
from specengine.ops.heap import advise_huge_pages
from specengine.ops.lists import ancestor_mask, int_tensor, padded_tensor


class ModelRunner:
    """Owns the model and its KV cache ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

    Args:
        model: a ``LlamaForCausalLM`` (specengine.models.llama).
        num_blocks, block_size: KV pool geometry.
        backend: attention backend (default: the best one for the model's device).
    """

    def __init__(self, model, num_blocks: int, block_size: int,
                 backend: AttentionBackend | None = None):
        self.model = model
        self.last_slots: list[int] = []  # the last ``prepare``'s flat KV slot per token fed
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.block_size = block_size
        self.kv_cache = torch.empty(cfg.num_hidden_layers, 2, num_blocks, block_size,
                                    cfg.num_key_value_heads, cfg.head_dim,
                                    dtype=self.dtype, device=self.device)
        advise_huge_pages(self.kv_cache)  # read every step: 2 MiB pages (ops.heap)
        self.kv_cache.zero_()  # padding slots are read (masked)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.backend = backend or make_backend("auto", self.device)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K/V into block ``dst`` in every layer (copy-on-write)."""
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def read_kv(self, slots: list[int]) -> torch.Tensor:
        """K/V at flat cache ``slots`` (``block * block_size + offset``) in every layer, as a
        CPU copy ``[layers, 2, len(slots), kv_heads, head_dim]`` in the cache's dtype."""
        flat = self.kv_cache.view(self.kv_cache.shape[0], 2, -1, *self.kv_cache.shape[4:])
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return flat[:, :, idx].cpu()

    def write_kv(self, slots: list[int], kv: torch.Tensor) -> None:
        """Store ``kv`` ``[layers, 2, len(slots), kv_heads, head_dim]`` (``read_kv``'s layout,
        any device) at flat cache ``slots``.

        Raises:
            ValueError: ``kv``'s shape or dtype differs from the cache's.
        """
        c = self.kv_cache
        want = (c.shape[0], 2, len(slots), *c.shape[4:])
        if tuple(kv.shape) != want or kv.dtype != c.dtype:
            raise ValueError(f"KV of shape {tuple(kv.shape)} {kv.dtype} does not fit this "
                             f"cache: expected {want} {c.dtype}")
        flat = c.view(c.shape[0], 2, -1, *c.shape[4:])
        flat[:, :, torch.tensor(slots, dtype=torch.int64, device=self.device)] = kv.to(self.device)

    def prepare(self, entries: list[BatchEntry], blocks: BlockManager):
        """Flat inputs for ``entries``.

        A prefill entry feeds its uncached tokens; a decode entry its last token (the root) and,
        with a draft tree of m nodes, the nodes too: node i at position ``L-1+depth_i`` and cache
        position ``L+i``, attending to the committed context and its ancestors (tree mask).

        Returns:
            input_ids ``[T]`` int64, positions ``[T]`` int64, AttentionMetadata, and
            ``rows``: ``[R]`` int64 indices into ``T`` of the tokens whose logits are needed
            (the last token of a prefill; the root and every node of a decode entry).
        """
        ids, pos, slots, qseq, kv_lens, rows = [], [], [], [], [], []
        self.last_slots = slots  # filled below: the KV slot of each token fed, in order
        base, trees_at = [], []  # trees_at: (row of node 0, parents) per tree
        width = max((e.tree.num_nodes for e in entries if e.tree is not None), default=0)
        for row, e in enumerate(entries):
            s, t = e.seq, e.tree
            start = s.num_cached
            n = e.num_new + (t.num_nodes if t is not None else 0)
            slots.extend(blocks.slots(s, start, start + n))
            qseq.extend([row] * n)
            ids.extend(s.token_ids[start:start + e.num_new])
            if t is None:
                pos.extend(range(start, start + n))
                kv_lens.extend(range(start + 1, start + n + 1))
                base.extend(range(start + 1, start + n + 1))
                rows.append(len(ids) - 1)
                continue
            ctx = start + 1  # L: committed tokens including the root
            ids.extend(t.tokens)
            pos.append(start)
            pos.extend(start + d for d in t.depths)
            kv_lens.append(ctx)
            kv_lens.extend(range(ctx + 1, ctx + t.num_nodes + 1))
            base.extend([ctx] * n)
            trees_at.append((len(ids) - t.num_nodes, t.parents))
            rows.extend(range(len(ids) - n, len(ids)))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=int_tensor(slots, torch.int64, dev),
            block_tables=padded_tensor([e.seq.block_table for e in entries], torch.int32, dev),
            query_seq=int_tensor(qseq, torch.int32, dev),
            kv_lens=int_tensor(kv_lens, torch.int32, dev),
            max_kv_len=max(kv_lens))
        if width:
            meta.tree_base = int_tensor(base, torch.int32, dev)
            meta.tree_mask = ancestor_mask(trees_at, len(ids), width).to(dev)
        return (int_tensor(ids, torch.int64, dev), int_tensor(pos, torch.int64, dev), meta,
                int_tensor(rows, torch.int64, dev))

    @torch.inference_mode()
    def run(self, entries: list[BatchEntry], blocks: BlockManager):
        """Forward ``entries``, writing their K/V into the cache.

        Returns:
            ``(logits [R, vocab] float32, hidden [T, hidden_size])``: logits of the rows
            described in ``prepare`` (in entry order) and the last hidden state (after the final
            norm; the feature EAGLE drafters read) of every token fed, in ``prepare``'s order.
        """
        input_ids, positions, meta, rows = self.prepare(entries, blocks)
        with kernels.kernel_threads(kernels.packed_covers(len(input_ids))):
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            return self.model.compute_logits(hidden[rows]), hidden

    def move_kv(self, blocks: BlockManager, seq, src_positions: list[int],
                dst_positions: list[int]) -> None:
        """Copy K/V of ``seq`` from cache positions ``src`` to ``dst`` in every layer (KV
        commit of an accepted tree path)."""
        src = torch.tensor([blocks.slots(seq, p, p + 1)[0] for p in src_positions])
        dst = torch.tensor([blocks.slots(seq, p, p + 1)[0] for p in dst_positions])
        flat = self.kv_cache.view(self.kv_cache.shape[0], 2, -1, *self.kv_cache.shape[4:])
        flat[:, :, dst] = flat[:, :, src]
