"""Paged (tree) attention as a Triton kernel.

Semantics are exactly those of ``specengine.attention.base``: query row ``t`` of batch row
``query_seq[t]`` attends to the KV positions ``p < kv_lens[t]`` of that sequence, read through
its block table; with a tree mask, only to ``p < tree_base[t]`` (committed context) or
``tree_mask[t, p - tree_base[t]]`` (its ancestors and itself in the draft tree). A row that
sees no position gets zeros (as ``paged_attention_masked_ref``).

Shapes and dtypes:
    query ``[T, H, D]`` float32 / bfloat16 / float16; the result has the same shape and dtype.
    k_cache, v_cache ``[num_blocks, block_size, KVH, D]`` float32 / bfloat16 / float16 (the
    model dtype; may differ from the query's), ``H % KVH == 0`` (GQA: query head ``h`` reads
    KV head ``h // (H // KVH)``). ``D`` and ``block_size`` need not be powers of two (padded
    to one inside the kernel and masked). Metadata: ``block_tables [S, max_blocks]``,
    ``query_seq [T]``, ``kv_lens [T]``, ``tree_base [T]`` int32; ``tree_mask [T, W]`` bool.

Kernel: one program per (query token, KV head); it holds the ``H // KVH`` query heads of the
GQA group (so each K/V row is loaded once per group) and walks the sequence's KV blocks in
order, with an online softmax in float32 (scores, running max, running sum and the output
accumulator are float32; Q/K/V are converted on load). The two products per block
(``Q K^T`` of ``[group, D] x [D, block_size]`` and ``P V``) are ``tl.dot`` in float32 with
``input_precision="ieee"`` (no TF32, no bf16 rounding of P: results match the float32
reference), the group, head_dim and block dims padded to powers of two >= 16 (tl.dot's minimum)
and masked. Scores use ``exp2`` with ``scale * log2(e)`` folded in. Possible speed-up not done:
bf16/fp16 tensor-core dots (FlashAttention rounds P to the V dtype); the interpreter cannot
check a bf16 ``tl.dot`` (it returns garbage there), so it stays float32.
Prefill rows are not tiled over queries (each row walks its own prefix): fine for decode and
tree verification; a FlashAttention-style query-tiled kernel would be faster for long prefills.

Sources: vLLM PagedAttention (block-table KV layout, one program per token/head, GQA groups);
FlashAttention (Dao et al., 2022) online softmax; SpecInfer (Miao et al., 2024) tree
attention (a topology-aware mask over the draft tree tokens appended to the committed
context).

Requires ``triton`` (``pip install triton==3.7.1``, the version torch 2.13 pins). Importing
this module never fails; constructing ``TritonAttention`` without triton raises ImportError.
On CPU tensors the kernel only runs under ``TRITON_INTERPRET=1`` (set before this module is
imported: the kernel is created at import), which is slow and meant for tests.
"""

from __future__ import annotations

import torch

from specengine.attention.base import AttentionBackend, AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634


def triton_available() -> bool:
    """Whether ``triton`` could be imported."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _visible(pos, s_ok, kv_len, base, mask_row_ptr, tree_w, HAS_TREE: tl.constexpr):
        """Which positions ``pos`` of one KV block a query row sees: ``pos < kv_len`` and, with
        a tree, the committed context (``pos < base``) or its row of the tree mask."""
        seen = s_ok & (pos < kv_len)
        if HAS_TREE:
            rel = pos - base
            in_win = (rel >= 0) & (rel < tree_w)
            tm = tl.load(mask_row_ptr + rel, mask=seen & in_win, other=0)
            seen = seen & ((pos < base) | (in_win & (tm != 0)))
        return seen

    @triton.jit
    def _load_tile(ptr, block_id, offs_s, offs_d, stride_b, stride_s, kv_head, stride_h, ok):
        """One KV block's rows of head ``kv_head`` as float32 ``[BS_PAD, D_PAD]``."""
        offs = (block_id * stride_b + offs_s[:, None] * stride_s
                + kv_head * stride_h + offs_d[None, :])
        return tl.load(ptr + offs, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _softmax_block(q, k, v, seen, m_i, l_i, acc, qk_scale):
        """One block of the online softmax (log2 units): returns the new running max, running
        sum and output accumulator."""
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [GROUP_PAD, BS_PAD]
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit
    def _paged_tree_attention_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, query_seq_ptr, kv_lens_ptr,
        tree_base_ptr, tree_mask_ptr,
        qk_scale,  # scale * log2(e)
        stride_qt, stride_qh,
        stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_bt,
        stride_mt, tree_w,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr,
        HAS_TREE: tl.constexpr,
    ):
        t = tl.program_id(0)
        kv_head = tl.program_id(1)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_s = tl.arange(0, BS_PAD)
        g_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        s_ok = offs_s < BLOCK_SIZE

        kv_len = tl.load(kv_lens_ptr + t)
        seq = tl.load(query_seq_ptr + t).to(tl.int64)
        if HAS_TREE:
            base = tl.load(tree_base_ptr + t)
        else:
            base = kv_len

        # Query heads of this KV head's group: [GROUP_PAD, D_PAD], float32.
        heads = kv_head * GROUP + offs_g
        q_offs = t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        q = q.to(tl.float32)

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)

        num_blocks = tl.cdiv(kv_len, BLOCK_SIZE)
        kv_ok = s_ok[:, None] & d_ok[None, :]
        for b in range(0, num_blocks):
            block_id = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
            pos = b * BLOCK_SIZE + offs_s
            seen = _visible(pos, s_ok, kv_len, base, tree_mask_ptr + t.to(tl.int64) * stride_mt,
                            tree_w, HAS_TREE)
            k = _load_tile(k_ptr, block_id, offs_s, offs_d, stride_kb, stride_ks, kv_head,
                           stride_kh, kv_ok)  # [BS, D]
            v = _load_tile(v_ptr, block_id, offs_s, offs_d, stride_vb, stride_vs, kv_head,
                           stride_vh, kv_ok)  # [BS, D]
            m_i, l_i, acc = _softmax_block(q, k, v, seen, m_i, l_i, acc, qk_scale)

        denom = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / denom[:, None]
        o_offs = t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])


