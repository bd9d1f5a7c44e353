"""Small tensor ops used by the models; each uses the C++ extension when it can.

Every op has a pure-torch path (``*_torch``) that is the reference in tests. The C++ paths run
for CPU float32/bfloat16 tensors when ``specengine._C`` is built; anything else takes the torch
path. Threads: the C++ ops use ``torch.get_num_threads()`` threads (their own work-claiming
pool, see csrc/pool.h: a busy core delays a call by at most the chunks it already claimed).

Weights can be prepared once with ``prepack`` (bfloat16 on CPUs with AMX: the tile layout of
``csrc/linear_amx.cpp``); ``linear`` and ``linear_glu`` accept the result in place of a weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specengine._ext import ext

# linear() uses the C++ kernel up to this many rows (tokens) per dtype; above it torch's GEMM
# (oneDNN, AMX for bf16) is faster (measured with bench/bench_kernels.py on 2 cores). Rows that
# the C++ kernel computes are batch-invariant; raise these to 16 to get bit-exact rows for any
# M <= 16 at some cost in speed.
LINEAR_MAX_M = {torch.bfloat16: 4, torch.float32: 8}
# With a prepacked bfloat16 weight on an AMX CPU, up to this many rows go to the AMX kernel
# (memory-bound: about the cost of one row), more to torch. Every such row is batch-invariant.
AMX_MAX_M = 32

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


def amx_available() -> bool:
    """True when the extension is built and AMX-BF16 tiles are usable."""
    mod = ext()
    return mod is not None and mod.amx_available()


@dataclass(eq=False)
class PackedWeight:
    """A linear weight ``[N, K]`` plus its copy in the AMX tile layout (``packed``, None when
    AMX is not used for it). ``glu``: ``packed`` holds a fused gate_up weight ``[2I, K]`` laid
    out for ``linear_glu`` (``linear`` then uses the torch path). ``version`` records
    ``weight._version`` at packing time (staleness check).
    """

    weight: torch.Tensor
    packed: torch.Tensor | None
    glu: bool = False
    version: int = -1
    data_ptr: int = 0

    def is_current(self, weight: torch.Tensor) -> bool:
        """True while ``weight`` is the packed tensor, unmodified since packing."""
        return (weight is self.weight and weight.data_ptr() == self.data_ptr
                and _version(weight) == self.version)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def prepack(weight: torch.Tensor, glu: bool = False) -> PackedWeight:
    """Prepare ``weight`` ``[N, K]`` for ``linear`` (``glu=False``) or ``linear_glu``.

    bfloat16 CPU weights are repacked into AMX tiles when the CPU has AMX (one copy, kept next
    to the original, which the torch path still uses); anything else is kept as is. With
    ``glu`` and ``N // 2`` a multiple of 16 the tiles are laid out for the fused
    ``linear_glu`` epilogue (``PackedWeight.glu``); otherwise in the plain layout.
    """
    packed = None
    glu = glu and weight.dim() == 2 and weight.shape[0] % 32 == 0  # else: plain layout
    if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and amx_available()):
        packed = ext().pack_weight_amx(weight.detach(), glu)
    return PackedWeight(weight, packed, glu, _version(weight), weight.data_ptr())


def linear_torch(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _amx_rows(x: torch.Tensor, pw: PackedWeight) -> int:
    """Rows of x for the AMX kernel, or 0 when it does not apply."""
    if pw.packed is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not x.shape[-1]:
        return 0
    rows = x.numel() // x.shape[-1]
    return rows if 0 < rows <= AMX_MAX_M else 0


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` -> ``[..., N]``.

    With a ``PackedWeight`` (``prepack``) holding AMX tiles and at most ``AMX_MAX_M`` bfloat16
    rows, the AMX kernel runs (float32 accumulation, one rounding, bf16 written directly).
    On CPU with at most ``LINEAR_MAX_M[dtype]`` rows and a plain weight the C++ kernel reads the
    weights once for all rows (AVX-512 BF16 dot products for bfloat16), accumulates in float32
    and rounds once. Either way row ``i`` of the C++ result equals ``linear(x[i:i+1])`` bit for
    bit.
    """
    if isinstance(weight, PackedWeight):
        rows = _amx_rows(x, weight)
        if rows and not weight.glu:
            n = weight.weight.shape[0]
            y = ext().linear_amx(x.reshape(rows, x.shape[-1]), weight.packed, n, bias)
            return y.view(*x.shape[:-1], n)
        weight = weight.weight
    mod = _cpp(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (mod is None or rows == 0 or rows > LINEAR_MAX_M[x.dtype] or weight.dtype != x.dtype
            or not weight.is_contiguous()):
        return F.linear(x, weight, bias)
    y = mod.linear(x.reshape(rows, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_glu(x: torch.Tensor, gate_up: torch.Tensor | PackedWeight) -> torch.Tensor:
    """``silu_and_mul(linear(x, gate_up))``: SwiGLU with a fused gate_up weight ``[2I, K]``.

    With a ``PackedWeight(glu=True)`` and AMX rows, one kernel computes both halves and writes
    ``silu(gate) * up`` with the same roundings as the unfused ops (bit-identical to them).
    """
    if isinstance(gate_up, PackedWeight):
        rows = _amx_rows(x, gate_up)
        if rows and gate_up.glu:
            n = gate_up.weight.shape[0]
            y = ext().linear_amx(x.reshape(rows, x.shape[-1]), gate_up.packed, n, None, True)
            return y.view(*x.shape[:-1], n // 2)
        if gate_up.glu:
            gate_up = gate_up.weight
    return silu_and_mul(linear(x, gate_up))


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE ``x * cos + roll(x, D/2) * sin`` (``sin`` signed ``[-sin, sin]``),
    computed in the promoted dtype of the inputs, result in ``x.dtype``; a new tensor."""
    out = x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
    return out.to(x.dtype)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ``[T, H, D]`` in place (``x`` may be a strided view, e.g. the q/k heads of
    a fused qkv output); ``cos``/``sin`` ``[T, D]`` or ``[T, 1, D]``. float32 cos/sin on CPU use
    the C++ op (float32 math, one rounding); otherwise ``rope_torch``. Returns ``x``."""
    mod = _cpp(x)
    if (mod is not None and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and cos.device.type == "cpu" and x.dim() == 3 and x.stride(-1) == 1
            and not (x.requires_grad and torch.is_grad_enabled())):
        t, d = x.shape[0], x.shape[-1]
        c, s = cos.reshape(t, d), sin.reshape(t, d)
        if c.stride(-1) == 1 and s.stride(-1) == 1:
            mod.rope_(x, c, s)
            return x
    x.copy_(rope_torch(x, cos, sin))
    return x


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
