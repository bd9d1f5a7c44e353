"""C++ CPU kernels against their torch references: paged attention (prefill, decode, tree
masks), write_kv, linear (accuracy and batch invariance), rms_norm, add_rms_norm, silu_and_mul.

The linear tests run once per instruction set this CPU supports (``kernels.set_isa``: generic,
avx2, avx512, amx), so the AVX2 kernels are tested on an AVX-512 machine and the AVX-512 ones on
an AMX machine too."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specengine.attention.base import AttentionBackend, AttentionMetadata
from specengine.attention.cpu import CpuAttention, paged_attention_masked_ref
from specengine.attention.torch_ref import paged_attention_ref
from specengine.ops import kernels
from specengine.ops.extension import ext
from specengine.ops.kernels import batch_invariance

needs_ext = pytest.mark.skipif(ext() is None, reason="specengine._C is not built "
                               "(pip install --no-build-isolation -e .)")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


def _supported_isas() -> list[str]:
    """The instruction sets the dispatch can be capped at on this CPU, lowest first."""
    if ext() is None:
        return ["generic"]
    prev = kernels.ISAS[ext().isa_cap()]
    try:
        top = kernels.set_isa(None)
    finally:
        kernels.set_isa(prev)
    return list(kernels.ISAS[:kernels.ISAS.index(top) + 1])


ISAS = _supported_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    """Caps the dispatch at one supported instruction set for the test, then restores it."""
    prev = kernels.ISAS[ext().isa_cap()] if ext() is not None else None
    assert kernels.set_isa(request.param) == request.param
    yield request.param
    kernels.set_isa(prev)


def paged_batch(seqs, block_size, kv_heads, group, head_dim, dtype, seed=0):
    """Random caches and metadata for ``seqs`` = [(context_len, num_new)]: each sequence owns
    shuffled blocks; its new tokens attend causally (kv_len = position + 1)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).int()
    max_blocks = max(blocks_per_seq) + 2
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)  # padding is never read
    start = 0
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = perm[start:start + nb]
        start += nb
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    query_seq, kv_lens = [], []
    for s, (c, n) in enumerate(seqs):
        query_seq += [s] * n
        kv_lens += list(range(c + 1, c + n + 1))
    T = len(kv_lens)
    query = torch.randn(T, kv_heads * group, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(T, dtype=torch.int64), block_tables=tables,
                             query_seq=torch.tensor(query_seq, dtype=torch.int32),
                             kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
                             max_kv_len=max(kv_lens))
    return query, k_cache, v_cache, meta


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_attention_matches_reference(block_size, group, dtype, isa):
    # prefill of 37, decode at 300, decode at 1, chunked prefill of 4 after 120, tiny prefill
    seqs = [(0, 37), (299, 1), (0, 1), (120, 4), (3, 2)]
    head_dim = {1: 128, 3: 40, 7: 64}[group]  # 40: vector body + scalar tail
    q, kc, vc, meta = paged_batch(seqs, block_size, 2, group, head_dim, dtype,
                                  seed=block_size * 10 + group)
    scale = head_dim ** -0.5
    out = CpuAttention().forward(q, kc, vc, meta, scale)
    ref = paged_attention_ref(q, kc, vc, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


@needs_ext
def test_attention_respects_thread_count():
    q, kc, vc, meta = paged_batch([(50, 6), (10, 1)], 16, 3, 3, 64, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext().paged_attention(q, kc, vc, meta.block_tables, meta.query_seq, meta.kv_lens,
                                    0.125)
    finally:
        torch.set_num_threads(before)
    many = ext().paged_attention(q, kc, vc, meta.block_tables, meta.query_seq, meta.kv_lens,
                                 0.125)
    assert torch.equal(one, many)


def tree_mask_of(parents):
    """[n, n] bool: node i sees its ancestors and itself (parents[i] = -1 for a root)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_mask(dtype):
    # seq 0: 45 committed tokens + a 7-node draft tree; seq 1: a plain decode row.
    parents = [-1, 0, 0, 1, 1, 2, 4]
    ctx, n = 45, len(parents)
    q, kc, vc, meta = paged_batch([(ctx, n), (70, 1)], 16, 2, 3, 64, dtype, seed=7)
    meta.kv_lens = torch.tensor([ctx + n] * n + [71], dtype=torch.int32)
    meta.tree_base = torch.tensor([ctx] * n + [71], dtype=torch.int32)
    mask = torch.zeros(n + 1, n, dtype=torch.bool)
    mask[:n] = tree_mask_of(parents)
    meta.tree_mask = mask
    out = CpuAttention().forward(q, kc, vc, meta, 0.125)
    ref = paged_attention_masked_ref(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    # Nodes 0 and 1 see a causal prefix (ctx + {0} / {0, 1}): same as plain attention, bit for
    # bit; node 5 (path 0 -> 2 -> 5) must not see nodes 1, 3, 4 that causal attention sees.
    causal = paged_batch([(ctx, n), (70, 1)], 16, 2, 3, 64, dtype, seed=7)[3]
    plain = CpuAttention().forward(q, kc, vc, causal, 0.125)
    assert torch.equal(out[:2], plain[:2]) and torch.equal(out[n], plain[n])
    assert not torch.allclose(out[5], plain[5], **TOL[dtype])


def test_masked_reference_with_chain_equals_causal():
    ctx, n = 20, 5
    q, kc, vc, meta = paged_batch([(ctx, n)], 8, 1, 2, 16, torch.float32, seed=3)
    ref = paged_attention_ref(q, kc, vc, meta, 0.25)
    meta.kv_lens = torch.full((n,), ctx + n, dtype=torch.int32)
    meta.tree_base = torch.full((n,), ctx, dtype=torch.int32)
    meta.tree_mask = tree_mask_of([-1, 0, 1, 2, 3])
    torch.testing.assert_close(paged_attention_masked_ref(q, kc, vc, meta, 0.25), ref)


@needs_ext
def test_attention_rejects_bad_input():
    q, kc, vc, meta = paged_batch([(10, 2)], 8, 2, 2, 16, torch.float32)
    C = ext()
    with pytest.raises(ValueError, match="kv_lens"):
        C.paged_attention(q, kc, vc, meta.block_tables, meta.query_seq,
                          torch.tensor([0, 3], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="block id"):
        C.paged_attention(q, kc, vc, torch.full_like(meta.block_tables, 99), meta.query_seq,
                          meta.kv_lens, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        C.paged_attention(q[:, :3], kc, vc, meta.block_tables, meta.query_seq, meta.kv_lens, 1.0)
    with pytest.raises(TypeError, match="int32"):
        C.paged_attention(q, kc, vc, meta.block_tables.long(), meta.query_seq, meta.kv_lens, 1.0)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_torch(dtype):
    shape = (6, 8, 3, 32)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(4)]
    key, value = torch.randn(5, 3, 32), torch.randn(5, 3, 32)  # float32 into a `dtype` cache
    slots = torch.tensor([0, 9, 47, 13, 30])
    CpuAttention().write_kv(caches[0], caches[1], key, value, slots)
    AttentionBackend().write_kv(caches[2], caches[3], key, value, slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="slot_mapping"):
        ext().write_kv(caches[0], caches[1], key, value, torch.tensor([0, 1, 2, 3, 48]))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 960, 576), (5, 13, 40), (16, 576, 1536), (7, 9, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_fp32_math(isa, dtype, M, N, K, bias):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    y = ext().linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == dtype and y.shape == (M, N)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    else:  # one rounding to bf16 of a float32 sum: within half an ulp = 2^-8 relative
        assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4).all()


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_batch_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 576, generator=g).to(dtype)
    w = torch.randn(200, 576, generator=g).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    rows = [ext().linear(x[i:i + 1], w, b) for i in range(16)]
    for M in range(1, 17):
        y = ext().linear(x[:M], w, b)
        for i in range(M):
            assert torch.equal(y[i:i + 1], rows[i]), (M, i)


@needs_ext
def test_ops_linear_dispatch():
    x = torch.randn(2, 2, 64).bfloat16()
    w = torch.randn(32, 64).bfloat16()
    assert torch.equal(kernels.linear(x, w), ext().linear(x.view(4, 64), w).view(2, 2, 32))
    big = torch.randn(kernels.LINEAR_MAX_M[torch.bfloat16] + 1, 64).bfloat16()
    assert kernels.batch_invariant()  # the default: the C++ kernel for every row count
    assert torch.equal(kernels.linear(big, w), ext().linear(big, w))
    with batch_invariance(False):  # off: torch's GEMM above the row limit
        assert torch.equal(kernels.linear(big, w), F.linear(big, w))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 576, generator=g).to(dtype)
    r = torch.randn(5, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), kernels.rms_norm_torch(x, w, 1e-5),
                               **TOL[dtype])
    normed, new_res = kernels.add_rms_norm(x, r, w, 1e-5)
    ref_normed, ref_res = kernels.add_rms_norm_torch(x, r, w, 1e-5)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])
    gu = torch.randn(3, 2, 2 * 1536, generator=g).to(dtype)
    out = kernels.silu_and_mul(gu)
    assert out.shape == (3, 2, 1536) and out.dtype == dtype
    torch.testing.assert_close(out, kernels.silu_and_mul_torch(gu), **TOL[dtype])


# ---- packed linear (AMX tiles or AVX-512 groups), RoPE, thread pool -----------------------
def packed_dtypes():
    """Dtypes for which ``kernels.prepack`` produces a packed kernel on this CPU (no cap)."""
    out = []
    if kernels.amx_available() or kernels.avx512_available(torch.bfloat16):
        out.append(torch.bfloat16)
    if kernels.avx512_available(torch.float32):
        out.append(torch.float32)
    return out


def packed_cases() -> list[tuple[str, torch.dtype]]:
    """(isa, dtype) pairs for which ``prepack`` produces a packed kernel under that cap."""
    if ext() is None:
        return []
    prev, out = kernels.ISAS[ext().isa_cap()], []
    try:
        for isa in ISAS:
            kernels.set_isa(isa)
            out += [(isa, dt) for dt in (torch.float32, torch.bfloat16)
                    if kernels.prepack(torch.zeros(64, 8, dtype=dt)).packed is not None]
    finally:
        kernels.set_isa(prev)
    return out


PACKED = packed_dtypes()
PACKED_CASES = packed_cases()
needs_packed = pytest.mark.skipif(not PACKED_CASES, reason="no AVX2, AVX-512 or AMX on this CPU")
packed_dtype = pytest.mark.parametrize(
    "isa,dtype", PACKED_CASES or [("avx512", torch.bfloat16)],
    ids=[f"{i}-{str(d)[6:]}" for i, d in PACKED_CASES] or ["none"], indirect=["isa"])


def max_rows(pw, dtype) -> int:
    if kernels.batch_invariant():
        return 1 << 30
    return {"amx": kernels.AMX_MAX_M, "avx512": kernels.AVX512_MAX_M,
            "avx2": kernels.AVX2_MAX_M[dtype]}[pw.kind]


@needs_packed
@packed_dtype
@pytest.mark.parametrize("N,K", [(960, 576), (576, 1536), (13, 40), (45, 33), (200, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_fp64_math(isa, dtype, N, K, bias):
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(70, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    pw = kernels.prepack(w)
    # the "amx" cap packs float32 weights for the AVX-512 kernel (AMX here is bfloat16 only)
    assert pw.packed is not None and pw.kind == ("avx512" if isa == "amx" and dtype ==
                                                 torch.float32 else isa)
    for M in (1, 2, 3, 5, 6, 7, 8, 9, 15, 16, 17, 32, 70):
        if M > max_rows(pw, dtype):
            continue
        y = kernels.linear(x[:M], pw, b)
        ref = F.linear(x[:M].double(), w.double(), None if b is None else b.double())
        assert y.dtype == dtype and y.shape == (M, N)
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
        else:  # float32 accumulation, one rounding to bf16: within half an ulp (2^-8 relative)
            assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4).all(), M
        f = kernels.linear(x[:M], pw, b, out_f32=True)  # logits: float32, at most one rounding
        assert f.dtype == torch.float32
        torch.testing.assert_close(f.double(), ref, atol=1e-4, rtol=2 ** -8)


@pytest.mark.skipif(not kernels.amx_available(), reason="no AMX tiles on this CPU (or capped)")
@pytest.mark.parametrize("N,K", [(200, 576), (45, 33)])
def test_amx_linear_strided_input_and_float32_output(N, K):
    """Over 16 rows the AMX kernel copies x into tile order itself: a row-strided view gives
    the same bits as a contiguous copy, and the float32 output (logits) is the accumulator the
    bf16 output rounds (one rounding, to nearest even, as torch's cast)."""
    g = torch.Generator().manual_seed(K)
    wide = torch.randn(40, K + 7, generator=g).to(torch.bfloat16)
    x = wide[:, 3:3 + K]  # stride(0) = K + 7
    pw = kernels.prepack(torch.randn(N, K, generator=g).to(torch.bfloat16))
    b = torch.randn(N, generator=g)
    for M in (1, 5, 16, 17, 40):
        y = ext().linear_amx(x[:M], pw.packed, N, b)
        assert torch.equal(y, ext().linear_amx(x[:M].contiguous(), pw.packed, N, b)), M
        f = ext().linear_amx(x[:M], pw.packed, N, b, False, True)
        assert f.dtype == torch.float32 and torch.equal(f.to(torch.bfloat16), y), M
    with pytest.raises(ValueError, match="glu"):
        ext().linear_amx(x, kernels.prepack(torch.randn(64, K).to(torch.bfloat16), glu=True)
                         .packed, 64, None, True, True)


@pytest.mark.skipif(not kernels.amx_available(), reason="no AMX tiles on this CPU (or capped)")
@pytest.mark.parametrize("N", [16384, 16400])
def test_amx_float32_output_of_4_mib_or_more_is_streamed_with_the_same_values(N):
    """Float32 outputs of 4 MiB or more (logits) are written with streaming stores, whole
    aligned lines only (a partial last group of columns is stored as before): every value is
    still the accumulator the bf16 output rounds, and no row or column is skipped."""
    g = torch.Generator().manual_seed(N)
    x = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    pw = kernels.prepack(torch.randn(N, 64, generator=g).to(torch.bfloat16))
    b = torch.randn(N, generator=g)
    f = ext().linear_amx(x, pw.packed, N, b, False, True)
    assert f.numel() * 4 >= 4 << 20 and f.shape == (64, N)
    assert torch.equal(f.to(torch.bfloat16), ext().linear_amx(x, pw.packed, N, b))
    assert torch.equal(f[5:6], ext().linear_amx(x[5:6], pw.packed, N, b, False, True))


@needs_packed
@packed_dtype
@pytest.mark.parametrize("N,K", [(200, 576), (45, 33)])
def test_packed_linear_is_batch_invariant(isa, dtype, N, K):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, K, generator=g).to(dtype)
    pw = kernels.prepack(torch.randn(N, K, generator=g).to(dtype))
    b = torch.randn(N, generator=g).to(dtype)
    rows = [kernels.linear(x[i:i + 1], pw, b) for i in range(40)]
    for M in range(1, min(max_rows(pw, dtype), 40) + 1):
        for start in (0, 40 - M):  # also rows at other offsets within the batch
            y = kernels.linear(x[start:start + M], pw, b)
            for i in range(M):
                assert torch.equal(y[i:i + 1], rows[start + i]), (M, start, i)
    if pw.kind == "amx":  # the C++ kernel itself beyond 32 rows (two row passes) too
        y = ext().linear_amx(x, pw.packed, N, b)
        assert all(torch.equal(y[i:i + 1], rows[i]) for i in range(40))
    if pw.kind == "avx2":  # the C++ kernel itself beyond AVX2_MAX_M rows too
        y = ext().linear_avx2(x, pw.packed, N, b)
        assert all(torch.equal(y[i:i + 1], rows[i]) for i in range(40))


@needs_packed
def test_packed_linear_thread_count_does_not_change_results():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 576, generator=g).bfloat16()
    pw = kernels.prepack(torch.randn(3072, 576, generator=g).bfloat16())
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear(x, pw)
    finally:
        torch.set_num_threads(before)
    for _ in range(3):
        assert torch.equal(kernels.linear(x, pw), one)


@needs_packed
@packed_dtype
def test_linear_glu_equals_unfused(isa, dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 576, generator=g).to(dtype)
    w = (torch.randn(2 * 1536, 576, generator=g) / 24).to(dtype)
    pw = kernels.prepack(w, glu=True)
    assert pw.glu
    fused = kernels.linear_glu(x, pw)
    assert fused.shape == (7, 1536)
    unfused = kernels.silu_and_mul(kernels.linear(x, kernels.prepack(w)))
    if dtype == torch.bfloat16:  # same roundings as the unfused ops
        assert torch.equal(fused, unfused)
    else:
        torch.testing.assert_close(fused, unfused, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused, kernels.silu_and_mul_torch(F.linear(x, w)), **TOL[dtype])


PACKED_BF16 = [isa for isa, dt in PACKED_CASES if dt == torch.bfloat16]


@pytest.mark.skipif(not PACKED_BF16, reason="no packed bf16 kernel on this CPU")
@pytest.mark.parametrize("isa", PACKED_BF16 or ["avx512"], indirect=True)
@pytest.mark.parametrize("rows", [1, 16, 17, 33, 64, 100])
def test_linear_glu_equals_unfused_bits_on_every_row_count_and_special_values(isa, rows):
    """The fused SwiGLU epilogue (on AMX spread over the next block's K steps, rounding with the
    conversion instruction where it agrees with c10's) gives the unfused ops' bits for every
    block layout, also where an intermediate is NaN, infinite or denormal: in row 0, features
    0..7 have gate -85 and up 1e-5, so silu(gate) * up is ~1e-40 (a float32 denormal, which the
    conversion instruction would flush to zero), features 8..15 gate 1 (normal values in the
    same vector). bfloat16 only: float32 rounds no intermediates."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    w = torch.randn(2 * 1536, 576, generator=g) / 24
    x[0] = 0.0
    x[0, 0] = 1.0
    w[:8, 0], w[8:16, 0], w[1536:1552, 0] = -85.0, 1.0, 1e-5
    if rows > 2:
        x[1, 3] = float("nan")
        x[2, :8] = 3e38  # gate and up overflow to +-inf
    x, w = x.to(dtype), w.to(dtype)
    pw = kernels.prepack(w, glu=True)
    fused = kernels.linear_glu(x, pw)
    unfused = kernels.silu_and_mul(kernels.linear(x, kernels.prepack(w)))
    assert torch.equal(fused.view(torch.int16), unfused.view(torch.int16))
    tiny = fused[0, :8].float()
    assert (tiny != 0).all() and (tiny.abs() < 1.18e-38).all()  # denormals kept, not flushed

def test_prepack_follows_weight_changes():
    from specengine.models.config import ModelConfig
    from specengine.models.llama import DecoderLayer

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32,
                               "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 1, "num_attention_heads": 4,
                               "num_key_value_heads": 2})
    layer = DecoderLayer(cfg, torch.bfloat16)
    layer.o_proj.copy_(torch.randn(64, 64))
    x = torch.randn(2, 64).bfloat16()
    first = layer.packed("o_proj")
    torch.testing.assert_close(kernels.linear(x, first), F.linear(x, layer.o_proj),
                               **TOL[torch.bfloat16])
    layer.o_proj.mul_(-1)  # in-place change: the packed copy must be rebuilt
    second = layer.packed("o_proj")
    assert second is not first
    torch.testing.assert_close(kernels.linear(x, second), F.linear(x, layer.o_proj),
                               **TOL[torch.bfloat16])


needs_avx2_and_avx512 = pytest.mark.skipif(
    not {"avx2", "avx512"} <= {i for i, _ in PACKED_CASES}, reason="needs AVX2 and AVX-512")


@needs_avx2_and_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("isa", ["avx512"], indirect=True)  # both kernels allowed
def test_avx2_kernel_equals_avx512_kernel_bit_for_bit(isa, dtype, glu):
    """Same packed weights, same accumulation order (bf16: VDPBF16PS adds the odd then the even
    exact product; no denormals in this data): equal results, on every M of 1..16, so an engine
    capped at AVX2 decodes as the AVX-512 one does."""
    if not kernels.avx512_available(dtype):
        pytest.skip(f"no AVX-512 kernel for {dtype}")
    g = torch.Generator().manual_seed(11)
    N, K = (256, 130) if glu else (200, 77 + (dtype == torch.bfloat16))
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = None if glu else torch.randn(N, generator=g)
    packed = ext().pack_weight_avx512(w, glu)
    for M in range(1, 17):
        x = torch.randn(M, K, generator=g).to(dtype)
        for out_f32 in (False, True):
            a2 = ext().linear_avx2(x, packed, N, b, glu, out_f32)
            a5 = ext().linear_avx512(x, packed, N, b, glu, out_f32)
            assert torch.equal(a2, a5), (M, out_f32)
    assert a2.shape == (16, N // 2 if glu else N)


def test_isa_cap_setter_and_environment():
    if ext() is None:
        assert kernels.active_isa() == "generic"
        return
    prev = kernels.ISAS[ext().isa_cap()]
    try:
        assert kernels.set_isa("generic") == "generic"
        assert kernels.prepack(torch.randn(64, 32)).packed is None
        assert not kernels.amx_available() and not kernels.avx512_available(torch.float32)
        assert not kernels.avx2_available()
        if "avx2" in ISAS:
            assert kernels.set_isa("avx2") == "avx2" and kernels.avx2_available()
            assert not kernels.avx512_available(torch.float32) and not kernels.amx_available()
            assert kernels.prepack(torch.randn(64, 32)).kind == "avx2"
            with pytest.raises(ValueError, match="lacks AVX-512"):  # the kernel checks the cap
                ext().linear_avx512(torch.randn(1, 32), ext().pack_weight_avx512(
                    torch.randn(64, 32), False), 64)
        assert kernels.set_isa(None) == ISAS[-1]
        with pytest.raises(ValueError, match="unknown instruction set 'sse4'"):
            kernels.set_isa("sse4")
    finally:
        kernels.set_isa(prev)
    env = dict(os.environ, SPECENGINE_ISA="generic")
    code = "from specengine.ops import kernels; print(kernels.active_isa())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["generic"]
    env["SPECENGINE_ISA"] = "avx3"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode != 0 and "unknown instruction set 'avx3'" in out.stderr


@pytest.mark.skipif(len(ISAS) < 2, reason="needs AVX2")
def test_weights_packed_before_a_cap_change_are_stale():
    """A pack made under one cap is not used under another (its kernel may be disallowed):
    ``linear`` gives its rows to torch and ``is_current`` is False, so a model repacks."""
    prev = kernels.ISAS[ext().isa_cap()]
    w, x = torch.randn(96, 40), torch.randn(3, 40)
    try:
        kernels.set_isa(ISAS[-1])
        pw = kernels.prepack(w)
        assert pw.packed is not None and pw.is_current(w) and pw.rows_for(x) == 3
        kernels.set_isa(ISAS[-2])
        assert not pw.is_current(w) and pw.rows_for(x) == 0
        torch.testing.assert_close(kernels.linear(x, pw), F.linear(x, w), **TOL[torch.float32])
        fresh = kernels.prepack(w, reuse=pw)
        assert fresh.is_current(w) and (fresh.packed is None) == (ISAS[-2] == "generic")
    finally:
        kernels.set_isa(prev)


@pytest.mark.skipif("avx2" not in ISAS or len(ISAS) < 3, reason="needs AVX2 and AVX-512")
def test_engine_greedy_output_same_with_avx2_cap(tiny_llama_dir):
    """Greedy decoding of a tiny float32 model with the dispatch capped at AVX2 (set before
    the model packs its weights) gives the default (AVX-512) path's tokens."""
    from specengine import LLM, SamplingParams

    def run(isa):
        prev = kernels.ISAS[ext().isa_cap()]
        kernels.set_isa(isa)
        try:
            llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory_bytes=8 << 20,
                      block_size=8)
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            outs = llm.generate([[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]], params, use_tqdm=False)
            kinds = {pw.kind for layer in llm.engine.runner.model.layers
                     for pw in layer._packed.values()}
            return [o.outputs[0].token_ids for o in outs], kinds
        finally:
            kernels.set_isa(prev)

    avx2_tokens, avx2_kinds = run("avx2")
    default_tokens, default_kinds = run(None)
    assert avx2_kinds == {"avx2"} and default_kinds == {"avx512"}
    assert all(len(t) == 16 for t in avx2_tokens)
    assert avx2_tokens == default_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 40])
