"""The models' tensor ops over the C++ extension's CPU kernels, each with a torch fallback.

Ops: ``linear`` / ``linear_glu`` (plain or prepacked weights), ``rms_norm``, ``add_rms_norm``,
``silu_and_mul``, ``rope_``; thread control: ``kernel_threads``, ``packed_covers``.

Every op has a pure-torch path (``*_torch``; ``F.linear`` for ``linear``), the reference in
tests. The C++ paths run for CPU float32/bfloat16 tensors when ``specengine._C`` is built;
anything else takes the torch path. Threads: the C++ ops use ``torch.get_num_threads()`` threads
(their own work-claiming pool, see csrc/pool.h: a busy core delays a call by at most the chunks
it already claimed); inside ``kernel_threads`` (decode-sized engine steps) they keep that count
while torch runs on one thread, so torch's spinning OpenMP workers do not compete with them.

Weights can be prepared once with ``prepack`` (the tile layout of ``csrc/linear_amx.cpp`` for
bfloat16 on CPUs with AMX, else the 64-feature groups of ``csrc/linear_avx512.cpp`` on AVX-512
CPUs, the same groups for ``csrc/linear_avx2.cpp`` on AVX2 + FMA CPUs); ``linear`` and
``linear_glu`` accept the result in place of a weight.

Instruction set: the extension picks its kernels at run time from what the CPU has, capped by
the environment variable ``SPECENGINE_ISA`` (``generic``, ``avx2``, ``avx512`` or ``amx``; read
once at import) or ``set_isa`` (e.g. to test the AVX2 path on an AVX-512 machine, or the AVX-512
path on an AMX one); ``active_isa`` says which applies. The cap covers the packed linear, AMX,
the AVX-512 BF16 plain linear and the paged attention's AMX and AVX-512 paths; the
auto-vectorised norms / RoPE / SiLU clones are chosen at load.

On CUDA (no C++ kernels for these ops) ``linear`` and the norms run torch's kernels; with batch
invariance on, in calls of exactly ``CUDA_ROWS`` rows (``_cuda_rows``), since cuBLAS and torch's
reductions choose their kernel, and so a row's reduction order, by the call's shape.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specengine.ops.extension import ext
from specengine.ops.heap import in_huge_pages

# Batch invariance (on by default; ``set_batch_invariant`` / SPECENGINE_BATCH_INVARIANT=0 turn
# it off): every linear layer runs the extension's kernel for its weight whatever the number of
# rows, so a row's result never depends on how many rows share the call (Thinking Machines,
# "Defeating Nondeterminism in LLM Inference", 2025). Off, the row limits below send larger
# calls to torch's GEMM where that is faster, and a row's bits then change with the batch.
# linear() uses the plain C++ kernel (unpacked weight) up to this many rows per dtype; above it
# torch's GEMM is faster (batch invariance off). Rows the C++ kernels compute are
# batch-invariant.
LINEAR_MAX_M = {torch.bfloat16: 4, torch.float32: 8}
# With a prepacked weight, up to this many rows go to the packed kernel (AMX tiles, or the
# AVX-512 64-feature groups on CPUs without AMX); more go to torch. Measured with
# bench/bench_kernels.py on 2 cores (AMD EPYC, AVX-512 BF16): the AVX-512 kernel reads weights
# at ~40 GB/s up to 8 rows (torch ~20) and stays faster than torch at every row count measured;
# so decode, verify and prefill all take it and every row is batch-invariant.
AMX_MAX_M = 32
AVX512_MAX_M = 4096
# The AVX2 kernel (same packed weights) up to this many rows per dtype; more go to torch (with
# batch invariance off). Measured with ``bench/bench_kernels.py --isa avx2`` (torch capped to
# AVX2 too) on 2-core AMD EPYCs: bfloat16 3-4x faster than torch at every M in 1..16 and 3.5-8.6x
# at 32, 64 and 200 (torch has no AVX2 bf16 GEMM), so as many rows as the AVX-512 kernel;
# float32 (Zen 4, with the 6-row tile for 6+ rows) 1.6x at M=16, 1.2-1.3x at 64, 0.94-1.07x at
# 256 (MKL's GEMM catches up), so float32 stops at 64.
AVX2_MAX_M = {torch.bfloat16: 4096, torch.float32: 64}
# On CUDA with batch invariance on, linear layers and norms run over chunks of exactly this many
# rows (the last zero-padded): one shape, so one cuBLAS / reduction kernel for every call, and a
# row's bits no longer depend on how many rows share the step (Thinking Machines, 2025, fix the
# kernels' reduction strategy instead; padding to one shape is the same guarantee with torch's
# own kernels). A decode step of up to 128 rows reads each weight once, as one row would.
CUDA_ROWS = 128

ISAS = ("generic", "avx2", "avx512", "amx")  # instruction-set caps, lowest first
_batch_invariant = True  # see set_batch_invariant
_isa_epoch = 0  # bumped by set_isa: weights packed before are stale (PackedWeight.is_current)

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


def _hardware_isa(mod) -> str:
    isa = mod.cpu_isa()
    if isa.startswith("avx512"):
        return "amx" if mod.amx_supported() else "avx512"
    return isa


def set_isa(isa: str | None) -> str:
    """Cap the instruction set the extension's dispatch may use: ``"generic"`` (portable
    kernels only), ``"avx2"`` (AVX2 + FMA kernels, no AVX-512 / AMX), ``"avx512"`` (AVX-512 and
    AVX-512 BF16 kernels, no AMX tiles) or ``"amx"`` / ``None`` (everything the CPU has, the
    default). Weights packed before keep their kernel; pack them
    again (``prepack``) after changing the cap: until then they are not ``is_current`` and
    ``linear`` gives their rows to torch (a model repacks them on its next forward). Returns
    ``active_isa()``.

    Raises ValueError for any other name."""
    if isa is None:
        isa = "amx"
    if isa not in ISAS:
        raise ValueError(f"SPECENGINE_ISA / set_isa: unknown instruction set {isa!r}; "
                         f"expected one of {', '.join(ISAS)}")
    global _isa_epoch
    mod = ext()
    if mod is not None and mod.isa_cap() != ISAS.index(isa):
        mod.set_isa_cap(ISAS.index(isa))
        _isa_epoch += 1
    return active_isa()


def set_batch_invariant(on: bool) -> bool:
    """Turn batch invariance on (the default) or off for this process; returns the previous
    setting.

    On: every ``linear`` / ``linear_glu`` call with a prepacked weight runs the packed kernel,
    and one with a plain CPU weight the plain C++ kernel, for any number of rows: one
    reduction order per output element, so row ``i`` of the result equals
    ``linear(x[i:i+1])`` bit for bit whatever else is in the call. Together with the
    attention kernel's absolute-position KV chunks this makes a sequence's logits independent
    of the batch, prefill chunking, prefix cache and kernel thread count. Off: calls above the
    kernels' row limits (``AMX_MAX_M``, ``AVX512_MAX_M``, ``AVX2_MAX_M``, ``LINEAR_MAX_M``)
    go to torch's GEMM, faster for large prefills on some CPUs (see the README's
    "Exactness" section for measured costs), and results then depend on the batch.
    The environment variable ``SPECENGINE_BATCH_INVARIANT=0`` turns it off at import."""
    global _batch_invariant
    old, _batch_invariant = _batch_invariant, bool(on)
    return old


@contextlib.contextmanager
def batch_invariance(on: bool):
    """``set_batch_invariant(on)`` within the block, the previous setting after it."""
    old = set_batch_invariant(on)
    try:
        yield
    finally:
        set_batch_invariant(old)


def batch_invariant() -> bool:
    """Whether batch invariance is on (``set_batch_invariant``)."""
    return _batch_invariant


def active_isa() -> str:
    """The instruction set the dispatch uses now: the lower of the CPU's (``"amx"``,
    ``"avx512"``, ``"avx2"`` or ``"generic"``) and the cap; ``"generic"`` without the
    extension."""
    mod = ext()
    if mod is None:
        return "generic"
    hw = _hardware_isa(mod)
    hw_level = ISAS.index(hw) if hw in ISAS else 0
    return ISAS[min(hw_level, mod.isa_cap())]


def amx_available() -> bool:
    """True when the extension is built and AMX-BF16 tiles are usable."""
    mod = ext()
    return mod is not None and mod.amx_available()


def avx512_available(dtype: torch.dtype) -> bool:
    """True when the extension's AVX-512 packed linear runs for ``dtype`` on this CPU
    (bfloat16 needs AVX-512 BF16)."""
    mod = ext()
    return (mod is not None and dtype in _FLOATS
            and mod.avx512_linear_available(dtype == torch.bfloat16))


def avx2_available() -> bool:
    """True when the extension's AVX2 + FMA packed linear runs (CPU support, and the cap is
    ``avx2`` or the CPU lacks what the AVX-512 kernel needs)."""
    mod = ext()
    return mod is not None and mod.avx2_linear_available()


def _packed_kind(dtype: torch.dtype) -> str | None:
    """The packed kernel ``prepack`` picks for a CPU weight of ``dtype`` now."""
    if dtype not in _FLOATS or ext() is None:
        return None
    if dtype == torch.bfloat16 and amx_available():
        return "amx"
    if avx512_available(dtype):
        return "avx512"
    if avx2_available():
        return "avx2"
    return None


# PackedWeight.kind values in the extension's order: the ``kind`` index its one-call forwards
# take (``decoder_forward``, ``eagle_draft``).
PACKED_KINDS = ("amx", "avx512", "avx2")


@dataclass(eq=False)
class PackedWeight:
    """A linear weight ``[N, K]`` plus its copy in a kernel's layout.

    Attributes:
        weight: the original (the torch path uses it).
        packed: the copy, or None when no packed kernel applies.
        kind: ``"amx"`` (AMX tiles, bfloat16), ``"avx512"`` or ``"avx2"`` (64-feature groups,
            bfloat16 or float32) or ``None``.
        glu: ``packed`` holds a fused gate_up weight ``[2I, K]`` laid out for ``linear_glu``
            (``linear`` then uses the torch path).
        version, data_ptr: ``weight._version`` and address at packing time (staleness check).
        epoch: the ``set_isa`` epoch at packing time (a cap change makes the pack stale).
    """

    weight: torch.Tensor
    packed: torch.Tensor | None
    glu: bool = False
    version: int = -1
    data_ptr: int = 0
    kind: str | None = None
    epoch: int = 0

    def is_current(self, weight: torch.Tensor) -> bool:
        """True while ``weight`` is the packed tensor, unmodified since packing, and the
        instruction-set cap has not changed since."""
        return (weight is self.weight and weight.data_ptr() == self.data_ptr
                and _version(weight) == self.version and self.epoch == _isa_epoch)

    def rows_for(self, x: torch.Tensor) -> int:
        """Rows of ``x`` for the packed kernel, or 0 when it does not apply."""
        if (self.packed is None or x.dtype != self.weight.dtype or x.device.type != "cpu"
                or not x.shape[-1] or self.epoch != _isa_epoch):
            return 0
        rows = x.numel() // x.shape[-1]
        if _batch_invariant:
            return rows
        limit = (AMX_MAX_M if self.kind == "amx" else AVX512_MAX_M if self.kind == "avx512"
                 else AVX2_MAX_M[x.dtype])
        return rows if 0 < rows <= limit else 0


def _cuda_rows(fn, x: torch.Tensor, *args) -> torch.Tensor:
    """``fn(x, *args)`` for a CUDA ``x`` ``[..., K]`` (``fn`` maps ``[R, K]`` rows to
    ``[R, N]`` rows independently) computed over chunks of exactly ``CUDA_ROWS`` rows, the last
    zero-padded; result ``[..., N]``. Every call then has the same shape, so row ``i`` of the
    result equals ``fn`` of that row in any other call, bit for bit."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    flat = x.reshape(rows, k)
    pad = -rows % CUDA_ROWS if rows else CUDA_ROWS  # no rows: one padded call gives the width
    if pad:
        flat = F.pad(flat, (0, 0, 0, pad))
    if flat.shape[0] == CUDA_ROWS:  # decode-sized: one call
        out = fn(flat, *args)[:rows]
    else:
        out = torch.cat([fn(chunk, *args) for chunk in flat.split(CUDA_ROWS)])[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


def _on_cuda_invariant(x: torch.Tensor) -> bool:
    return _batch_invariant and x.is_cuda and x.dim() > 0


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _repack_avx512_(out: torch.Tensor, w: torch.Tensor, glu: bool) -> None:
    """Write ``w`` ``[N, K]`` into ``out`` in ``avx512_pack_weight``'s layout, in place (the
    torch twin of the C++ packing loop: one strided copy, no allocation). Layout: feature
    slot ``s`` of group ``g`` is row ``g*64 + s`` (``glu``: gate row ``g*32 + s`` for
    ``s < 32``, up row ``I + g*32 + s - 32``); float32 ``[G, K, 64]``, bfloat16
    ``[G, K/2, 64, 2]`` (pairs of K). Padding rows of ``out`` are left as they are (zeros).
    ``out`` must come from ``avx512_pack_weight`` of a weight of this shape and dtype; K must
    be even for bfloat16."""
    if w.dtype == torch.bfloat16:  # a pair of K is one 4-byte unit: move them as int32
        out, w = out.view(torch.int32).flatten(-2), w.view(torch.int32)
    N, K = w.shape  # (K: units of 4 bytes)
    if glu:
        G = N // 64
        out.view(G, K, 2, 32).copy_(w.view(2, G, 32, K).permute(1, 3, 0, 2))
        return
    full, rest = divmod(N, 64)
    out[:full].copy_(w[:full * 64].view(full, 64, K).permute(0, 2, 1))
    if rest:
        out[full, :, :rest].copy_(w[full * 64:].t())


def _repack_amx_(out: torch.Tensor, w: torch.Tensor, glu: bool) -> None:
    """Write bfloat16 ``w`` ``[N, K]`` (K even) into ``out`` in ``pack_weight_amx``'s tile
    layout, in place (the torch twin of ``amx_pack`` in csrc/linear_amx.cpp). Layout ``[P, Kb,
    2, 16, 32]``: pair ``p``, 32-wide K step ``kb``, tile ``t``, K pair ``kp``, feature ``n``
    and the two K elements of the pair; feature row ``p*32 + t*16 + n`` (``glu``: ``t*I +
    p*16 + n``), K element ``kb*32 + 2*kp + e``. A K pair is one 4-byte unit, moved as int32.
    Padding (rows past N, K past the last whole step) is left as it is (zeros)."""
    o = out.view(torch.int32).permute(0, 2, 4, 1, 3)  # [P, t, n, Kb, kp]
    u = w.view(torch.int32)  # [N, K/2]
    N, Kh = u.shape
    full_kb, k_rest = divmod(Kh, 16)

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:  # dst [..., Kb, 16], src [..., Kh]
        if full_kb:
            dst[..., :full_kb, :].copy_(src[..., :full_kb * 16].unflatten(-1, (full_kb, 16)))
        if k_rest:
            dst[..., full_kb, :k_rest].copy_(src[..., full_kb * 16:])

    if glu:
        P = N // 32
        put(o, u.view(2, P, 16, Kh).transpose(0, 1))
        return
    full, rest = divmod(N, 32)
    if full:
        put(o[:full], u[:full * 32].view(full, 2, 16, Kh))
    for t in range(2):
        rows = min(max(rest - 16 * t, 0), 16)
        if rows:
            put(o[full, t, :rows], u[full * 32 + 16 * t:full * 32 + 16 * t + rows])


def prepack(weight: torch.Tensor, glu: bool = False,
            reuse: PackedWeight | None = None) -> PackedWeight:
    """Prepare ``weight`` ``[N, K]`` for ``linear`` (``glu=False``) or ``linear_glu``.

    CPU weights are repacked, one copy kept next to the original (which the torch path still
    uses): bfloat16 into AMX tiles when the CPU has AMX, else (bfloat16 or float32) into the
    AVX-512 kernel's 64-feature groups when the CPU has AVX-512 (BF16 for bfloat16) or AVX2 +
    FMA (the AVX2 kernel reads the same layout); anything else is kept as is. The instruction
    set cap (``set_isa``) in force now decides. ``glu`` lays a fused gate_up weight out for
    the fused SwiGLU epilogue when ``N // 2`` is a multiple of 32 (``PackedWeight.glu``);
    otherwise the plain layout.

    ``reuse``: a stale ``PackedWeight`` of a weight with this shape and dtype (e.g. this one
    before an in-place weight update); its AVX-512 buffer is rewritten in place instead of
    allocating a new one (no fresh pages: several times faster for a whole model); AMX
    tiles too. The result is the same as without it.
    """
    packed, kind = None, None
    glu = glu and weight.dim() == 2 and weight.shape[0] % 64 == 0  # else: plain layout
    want = _packed_kind(weight.dtype) if weight.device.type == "cpu" else None
    if (reuse is not None and reuse.kind is not None and reuse.kind == want
            and reuse.packed is not None
            and reuse.glu == glu and weight.device.type == "cpu" and weight.is_contiguous()
            and reuse.weight.shape == weight.shape and reuse.weight.dtype == weight.dtype
            and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0)):
        # a copy packed lazily inside a forward (after sleep/wake) is an inference tensor:
        # rewrite it in inference mode, where in-place updates to it are allowed
        repack = _repack_amx_ if want == "amx" else _repack_avx512_
        with torch.no_grad(), torch.inference_mode(reuse.packed.is_inference()):
            repack(reuse.packed, weight.detach(), glu)
        return PackedWeight(weight, reuse.packed, glu, _version(weight), weight.data_ptr(),
                            want, _isa_epoch)
    if want is not None and weight.dim() == 2:
        w = weight.detach()
        if want == "amx":
            packed, kind = ext().pack_weight_amx(w, glu), "amx"
        else:  # avx512 and avx2 share the layout
            packed, kind = ext().pack_weight_avx512(w, glu), want
        packed = in_huge_pages(packed)  # streamed every step: 2 MiB pages (ops.heap)
    return PackedWeight(weight, packed, glu and packed is not None, _version(weight),
                        weight.data_ptr(), kind, _isa_epoch)


