"""Engine configuration: sizes and limits chosen once when the engine starts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PREFIX_CACHE_POLICIES = ("reset", "keep_versioned")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"float32"``/``"float16"`` or a torch dtype -> torch dtype.

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {list(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {list(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class EngineConfig:
    """Engine limits.

    Attributes:
        max_model_len: longest sequence, prompt plus output (tokens).
        block_size: tokens per KV block.
        num_kv_blocks: KV pool size (blocks), derived from ``kv_cache_memory_bytes``.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens in one forward (prefill budget).
        enable_prefix_caching: reuse the KV of full blocks already computed for the same
            leading tokens (``kv/prefix_cache.py``).
        prefix_cache_policy: after a weight update, ``"reset"`` (forget every cached block,
            vLLM's behaviour) or ``"keep_versioned"`` (keep them, each found only by requests
            of the weight version that computed it: prime-rl's per-version salt).

    Raises:
        ValueError: an unknown ``prefix_cache_policy``.
    """

    max_model_len: int
    block_size: int = 16
    num_kv_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    prefix_cache_policy: str = "reset"

    def __post_init__(self) -> None:
        if self.prefix_cache_policy not in PREFIX_CACHE_POLICIES:
            raise ValueError(f"prefix_cache_policy={self.prefix_cache_policy!r}: use one of "
                             f"{PREFIX_CACHE_POLICIES}")