def test_rope_matches_reference(dtype, D):
    from specengine.models.config import ModelConfig
    from specengine.models.llama import apply_rope, rope_cache

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32,
                               "hidden_size": 4 * D, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": D,
                               "max_position_embeddings": 512, "rope_theta": 1e5})
    cache = rope_cache(cfg)
    g = torch.Generator().manual_seed(D)
    T, nq, nkv = 7, 4, 2
    qkv = torch.randn(T, nq + 2 * nkv, D, generator=g).to(dtype)
    pos = torch.randint(0, 512, (T,), generator=g)
    cos, sin = cache[pos].unsqueeze(1).chunk(2, dim=-1)
    ref = apply_rope(qkv[:, :nq + nkv].double(), cos.double(), sin.double())
    # HF rotate-half form, independently
    x1, x2 = qkv[:, :nq + nkv, :D // 2].double(), qkv[:, :nq + nkv, D // 2:].double()
    c, s = cos[..., :D // 2].double(), sin[..., D // 2:].double()
    torch.testing.assert_close(ref, torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1))
    v_before = qkv[:, nq + nkv:].clone()
    out = kernels.rope_(qkv[:, :nq + nkv], cos, sin)  # strided view of qkv, in place
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, nq + nkv:], v_before)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -8)
    torch.testing.assert_close(qkv[:, :nq + nkv].double(), ref, **tol)


