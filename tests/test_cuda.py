"""The CUDA path on a GPU: the paged attention kernel (``csrc/cuda/paged_attention.cu``)
against the torch reference and bit for bit against itself (a row alone, a tree node against
decoding its path), and ``kernels.linear`` / ``rms_norm`` rows independent of their call
(``kernels.CUDA_ROWS``). Skipped without a CUDA device and a CUDA build of the extension;
the engine-level checks are ``tests/test_determinism.py`` with ``SPECENGINE_TEST_DEVICE=cuda``.
"""

import dataclasses

import pytest
import torch
from test_kernels import TOL, paged_batch, tree_mask_of

from specengine.ops import kernels
from specengine.ops.extension import ext

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or ext() is None or not getattr(ext(), "with_cuda", False),
    reason="needs a CUDA device and specengine._C built with CUDA")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def to_cuda(q, kc, vc, meta):
    moved = {f: getattr(meta, f).cuda() for f in ("slot_mapping", "block_tables", "query_seq",
                                                   "kv_lens", "tree_base", "tree_mask")
             if getattr(meta, f) is not None}
    return q.cuda(), kc.cuda(), vc.cuda(), dataclasses.replace(meta, **moved)


def cuda_attention(q, kc, vc, meta, scale):
    return ext().paged_attention_cuda(q, kc, vc, meta.block_tables, meta.query_seq,
                                      meta.kv_lens, scale, meta.tree_base, meta.tree_mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,D", [(1, 128), (3, 40), (7, 64), (2, 256)])
def test_cuda_attention_matches_reference(dtype, group, D):
    from specengine.attention.torch_ref import paged_attention_ref

    seqs = [(0, 37), (299, 1), (0, 1), (120, 4), (3, 2)]
    q, kc, vc, meta = paged_batch(seqs, 16, 2, group, D, dtype, seed=group)
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, D ** -0.5)
    out = cuda_attention(*to_cuda(q, kc, vc, meta), D ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOL.get(dtype, dict(atol=2e-3, rtol=2e-3))
    torch.testing.assert_close(out.cpu().float(), ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,D", [(3, 64), (1, 128), (2, 256)])
def test_cuda_attention_rows_equal_the_row_alone(dtype, group, D):
    q, kc, vc, meta = to_cuda(*paged_batch([(230, 40), (17, 1)], 16, 2, group, D, dtype,
                                           seed=D + group))
    out = cuda_attention(q, kc, vc, meta, D ** -0.5)
    for t in range(q.shape[0]):
        alone = ext().paged_attention_cuda(q[t:t + 1], kc, vc, meta.block_tables,
                                           meta.query_seq[t:t + 1], meta.kv_lens[t:t + 1],
                                           D ** -0.5, None, None)
        assert torch.equal(out[t], alone[0]), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx", [0, 5, 37])
@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 2, 2, 5], [-1, -1, 1, 0, 3, 2, 4, 6]])
def test_cuda_tree_node_equals_decoding_its_path(dtype, ctx, parents):
    """A tree node's output equals, bit for bit, decoding its path one token at a time where
    its ancestors' keys sit next to each other (the kernel walks the visible keys as one
    compact sequence)."""
    g = torch.Generator().manual_seed(ctx)
    m, bs, kvh, group, D = len(parents), 16, 2, 3, 64
    nb = -(-(ctx + m) // bs) + 1
    k = torch.randn(nb, bs, kvh, D, generator=g).to(dtype)
    v = torch.randn(nb, bs, kvh, D, generator=g).to(dtype)
    q = torch.randn(m, kvh * group, D, generator=g).to(dtype).cuda()
    table = torch.arange(nb, dtype=torch.int32).view(1, nb).cuda()
    mask = tree_mask_of(parents)
    i32 = dict(dtype=torch.int32, device="cuda")
    tree = ext().paged_attention_cuda(q, k.cuda(), v.cuda(), table, torch.zeros(m, **i32),
                                      torch.tensor([ctx + i + 1 for i in range(m)], **i32),
                                      0.125, torch.full((m,), ctx, **i32), mask.cuda())
    flat_k, flat_v = k.view(-1, kvh, D), v.view(-1, kvh, D)
    for node in range(m):
        path = [j for j in range(m) if mask[node, j]]
        k2, v2 = k.clone(), v.clone()
        for depth, j in enumerate(path):
            k2.view(-1, kvh, D)[ctx + depth] = flat_k[ctx + j]
            v2.view(-1, kvh, D)[ctx + depth] = flat_v[ctx + j]
        alone = ext().paged_attention_cuda(q[node:node + 1], k2.cuda(), v2.cuda(), table,
                                           torch.zeros(1, **i32),
                                           torch.tensor([ctx + len(path)], **i32), 0.125,
                                           None, None)
        assert torch.equal(tree[node], alone[0]), node


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 77, 300])
def test_cuda_linear_and_norm_rows_equal_the_row_alone(dtype, rows):
    """With batch invariance on, each row of ``linear`` (bias too) and ``add_rms_norm`` on
    CUDA equals the same row computed alone, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 896, generator=g, device="cuda").to(dtype)
    r = torch.randn(rows, 896, generator=g, device="cuda").to(dtype)
    w = (torch.randn(4864, 896, generator=g, device="cuda") * 0.03).to(dtype)
    b = torch.randn(4864, generator=g, device="cuda").to(dtype)
    nw = torch.randn(896, generator=g, device="cuda").to(dtype)
    assert kernels.batch_invariant()
    y = kernels.linear(x, w, b)
    n, s = kernels.add_rms_norm(x, r, nw, 1e-6)
    torch.testing.assert_close(y.float(), torch.nn.functional.linear(x, w, b).float(),
                               **TOL[dtype])
    for i in range(rows):
        assert torch.equal(y[i], kernels.linear(x[i:i + 1], w, b)[0]), i
        assert torch.equal(n[i], kernels.add_rms_norm(x[i:i + 1], r[i:i + 1], nw, 1e-6)[0][0])
