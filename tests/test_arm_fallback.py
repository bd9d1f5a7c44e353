"""What runs on Arm (aarch64), simulated on this CPU.

On aarch64 the extension builds (tests/test_cross_compile.py) and every x86 capability query
answers False (``amx_available``, ``avx512_linear_available``, ... are compiled to ``return
false`` outside ``__x86_64__``). Here the extension's ``*_available`` functions are patched to
answer False and its x86-only linear kernels to raise, and ``specengine.ops.kernels`` must then keep
weights unpacked, send small-row linears to the portable C++ kernel (``ext().linear``, plain
vector code GCC compiles for NEON) and larger ones to ``torch.nn.functional.linear``, and never
call an x86 kernel. (The x86 branches inside C++ kernels such as the paged attention are
selected in C++ and cannot be switched off from here; the cross-compile covers them.)
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import rand_prompts

from specengine import LLM, SamplingParams
from specengine.models.loader import save_random_model
from specengine.ops import kernels
from specengine.ops.extension import ext

pytestmark = pytest.mark.skipif(ext() is None, reason="specengine._C is not built")


def _x86_only(name):
    def call(*args, **kwargs):
        raise AssertionError(f"x86 kernel {name} called with every capability False")
    return call


def make_arm_like(monkeypatch):
    """Patch the extension to answer as on aarch64: no x86 capability, x86 kernels raise."""
    mod = ext()
    for name in dir(mod):
        if name.endswith("_available"):
            monkeypatch.setattr(mod, name, lambda *a, **k: False)
        elif name.startswith(("linear_", "pack_weight_")):
            monkeypatch.setattr(mod, name, _x86_only(name))
    return mod


@pytest.fixture
def arm_like(monkeypatch):
    """The extension as it answers on aarch64 (``make_arm_like``)."""
    return make_arm_like(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepack_keeps_weights_unpacked(arm_like, dtype):
    w = torch.randn(128, 64, dtype=dtype)
    for glu in (False, True):
        pw = kernels.prepack(w, glu=glu)
        assert (pw.kind, pw.packed, pw.glu) == (None, None, False)
        assert pw.weight is w and pw.rows_for(torch.randn(1, 64, dtype=dtype)) == 0
    assert not kernels.amx_available() and not kernels.avx512_available(dtype)
    assert not kernels.packed_covers(1) and not kernels.packed_covers(64)


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_portable_kernel_then_torch(arm_like, dtype, invariant):
    """The portable C++ kernel for every row count (batch invariance, the default), or up to
    ``LINEAR_MAX_M`` rows and torch above (invariance off)."""
    torch.manual_seed(0)
    w, b = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    pw, pg = kernels.prepack(w), kernels.prepack(w, glu=True)
    small = kernels.LINEAR_MAX_M[dtype]
    for rows in (1, small, small + 1, 64):
        x = torch.randn(rows, 64, dtype=dtype)
        with kernels.batch_invariance(invariant):
            y = kernels.linear(x, pw, b)
            assert torch.equal(y, kernels.linear(x, w, b))
        if rows <= small or invariant:  # the portable C++ kernel: row i alone gives the row
            assert torch.equal(y, arm_like.linear(x, w, b))
            assert torch.equal(y[-1:], arm_like.linear(x[-1:], w, b))
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol)
        else:
            assert torch.equal(y, F.linear(x, w, b))
        glu = kernels.linear_glu(x, pg)
        assert torch.equal(glu, kernels.silu_and_mul(kernels.linear(x, w)))
        assert glu.shape == (rows, 48)


def test_kernel_threads_inactive_without_packed_kernels(arm_like):
    n = torch.get_num_threads()
    with kernels.kernel_threads(kernels.packed_covers(1)):
        assert torch.get_num_threads() == n


def test_generate_on_arm_path_equals_x86_path(tmp_path, monkeypatch):
    """Greedy tokens of a tiny float32 model with every capability False (no packing, portable
    C++ and torch linears) equal those of this CPU's own kernels."""
    d = save_random_model(tmp_path / "tiny", {"num_hidden_layers": 2}, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in rand_prompts(3)]

    def run():
        llm = LLM(str(d), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    native = run()
    mod = make_arm_like(monkeypatch)
    portable, calls = mod.linear, []
    monkeypatch.setattr(mod, "linear", lambda *a, **k: calls.append(1) or portable(*a, **k))
    arm = run()
    assert arm == native and all(len(t) == 16 for t in arm)
    assert calls  # decode steps (3 rows) ran the portable kernel