BF16_ISAS = [i for i, d in PACKED_CASES if d == torch.bfloat16]


@pytest.mark.skipif(not BF16_ISAS, reason="no packed bf16 kernel on this CPU")
@pytest.mark.parametrize("isa", BF16_ISAS or ["avx512"], indirect=True)
def test_bf16_model_rows_are_batch_invariant(isa, tiny_llama_dir):
    """With prepacked weights (AMX, AVX-512 BF16 or AVX2) a bf16 model's logits for a token do not
    depend on how many other tokens share the forward (decode of 1 vs verify of 1 + 8), bit for
    bit."""
    from specengine.attention.cpu import CpuAttention
    from specengine.models.loader import load_model

    model = load_model(tiny_llama_dir, dtype=torch.bfloat16).model
    c = model.config
    shape = (8, 4, c.num_key_value_heads, c.head_dim)
    prompt, draft = list(range(3, 20)), [5, 9, 2, 7, 7, 1, 30, 4, 11]

    def run(kv, toks, start):
        pos = torch.arange(start, start + len(toks))
        meta = AttentionMetadata(slot_mapping=pos, block_tables=torch.arange(8, dtype=torch.int32)
                                 .view(1, 8), query_seq=torch.zeros(len(toks), dtype=torch.int32),
                                 kv_lens=(pos + 1).to(torch.int32), max_kv_len=int(pos[-1]) + 1)
        return model.compute_logits(model(torch.tensor(toks), pos, kv, meta, CpuAttention()))

    kv = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
          for _ in range(c.num_hidden_layers)]
    run(kv, prompt, 0)
    kv2 = [(k.clone(), v.clone()) for k, v in kv]
    verify = run(kv, draft, len(prompt))
    decode = run(kv2, draft[:1], len(prompt))
    assert torch.equal(verify[:1], decode)
    # and the packed path agrees with the torch reference within bf16 tolerance
    ref = F.linear(model.norm.new_ones(1, c.hidden_size), model.lm_head).float()
    torch.testing.assert_close(model.compute_logits(model.norm.new_ones(1, c.hidden_size)), ref,
                               **TOL[torch.bfloat16])


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx", [5, 37, 300])
@pytest.mark.parametrize("parents", [[-1, 0, 0, 2, 1, 1, 3, 3, 4, 6],  # node 9: 0, 2, 3, 6, 9
                                     [-1, 0, 0, 2, 1]],  # 15 query rows: one AMX row tile
                         ids=["10-nodes", "5-nodes"])