def _packed_linear(x: torch.Tensor, pw: PackedWeight, rows: int, bias, glu: bool = False,
                   out_f32: bool = False) -> torch.Tensor:
    n = pw.weight.shape[0]
    x2 = x.reshape(rows, x.shape[-1])
    if pw.kind == "amx":
        y = ext().linear_amx(x2, pw.packed, n, bias, glu, out_f32)
    elif pw.kind == "avx2":
        y = ext().linear_avx2(x2, pw.packed, n, bias, glu, out_f32)
    else:
        y = ext().linear_avx512(x2, pw.packed, n, bias, glu, out_f32)
    return y.view(*x.shape[:-1], n // 2 if glu else n)


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight,
           bias: torch.Tensor | None = None, out_f32: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias``; x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` -> ``[..., N]``
    in x's dtype (``out_f32``: float32, rounded once from the float32 accumulator when a packed
    kernel runs; used for logits).

    With a ``PackedWeight`` (``prepack``) the packed kernel runs: float32 accumulation in a
    fixed order, one rounding, so row ``i`` equals ``linear(x[i:i+1])`` bit for bit. With a
    plain CPU float32/bfloat16 weight the plain C++ kernel runs (same guarantee). With batch
    invariance off (``set_batch_invariant``), calls over ``AMX_MAX_M`` (AMX),
    ``AVX512_MAX_M`` (AVX-512), ``AVX2_MAX_M[dtype]`` (AVX2) or ``LINEAR_MAX_M[dtype]``
    (plain) rows go to torch instead; other devices and dtypes always do (on CUDA with
    batch invariance on, in ``CUDA_ROWS``-row calls: ``_cuda_rows``).
    """
    if isinstance(weight, PackedWeight):
        rows = weight.rows_for(x)
        if rows and not weight.glu:
            return _packed_linear(x, weight, rows, bias, out_f32=out_f32)
        weight = weight.weight
    if _on_cuda_invariant(x):
        y = _cuda_rows(F.linear, x, weight, bias)
        return y.float() if out_f32 else y
    mod = _cpp(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (mod is None or rows == 0 or weight.dtype != x.dtype or not weight.is_contiguous()
            or (rows > LINEAR_MAX_M[x.dtype] and not _batch_invariant)):
        y = F.linear(x, weight, bias)
    else:
        y = mod.linear(x.reshape(rows, x.shape[-1]), weight, bias).view(
            *x.shape[:-1], weight.shape[0])
    return y.float() if out_f32 else y


def linear_glu(x: torch.Tensor, gate_up: torch.Tensor | PackedWeight) -> torch.Tensor:
    """``silu_and_mul(linear(x, gate_up))``: SwiGLU with a fused gate_up weight ``[2I, K]``.

    With a ``PackedWeight(glu=True)`` and rows for its kernel, one kernel computes both halves
    and writes ``silu(gate) * up`` with the same roundings as the unfused ops (bit-identical
    to them).
    """
    if isinstance(gate_up, PackedWeight):
        rows = gate_up.rows_for(x)
        if rows and gate_up.glu:
            return _packed_linear(x, gate_up, rows, None, glu=True)
        if gate_up.glu:
            gate_up = gate_up.weight
    return silu_and_mul(linear(x, gate_up))


def packed_covers(rows: int) -> bool:
    """True when a forward of ``rows`` tokens runs all its linear layers in the extension's
    packed kernels on this CPU (so torch's own threads are not needed for it)."""
    if _packed_kind(torch.bfloat16) is None and _packed_kind(torch.float32) is None:
        return False
    if _batch_invariant:
        return True
    if amx_available():
        return rows <= AMX_MAX_M
    if avx512_available(torch.bfloat16):
        return rows <= AVX512_MAX_M
    return avx2_available() and rows <= min(AVX2_MAX_M.values())


@contextlib.contextmanager
def kernel_threads(active: bool = True, threads: int | None = None):
    """Within the block, torch runs on one thread and the extension's kernels on the threads
    torch had (its thread pool, ``csrc/pool.h``), or on ``threads`` (at most torch's count;
    ``specengine.ops.threads.ThreadTuner`` picks it), when ``active`` and the extension is built.
    Results do not depend on the count (the kernels split work over disjoint outputs).

    Why: after each parallel op torch's OpenMP workers spin for milliseconds; with as many
    threads as cores they take turns with the kernels' own threads (measured on 2 cores: a
    memory-bound linear at 15 instead of 30 GB/s). The engine wraps decode-sized steps in this,
    whose linear layers and attention all run in the kernels (``packed_covers``).
    """
    mod = ext()
    n = torch.get_num_threads()
    if not active or mod is None or n <= 1:
        yield
        return
    mod.set_pool_threads(n if threads is None else max(1, min(n, threads)))
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        mod.set_pool_threads(0)


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
    if _on_cuda_invariant(x):
        return _cuda_rows(rms_norm_torch, x, weight, eps)
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
    if _on_cuda_invariant(x):
        residual = x + residual
        return rms_norm(residual, weight, eps), residual
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


def _isa_from_env() -> None:
    import os
    isa = os.environ.get("SPECENGINE_ISA", "").strip().lower()
    if isa:
        set_isa(isa)
    inv = os.environ.get("SPECENGINE_BATCH_INVARIANT", "").strip().lower()
    if inv:
        if inv not in ("0", "1", "false", "true", "off", "on"):
            raise ValueError(f"SPECENGINE_BATCH_INVARIANT={inv!r}: use 1 (on, the default) "
                             "or 0 (off)")
        set_batch_invariant(inv in ("1", "true", "on"))


_isa_from_env()
