"""Small tensor ops used by the models; each uses the C++ extension when it can.

Every op has a pure-torch path (``*_torch``) that is the reference in tests. The C++ paths run
for CPU float32/bfloat16 tensors when ``specengine._C`` is built; anything else takes the torch
path. Threads: the C++ ops use ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specengine._ext import ext

# linear() uses the C++ kernel up to this many rows (tokens) per dtype; above it torch's GEMM
# (oneDNN, AMX for bf16) is faster (measured with bench/bench_kernels.py on 2 cores). Rows that
# the C++ kernel computes are batch-invariant; raise these to 16 to get bit-exact rows for any
# M <= 16 at some cost in speed.
LINEAR_MAX_M = {torch.bfloat16: 4, torch.float32: 8}

_FLOATS = (torch.float32, torch.bfloat16)


def _cpp(*tensors: torch.Tensor):
    """The extension when every tensor is a CPU float32/bfloat16 tensor, else None."""
    mod = ext()
    if mod is None:
        return None
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or t.dtype not in _FLOATS):
            return None
    return mod


def linear_torch(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` -> ``[..., N]``.

    On CPU with at most ``LINEAR_MAX_M[dtype]`` rows the C++ kernel reads the weights once for
    all rows (AVX-512 BF16 dot products for bfloat16), accumulates in float32 and rounds once;
    row ``i`` of its result equals ``linear(x[i:i+1])`` bit for bit.
    """
    mod = _cpp(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (mod is None or rows == 0 or rows > LINEAR_MAX_M[x.dtype] or weight.dtype != x.dtype
            or not weight.is_contiguous()):
        return F.linear(x, weight, bias)
    y = mod.linear(x.reshape(rows, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) over the last dim, computed in float32, result in
    ``x.dtype``; weight ``[D]``."""
    mod = _cpp(x, weight)
    if mod is None:
        return rms_norm_torch(x, weight, eps)
    return mod.rms_norm(x, weight, eps)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; the sum is rounded to
    ``x.dtype`` before normalising (as the unfused torch code does). Shapes ``[..., D]``."""
    mod = _cpp(x, residual, weight)
    if mod is None or residual.dtype != x.dtype or residual.shape != x.shape:
        return add_rms_norm_torch(x, residual, weight, eps)
    return mod.add_rms_norm(x, residual, weight, eps)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x ``[..., 2d]`` -> ``[..., d]`` (SwiGLU)."""
    mod = _cpp(x)
    if mod is None:
        return silu_and_mul_torch(x)
    return mod.silu_and_mul(x)