def test_tree_node_equals_decoding_its_path(dtype, ctx, isa, parents):
    """A node off the first branch of a draft tree (its ancestors are not the slots right
    before it) gets bit for bit the attention output of decoding its path one token at a time,
    where the same keys sit next to each other: the kernel follows the visible keys as one
    compact sequence, never their slots."""
    g = torch.Generator().manual_seed(ctx)
    m, bs, kvh, group, D = len(parents), 16, 2, 3, 64
    nb = -(-(ctx + m) // bs) + 1
    k = torch.randn(nb, bs, kvh, D, generator=g).to(dtype)
    v = torch.randn(nb, bs, kvh, D, generator=g).to(dtype)
    q = torch.randn(m, kvh * group, D, generator=g).to(dtype)
    table = torch.arange(nb, dtype=torch.int32).view(1, nb)
    mask = tree_mask_of(parents)
    tree = ext().paged_attention(q, k, v, table, torch.zeros(m, dtype=torch.int32),
                                 torch.tensor([ctx + i + 1 for i in range(m)], dtype=torch.int32),
                                 0.125, torch.full((m,), ctx, dtype=torch.int32), mask)
    flat_k, flat_v = k.view(-1, kvh, D), v.view(-1, kvh, D)
    for node in range(m):
        path = [j for j in range(m) if mask[node, j]]  # ancestors and itself, in order
        k2, v2 = k.clone(), v.clone()
        for depth, j in enumerate(path):  # the path's keys moved next to the context
            k2.view(-1, kvh, D)[ctx + depth] = flat_k[ctx + j]
            v2.view(-1, kvh, D)[ctx + depth] = flat_v[ctx + j]
        alone = ext().paged_attention(q[node:node + 1], k2, v2, table,
                                      torch.zeros(1, dtype=torch.int32),
                                      torch.tensor([ctx + len(path)], dtype=torch.int32), 0.125)
        assert torch.equal(tree[node], alone[0]), node


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,D", [(3, 64), (7, 64), (1, 128), (2, 256), (2, 16), (5, 48)])
def test_attention_rows_equal_the_row_alone(group, D, isa, dtype):
    """Each of 40 prefill rows crossing the 256-key softmax step (context 230) and a decode
    row of another sequence equal, bit for bit, the same row computed alone (one query token,
    same keys), on whichever kernel the cap and dtype select (bf16: AMX tiles, AVX-512 BF16;
    float32: AVX-512F up to D = 128; generic): a row does not depend on the rows it shares a
    call with, nor on their number."""
    q, kc, vc, meta = paged_batch([(230, 40), (17, 1)], 16, 2, group, D, dtype,
                                  seed=D + group)
    args = (kc, vc, meta.block_tables)
    out = ext().paged_attention(q, *args, meta.query_seq, meta.kv_lens, D ** -0.5)
    ref = paged_attention_ref(q, kc, vc, meta, D ** -0.5)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for t in range(q.shape[0]):
        alone = ext().paged_attention(q[t:t + 1], *args, meta.query_seq[t:t + 1],
                                      meta.kv_lens[t:t + 1], D ** -0.5)
        assert torch.equal(out[t], alone[0]), t


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,D", [(3, 64), (1, 128), (2, 24)])
def test_attention_and_kv_write_read_views_of_a_fused_qkv_row(group, D, isa, dtype):
    """As the decoder layers call them: q, k and v are views of one [T, H + 2 KVH, D] qkv
    tensor (tokens (H + 2 KVH) D apart). The K/V write and the attention read the views in
    place, and give the bits of contiguous copies; a bf16 query gets a bf16 output (each kernel
    rounds its float32 rows itself, to nearest even)."""
    kvh = 2
    h = kvh * group
    q, kc, vc, meta = paged_batch([(230, 5), (17, 1), (40, 3)], 16, kvh, group, D, dtype,
                                  seed=D + group)
    T = q.shape[0]
    g = torch.Generator().manual_seed(D)
    qkv = torch.randn(T, h + 2 * kvh, D, generator=g).to(dtype)
    qkv[:, :h] = q
    qv, kv, vv = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
    assert not qv.is_contiguous()
    slots = torch.randperm(kc.shape[0] * kc.shape[1], generator=g)[:T]
    caches = [t.clone() for t in (kc, vc, kc, vc)]
    ext().write_kv(caches[0], caches[1], kv, vv, slots)
    ext().write_kv(caches[2], caches[3], kv.contiguous(), vv.contiguous(), slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    args = (caches[0], caches[1], meta.block_tables, meta.query_seq, meta.kv_lens, D ** -0.5)
    out = ext().paged_attention(qv, *args)
    assert out.dtype == dtype and out.shape == qv.shape
    assert torch.equal(out, ext().paged_attention(qv.contiguous(), *args))
    ref = paged_attention_ref(qv, caches[0], caches[1], meta, D ** -0.5)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,D", [(1, 8), (5, 24), (2, 72), (3, 120)])
def test_attention_head_sizes_of_the_avx2_path(group, D, isa, dtype):
    """Head sizes only the AVX2 path (head_dim % 8 == 0, <= 128) or the portable loop take on
    an AVX-512 CPU, down to one 8-wide chunk: the reference's values, and each row (a prefill
    crossing several 8-key tiles, a decode row of another sequence) equal to the row alone."""
    q, kc, vc, meta = paged_batch([(37, 12), (5, 1)], 16, 2, group, D, dtype, seed=D + group)
    args = (kc, vc, meta.block_tables)
    out = ext().paged_attention(q, *args, meta.query_seq, meta.kv_lens, D ** -0.5)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, meta, D ** -0.5),
                               **TOL[dtype])
    for t in range(q.shape[0]):
        alone = ext().paged_attention(q[t:t + 1], *args, meta.query_seq[t:t + 1],
                                      meta.kv_lens[t:t + 1], D ** -0.5)
        assert torch.equal(out[t], alone[0]), t


