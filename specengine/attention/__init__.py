"""Attention backends over the paged KV cache, and ``make_backend`` to pick one."""

from __future__ import annotations

import torch

from specengine.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "make_backend"]

BACKENDS = ("auto", "torch", "cpu", "cuda", "triton")


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """Attention backend ``name`` (``"auto"``: the fastest one available for ``device``: the
    C++ kernel on CPU; on GPU the CUDA kernel, else Triton, else the torch reference).

    Raises:
        ValueError: an unknown name. ImportError: a backend whose kernel is not available.
    """
    from specengine.attention.cpu import CpuAttention
    from specengine.attention.cuda import CudaAttention
    from specengine.attention.torch_ref import TorchAttention
    from specengine.attention.triton_backend import TritonAttention

    named = {"torch": TorchAttention, "cpu": CpuAttention, "cuda": CudaAttention,
             "triton": TritonAttention}
    if name != "auto":
        if name not in named:
            raise ValueError(f"attention_backend={name!r}: use one of {BACKENDS}")
        return named[name]()
    order = [CpuAttention] if device.type == "cpu" else [CudaAttention, TritonAttention]
    for cls in order:
        try:
            return cls()
        except ImportError:
            continue
    return TorchAttention()
