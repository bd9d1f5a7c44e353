"""Triton paged tree-attention kernel against ``paged_attention_masked_ref``.

Runs in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before triton is
imported; slow, so shapes are small). With ``TRITON_INTERPRET=0`` in the environment and a
CUDA device, the same tests run the compiled kernel on the GPU. One test compiles the kernel
for sm_90 (no GPU needed). Skipped without triton.
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (kernel creation)

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (pip install "
                             "triton==3.7.1)")

from specengine.attention import triton_backend  # noqa: E402
from specengine.attention.base import AttentionMetadata  # noqa: E402
from specengine.attention.cpu import paged_attention_masked_ref  # noqa: E402
from specengine.attention.triton_backend import TritonAttention  # noqa: E402

if triton_backend._INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytestmark = pytest.mark.skip(reason="TRITON_INTERPRET is off and there is no CUDA device")
    DEVICE = "cpu"

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def random_parents(n, g):
    """Random tree in topological order: node i's parent is in [-1, i-1] (-1: a root)."""
    return [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]


def ancestors_mask(parents):
    """[n, n] bool: node i sees its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def make_batch(rows, block_size, kv_heads, group, head_dim, dtype, seed=0):
    """Random shuffled-block caches and metadata for ``rows`` = [(kind, context, n)]:
    kind "causal" (prefill chunk / decode: kv_len = position + 1) or "tree" (an ``n``-node
    random draft tree after ``context`` committed tokens). Returns query, caches, metadata
    (with a tree mask iff some row is a tree)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-(c + n) // block_size) for _, c, n in rows]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g).int()
    tables = torch.full((len(rows), max(per_seq) + 1), -1, dtype=torch.int32)
    start = 0
    for s, nb in enumerate(per_seq):
        tables[s, :nb] = perm[start:start + nb]
        start += nb
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    W = max([n for kind, _, n in rows if kind == "tree"], default=0)
    query_seq, kv_lens, bases, masks = [], [], [], []
    for s, (kind, c, n) in enumerate(rows):
        query_seq += [s] * n
        if kind == "causal":
            kv_lens += list(range(c + 1, c + n + 1))
            bases += list(range(c + 1, c + n + 1))
            masks.append(torch.zeros(n, W, dtype=torch.bool))
        else:
            # Half the trees give every node the whole window, half a causal kv_len.
            whole = bool(torch.randint(0, 2, (1,), generator=g))
            kv_lens += [c + n] * n if whole else list(range(c + 1, c + n + 1))
            bases += [c] * n
            m = torch.zeros(n, W, dtype=torch.bool)
            m[:, :n] = ancestors_mask(random_parents(n, g))
            masks.append(m)
    T = len(kv_lens)
    query = torch.randn(T, kv_heads * group, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(T, dtype=torch.int64), block_tables=tables,
                             query_seq=torch.tensor(query_seq, dtype=torch.int32),
                             kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
                             max_kv_len=max(kv_lens))
    if W:
        meta.tree_base = torch.tensor(bases, dtype=torch.int32)
        meta.tree_mask = torch.cat(masks)
    return query, k_cache, v_cache, meta


def to_device(q, kc, vc, meta):
    """Copies on ``DEVICE`` (``meta`` itself is left on the CPU, where the reference reads it)."""
    moved = {f: getattr(meta, f).to(DEVICE) for f in
             ("block_tables", "query_seq", "kv_lens", "tree_base", "tree_mask")
             if getattr(meta, f) is not None}
    return q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), dataclasses.replace(meta, **moved)


def check(q, kc, vc, meta, scale, dtype):
    ref = paged_attention_masked_ref(q, kc, vc, meta, scale)
    out = TritonAttention().forward(*to_device(q, kc, vc, meta), scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu(), ref, **TOL[dtype])
    return out.cpu(), ref


F32, BF16 = torch.float32, torch.bfloat16
# block size x GQA ratio x head_dim (40: not a power of two, padded and masked) x dtype: an
# orthogonal array (every pair of values appears), 8 cases instead of 16 (the interpreter is slow)
CASES = [(8, 1, 64, F32), (8, 1, 40, BF16), (8, 3, 40, F32), (8, 3, 64, BF16),
         (16, 1, 40, F32), (16, 1, 64, BF16), (16, 3, 64, F32), (16, 3, 40, BF16)]


