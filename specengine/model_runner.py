"""Runs the target model on one step's batch: packs tokens, positions and block tables, owns
the paged KV cache, and returns the logits of the positions that sample a token."""

from __future__ import annotations

import torch

from specengine.attention.base import AttentionBackend, AttentionMetadata
from specengine.kv.block_manager import BlockManager
from specengine.scheduler import BatchEntry


def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block in all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def default_backend(device: torch.device) -> AttentionBackend:
    """The fastest attention backend available for ``device``."""
    if device.type == "cpu":
        try:
            from specengine.attention.cpu import CpuAttention
            return CpuAttention()
        except ImportError:
            pass
    from specengine.attention.torch_ref import TorchAttention
    return TorchAttention()


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
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.block_size = block_size
        self.kv_cache = torch.zeros(cfg.num_hidden_layers, 2, num_blocks, block_size,
                                    cfg.num_key_value_heads, cfg.head_dim,
                                    dtype=self.dtype, device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.backend = backend or default_backend(self.device)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K/V into block ``dst`` in every layer (copy-on-write)."""
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare(self, entries: list[BatchEntry], blocks: BlockManager):
        """Flat inputs for ``entries``.

        Returns:
            input_ids ``[T]`` int64, positions ``[T]`` int64, AttentionMetadata, and
            ``last_rows``: ``[len(entries)]`` int64 index of each entry's last token in ``T``.
        """
        ids, pos, slots, qseq, kv_lens, last = [], [], [], [], [], []
        for row, e in enumerate(entries):
            s = e.seq
            start, end = s.num_cached, s.num_cached + e.num_new
            ids.extend(s.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(blocks.slots(s, start, end))
            qseq.extend([row] * e.num_new)
            kv_lens.extend(range(start + 1, end + 1))
            last.append(len(ids) - 1)
        width = max(len(e.seq.block_table) for e in entries)
        tables = [e.seq.block_table + [0] * (width - len(e.seq.block_table)) for e in entries]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_seq=torch.tensor(qseq, dtype=torch.int32, device=dev),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
            max_kv_len=max(kv_lens))
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(pos, dtype=torch.int64, device=dev), meta,
                torch.tensor(last, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def run(self, entries: list[BatchEntry], blocks: BlockManager) -> torch.Tensor:
        """Forward ``entries``; writes their K/V and advances ``num_cached`` of every sequence
        that shares the entry's blocks.

        Returns:
            ``[len(entries), vocab]`` float32 logits of each entry's last token.
        """
        input_ids, positions, meta, last = self.prepare(entries, blocks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        logits = self.model.compute_logits(hidden[last])
        for e in entries:
            n = e.seq.num_cached + e.num_new
            for s in {id(x): x for x in [e.seq, *e.samplers]}.values():
                s.num_cached = n
        return logits