# Whether the kernel was created in interpreter mode (TRITON_INTERPRET=1 at import time).
_INTERPRETED = triton is not None and type(_paged_tree_attention_kernel).__name__ == (
    "InterpretedFunction")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def paged_tree_attention_triton(query: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, meta: AttentionMetadata,
                                scale: float) -> torch.Tensor:
    """Launch the Triton kernel; arguments and result as in ``AttentionBackend.forward``."""
    if triton is None:
        raise ImportError("TritonAttention needs the 'triton' package (pip install triton)")
    _check_inputs(query, k_cache, v_cache)
    T, H, D = query.shape
    _, block_size, kvh, _ = k_cache.shape
    dev = query.device
    out = torch.empty_like(query)
    if T == 0:
        return out
    # The kernel assumes a unit stride on head_dim.
    q = query if query.stride(-1) == 1 else query.contiguous()
    kc = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    vc = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    bt = meta.block_tables.to(device=dev, dtype=torch.int32).contiguous()
    qs = meta.query_seq.to(device=dev, dtype=torch.int32).contiguous()
    kl = meta.kv_lens.to(device=dev, dtype=torch.int32).contiguous()
    has_tree = meta.tree_mask is not None
    tb, tm, tree_w, stride_mt = _tree_args(meta, T, dev) if has_tree else (kl, kl, 0, 0)
    group = H // kvh
    _paged_tree_attention_kernel[(T, kvh)](
        out, q, kc, vc, bt, qs, kl, tb, tm,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        bt.stride(0),
        stride_mt, tree_w,
        GROUP=group, GROUP_PAD=max(16, _next_pow2(group)),  # tl.dot needs dims >= 16
        HEAD_DIM=D, D_PAD=max(16, _next_pow2(D)),
        BLOCK_SIZE=block_size, BS_PAD=max(16, _next_pow2(block_size)),
        HAS_TREE=has_tree,
    )
    return out


def _check_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError / TypeError / RuntimeError for inputs the kernel does not take (shapes,
    dtypes, a CPU tensor outside the interpreter)."""
    if query.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("query must be [T, H, D] and k/v caches [num_blocks, block_size, "
                         f"KVH, D]; got {tuple(query.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    _, H, D = query.shape
    _, _, kvh, d_cache = k_cache.shape
    if d_cache != D:
        raise ValueError(f"head_dim mismatch: query {D}, cache {d_cache}")
    if H % kvh:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({kvh})")
    if query.dtype not in _FLOATS or k_cache.dtype not in _FLOATS or v_cache.dtype not in _FLOATS:
        raise TypeError(f"unsupported dtypes {query.dtype}/{k_cache.dtype}/{v_cache.dtype}; "
                        "expected float32, bfloat16 or float16")
    dev = query.device
    if dev.type != "cuda" and not _INTERPRETED:
        raise RuntimeError(f"TritonAttention on {dev.type} tensors needs TRITON_INTERPRET=1 set "
                           "before specengine.attention.triton_backend is imported")


def _tree_args(meta: AttentionMetadata, T: int, dev: torch.device) -> tuple:
    """``(tree_base int32 [T], tree_mask uint8 [T, W'], W, row stride)`` for the kernel (an
    empty mask becomes one zero column with ``W = 0``). ValueError for a mask without
    ``tree_base`` or not ``[T, W]``."""
    if meta.tree_base is None:
        raise ValueError("tree_mask given without tree_base")
    tb = meta.tree_base.to(device=dev, dtype=torch.int32).contiguous()
    tm = meta.tree_mask.to(device=dev, dtype=torch.uint8).contiguous()
    if tm.dim() != 2 or tm.shape[0] != T:
        raise ValueError(f"tree_mask must be [T={T}, W]; got {tuple(tm.shape)}")
    if tm.shape[1] == 0:
        return tb, torch.zeros(T, 1, dtype=torch.uint8, device=dev), 0, 1
    return tb, tm, tm.shape[1], tm.stride(0)


class TritonAttention(AttentionBackend):
    """Backend running the Triton paged tree-attention kernel (GPU; CPU under
    ``TRITON_INTERPRET=1`` for tests). ``write_kv`` is the base class's torch scatter."""

    name = "triton"

    def __init__(self) -> None:
        if triton is None:
            raise ImportError("TritonAttention needs the 'triton' package, which is not "
                              "installed (pip install triton==3.7.1)")

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_tree_attention_triton(query, k_cache, v_cache, meta, scale)