@pytest.mark.parametrize("block_size,group,head_dim,dtype", CASES)
def test_tree_attention_matches_reference(block_size, group, head_dim, dtype):
    seed = block_size * 100 + group * 10 + head_dim + (dtype == BF16)
    # prefill of 6, random tree after 19, decode at 30, chunked prefill after 9, tree after 2
    rows = [("causal", 0, 6), ("tree", 19, 6), ("causal", 29, 1), ("causal", 9, 2),
            ("tree", 2, 4)]
    q, kc, vc, meta = make_batch(rows, block_size, 2, group, head_dim, dtype, seed=seed)
    check(q, kc, vc, meta, head_dim ** -0.5, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_no_tree_mask_and_odd_block_size(dtype):
    # plain causal metadata (tree_mask None), block size 12 (not a power of two), GQA 4
    q, kc, vc, meta = make_batch([("causal", 0, 5), ("causal", 26, 1)], 12, 1, 4, 32, dtype,
                                 seed=5)
    assert meta.tree_mask is None
    check(q, kc, vc, meta, 0.2, dtype)


def test_chain_tree_equals_causal_and_branches_differ():
    ctx, n = 13, 5
    q, kc, vc, causal = make_batch([("causal", ctx, n)], 8, 2, 2, 16, torch.float32, seed=3)
    plain = TritonAttention().forward(*to_device(q, kc, vc, causal), 0.25).cpu()
    _, _, _, meta = make_batch([("causal", ctx, n)], 8, 2, 2, 16, torch.float32, seed=3)
    meta.kv_lens = torch.full((n,), ctx + n, dtype=torch.int32)
    meta.tree_base = torch.full((n,), ctx, dtype=torch.int32)
    meta.tree_mask = ancestors_mask([-1, 0, 1, 2, 3])
    chain, _ = check(q, kc, vc, meta, 0.25, torch.float32)
    torch.testing.assert_close(chain, plain, atol=1e-6, rtol=1e-6)
    meta.tree_mask = ancestors_mask([-1, 0, 0, 1, 2])  # node 4: path 0 -> 2 -> 4, not 1 or 3
    branched, _ = check(q, kc, vc, meta, 0.25, torch.float32)
    torch.testing.assert_close(branched[:2], plain[:2], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(branched[4], plain[4], atol=1e-3)


def test_row_that_sees_nothing_is_zero_and_strided_query():
    # Row 1: tree_base 0 and an all-False mask row -> sees no position -> zeros (as the ref).
    q, kc, vc, meta = make_batch([("tree", 0, 3), ("causal", 6, 1)], 8, 2, 2, 16,
                                 torch.float32, seed=9)
    meta.tree_mask[1] = False
    qkv = torch.randn(q.shape[0], q.shape[1] * 2, q.shape[2])
    qkv[:, :q.shape[1]] = q
    view = qkv[:, :q.shape[1]]  # non-contiguous view, as from a fused QKV projection
    assert not view.is_contiguous()
    out, ref = check(view, kc, vc, meta, 0.25, torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_rejects_bad_input():
    q, kc, vc, meta = make_batch([("causal", 3, 2)], 8, 2, 2, 16, torch.float32)
    q, kc, vc, meta = to_device(q, kc, vc, meta)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TritonAttention().forward(q[:, :3], kc, vc, meta, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        TritonAttention().forward(q[..., :8], kc, vc, meta, 1.0)
    with pytest.raises(TypeError, match="dtypes"):
        TritonAttention().forward(q.double(), kc, vc, meta, 1.0)


def test_import_without_triton_and_clear_error(monkeypatch):
    # A fresh copy of the module, loaded while ``import triton`` fails.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_triton_backend_without_triton",
                                                  triton_backend.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not mod.triton_available()
    with pytest.raises(ImportError, match="triton"):
        mod.TritonAttention()


COMPILE_FOR_GPU = """
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specengine.attention.triton_backend import _paged_tree_attention_kernel as fn
const = dict(GROUP=3, GROUP_PAD=16, HEAD_DIM=40, D_PAD=64, BLOCK_SIZE=16, BS_PAD=16,
             HAS_TREE=True)
data = ("out_ptr", "q_ptr", "k_ptr", "v_ptr")
sig = {n: "*bf16" if n in data else "*u8" if n == "tree_mask_ptr" else "*i32"
       if n.endswith("_ptr") else "fp32" if n == "qk_scale" else "constexpr" if n in const
       else "i32" for n in fn.arg_names}
src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
print("cubin", len(compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]))
"""


def test_kernel_compiles_for_sm90_without_a_gpu():
    # The interpreter does not run Triton's type checks and lowering; compile the real kernel
    # (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas) for an H100 target. A new
    # process: the kernel must be created with TRITON_INTERPRET off.
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, "-c", COMPILE_FOR_GPU], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0 and "cubin" in res.stdout, res.stderr[-3000:]