@needs_packed
@packed_dtype
@pytest.mark.parametrize("bias", [False, True])
def test_decoder_layers_in_one_call_equal_the_layer_loop(isa, dtype, bias, monkeypatch):
    """``LlamaForCausalLM``'s layers as one extension call (``csrc/decoder_forward.cpp``) give
    the Python layer loop's hidden states and KV caches bit for bit: a packed prefill of two
    sequences, then a decode token beside a draft tree (root and two siblings, tree mask)."""
    from specengine.models.config import ModelConfig
    from specengine.models.llama import LlamaForCausalLM
    from specengine.models.loader import random_hf_state_dict

    config = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 128,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attention_bias": bias})
    model = LlamaForCausalLM(config, dtype)
    model.load_weights(random_hf_state_dict(config, seed=3).items())
    bs, width = 4, 6
    shape = (12, bs, 2, 32)
    tables = torch.randperm(12, generator=torch.Generator().manual_seed(1)).int().view(2, width)

    def meta_for(seq, pos, tree=None):
        seq_t, pos_t = torch.tensor(seq, dtype=torch.int32), torch.tensor(pos)
        slots = tables[seq_t.long(), pos_t // bs].long() * bs + pos_t % bs
        base, mask = (None, None) if tree is None else tree
        return AttentionMetadata(slot_mapping=slots, block_tables=tables, query_seq=seq_t,
                                 kv_lens=(pos_t + 1).int(), max_kv_len=int(pos_t.max()) + 1,
                                 tree_base=base, tree_mask=mask)

    # step 1: prefill 9 + 5 tokens; step 2: seq 0 decodes at 9, seq 1 verifies a root at 5 and
    # two siblings at 6 (slots 6 and 7: each sees the prefix and the root, not the other)
    steps = [([0] * 9 + [1] * 5, list(range(9)) + list(range(5)), None),
             ([0, 1, 1, 1], [9, 5, 6, 7],
              (torch.tensor([10, 5, 5, 5], dtype=torch.int32),
               torch.tensor([[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)))]
    runs = {}
    calls = []
    fused = LlamaForCausalLM._layers_in_extension
    for name in ("python", "extension"):
        if name == "python":
            monkeypatch.setattr(model, "_layers_in_extension", lambda *a: None)
        else:
            monkeypatch.setattr(model, "_layers_in_extension",
                                lambda *a: calls.append(fused(model, *a)) or calls[-1])
        kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in range(2)]
        outs = []
        for i, (seq, pos, tree) in enumerate(steps):
            meta = meta_for(seq, pos, tree)
            if tree is not None:  # positions: the siblings both sit at depth 1 (position 6)
                pos = [9, 5, 6, 6]
            ids = torch.randint(64, (len(seq),), generator=torch.Generator().manual_seed(i))
            outs.append(model(ids, torch.tensor(pos), kv, meta, CpuAttention()))
        runs[name] = (outs, kv)
    assert len(calls) == 2 and all(out is not None for out in calls)  # it ran in one call
    for a, b in zip(runs["python"][0], runs["extension"][0]):
        assert a.dtype == dtype and torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(runs["python"][1], runs["extension"][1]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_does_not_depend_on_block_size(isa, dtype):
    """The same keys and values in caches of 4-, 8-, 16- and 32-token blocks (shuffled) give
    the same attention output bit for bit: a prefill of 37, a decode at 300 and a chunk of 4
    after 120 (the float32 path once stepped its online softmax block by block)."""
    g = torch.Generator().manual_seed(7)
    seqs, kvh, group, d = [(0, 37), (299, 1), (120, 4)], 2, 3, 64
    keys = [torch.randn(c + n, kvh, d, generator=g).to(dtype) for c, n in seqs]
    vals = [torch.randn(c + n, kvh, d, generator=g).to(dtype) for c, n in seqs]
    query_seq = torch.tensor([s for s, (_, n) in enumerate(seqs) for _ in range(n)],
                             dtype=torch.int32)
    kv_lens = torch.tensor([p + 1 for c, n in seqs for p in range(c, c + n)], dtype=torch.int32)
    q = torch.randn(len(kv_lens), kvh * group, d, generator=g).to(dtype)
    outs = []
    for bs in (4, 8, 16, 32):
        per_seq = [-(-len(k) // bs) for k in keys]
        perm = torch.randperm(sum(per_seq), generator=g).int()
        tables = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32)
        k_cache = torch.zeros(sum(per_seq), bs, kvh, d, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        start = 0
        for s, (k, v) in enumerate(zip(keys, vals)):
            tables[s, :per_seq[s]] = perm[start:start + per_seq[s]]
            start += per_seq[s]
            for p in range(len(k)):
                block, off = int(tables[s, p // bs]), p % bs
                k_cache[block, off], v_cache[block, off] = k[p], v[p]
        meta = AttentionMetadata(slot_mapping=torch.zeros(len(kv_lens), dtype=torch.int64),
                                 block_tables=tables, query_seq=query_seq, kv_lens=kv_lens,
                                 max_kv_len=int(kv_lens.max()))
        outs.append(CpuAttention().forward(q, k_cache, v_cache, meta, d ** -0.5))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("shape", [(0, 40), (1, 40), (128, 40), (300, 40), (2, 77, 40)])
def test_cuda_rows_chunks_keep_shapes_and_rows(shape):
    """``kernels._cuda_rows`` (the CUDA batch-invariant path; its logic checked here on CPU
    tensors): every call ``fn`` sees has exactly ``CUDA_ROWS`` rows, and the result has the
    input's leading shape and each row's own values."""
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g)
    w = torch.randn(24, 40, generator=g)
    seen = []

    def fn(rows, weight):
        seen.append(rows.shape[0])
        return torch.nn.functional.linear(rows, weight)

    y = kernels._cuda_rows(fn, x, w)
    assert y.shape == (*shape[:-1], 24)
    assert seen and set(seen) == {kernels.CUDA_ROWS}
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w))
