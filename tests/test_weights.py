"""Streamed and one-call weight updates (``specengine.lifecycle.weights`` through ``LLM``): sessions
equal one-call updates equal a freshly loaded engine; aborts, bad chunks and NaN weights change
nothing; fused names; checkpoints; versions; the in-place repack of the kernels' copies."""

import pytest
import torch

from specengine import LLM, SamplingParams
from specengine.lifecycle.weight_checks import check_finite
from specengine.models.loader import iter_safetensors, safetensors_files, save_random_model
from specengine.ops import kernels

KW = {"block_size": 8, "kv_cache_memory_bytes": 8 << 20}
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 7]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("w")
    return (save_random_model(root / "a", {"num_hidden_layers": 2}, seed=1),
            save_random_model(root / "b", {"num_hidden_layers": 2}, seed=2))


@pytest.fixture(scope="module")
def sds(dirs):
    return tuple(dict(iter_safetensors(safetensors_files(d))) for d in dirs)


def make(d, **kw):
    return LLM(str(d), dtype="float32", **KW, **kw)


def run(llm, n=12):
    """(token ids, logprob values) per prompt, greedy, with logprobs of the top 2."""
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, p, use_tqdm=False)]
    return [o.token_ids for o in outs], [[{t: lp.logprob for t, lp in d.items()}
                                          for d in o.logprobs] for o in outs]


def state(llm):
    return {k: v.clone() for k, v in llm.engine.runner.model.state_dict().items()}


def assert_state(llm, snapshot):
    for k, v in llm.engine.runner.model.state_dict().items():
        assert torch.equal(v, snapshot[k]), k


@pytest.fixture(scope="module")
def want(dirs):
    """Outputs of engines freshly loaded from A and from B."""
    return run(make(dirs[0])), run(make(dirs[1]))


def test_chunked_equals_one_call_equals_fresh_engine(dirs, sds, want):
    a, b = sds
    want_a, want_b = want
    assert want_a[0] != want_b[0]
    one = make(dirs[0])
    assert run(one) == want_a
    assert sorted(one.update_weights(b)) == sorted(b)
    assert run(one) == want_b and one.weight_version == 1

    llm = make(dirs[0])
    run(llm)  # packed copies built, KV pool used
    llm.begin_weight_update()
    items = list(b.items())
    staged = []
    staged += llm.load_weights(items[0])  # one (name, tensor) pair
    staged += llm.load_weights(dict(items[1:6]))  # a bucket
    staged += llm.load_weights(iter(items[6:]))  # an iterable of pairs
    assert sorted(staged) == sorted(b)
    assert run(llm) == want_a  # nothing applied before finish: old weights keep serving
    assert llm.weight_version == 0
    assert sorted(llm.finish_weight_update()) == sorted(b)
    assert run(llm) == want_b
    m = llm.get_metrics()
    assert (m["weight_version"], m["weight_updates"]) == (1, 1)
    assert m["weight_update_time"] > 0
    # and back to A, one tensor per call (OpenRLHF / TRL style)
    llm.begin_weight_update()
    for pair in a.items():
        llm.load_weights(pair)
    llm.finish_weight_update()
    assert run(llm) == want_a and llm.weight_version == 2


def test_abort_keeps_the_old_weights(dirs, sds, want):
    llm = make(dirs[0])
    snap = state(llm)
    llm.begin_weight_update()
    llm.load_weights(sds[1])
    assert llm.abort_weight_update() is True
    assert llm.abort_weight_update() is False
    assert_state(llm, snap)
    assert run(llm) == want[0] and llm.weight_version == 0
    with pytest.raises(RuntimeError, match=r"no weight update session is open \(the last one "
                                           r"was aborted: abort_weight_update\(\) was called"):
        llm.load_weights(("model.norm.weight", torch.ones(64)))
    with pytest.raises(RuntimeError, match="no weight update session is open"):
        llm.finish_weight_update()
    llm.begin_weight_update()
    with pytest.raises(RuntimeError, match="already open"):
        llm.begin_weight_update()
    with pytest.raises(RuntimeError, match="a weight update session is open"):
        llm.update_weights(sds[1])
    llm.abort_weight_update()


@pytest.mark.parametrize("name, value, exc, msg", [
    ("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64), ValueError,
     "unexpected weight 'model.layers.7.mlp.up_proj.weight'"),
    ("model.layers.0.self_attn.q_proj.bias", torch.zeros(64), ValueError,
     "unexpected weight 'model.layers.0.self_attn.q_proj.bias'"),
    ("model.norm.weight", torch.ones(65), ValueError,
     r"'model.norm.weight' has shape \(65,\), expected \(64,\)"),
    ("model.norm.weight", [1.0] * 64, TypeError, "'model.norm.weight' is a list"),
    ("model.norm.weight", torch.ones(64, dtype=torch.int64), TypeError,
     "'model.norm.weight' has dtype torch.int64; expected a floating-point tensor"),
    ("model.layers.1.mlp.down_proj.weight", torch.full((64, 128), float("nan")), ValueError,
     r"'model.layers.1.mlp.down_proj.weight' has 8192 NaN/inf values \(of 8192\)"),
    ("lm_head.weight", torch.zeros(512, 64).index_fill_(0, torch.tensor([3]), float("inf")),
     ValueError, r"'lm_head.weight' has 64 NaN/inf values"),
])
def test_bad_chunk_mid_session_aborts_it_and_applies_nothing(dirs, sds, want, name, value, exc,
                                                             msg):
    llm = make(dirs[0])
    snap = state(llm)
    b = sds[1]
    llm.begin_weight_update()
    llm.load_weights({k: v for k, v in b.items() if k.startswith("model.layers.0.")})
    good = ("model.layers.1.mlp.up_proj.weight", b["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(exc, match=msg) as e:
        llm.load_weights([good, (name, value)])
    assert "session was aborted: nothing of it was applied" in str(e.value)
    assert not llm.weights.in_session
    with pytest.raises(RuntimeError, match="the last one was aborted: .*" + msg.split("'")[1]):
        llm.load_weights(good)
    with pytest.raises(RuntimeError, match="no weight update session is open"):
        llm.finish_weight_update()
    assert_state(llm, snap)
    assert run(llm) == want[0] and llm.weight_version == 0
    # one-call: refused the same way, nothing changed
    with pytest.raises(exc, match=msg):
        llm.update_weights([good, (name, value)])
    assert_state(llm, snap)
    assert llm.weight_version == 0


def test_chunks_are_copied_and_cast(dirs, sds, want):
    """A caller may reuse its bucket buffer after load_weights; float64 / bfloat16 chunks are
    cast to the engine's dtype."""
    llm = make(dirs[0])
    buf = {k: v.clone().double() for k, v in sds[1].items()}
    llm.begin_weight_update()
    llm.load_weights(buf)
    for v in buf.values():
        v.fill_(float("nan"))  # the trainer reuses its buffer
    llm.finish_weight_update()
    assert run(llm) == want[1]
    assert llm.engine.runner.model.dtype == torch.float32
    half = {k: v.bfloat16() for k, v in sds[1].items()}
    llm.update_weights(half)
    got = llm.engine.runner.model.hf_parameters()
    for k, v in half.items():
        assert torch.equal(got[k], v.float()), k


def test_fused_qkv_and_gate_up_names(tmp_path):
    """``qkv_proj`` / ``gate_up_proj`` (Phi-3 style stacked tensors; with the q/k/v bias of
    Qwen2) are split into their parts."""
    a = save_random_model(tmp_path / "a", {"model_type": "qwen2", "num_hidden_layers": 2}, seed=3)
    b = save_random_model(tmp_path / "b", {"model_type": "qwen2", "num_hidden_layers": 2}, seed=4)
    sb = dict(iter_safetensors(safetensors_files(b)))
    fused = {}
    for k, v in sb.items():
        if ".k_proj." in k or ".v_proj." in k or ".up_proj." in k:
            continue
        if ".q_proj." in k:
            kind = k.rsplit(".", 1)[1]
            fused[k.replace("q_proj", "qkv_proj")] = torch.cat(
                [v, sb[k.replace("q_proj", "k_proj")], sb[k.replace("q_proj", "v_proj")]])
            assert kind in ("weight", "bias")
        elif ".gate_proj." in k:
            fused[k.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [v, sb[k.replace("gate_proj", "up_proj")]])
        else:
            fused[k] = v
    assert "model.layers.1.self_attn.qkv_proj.bias" in fused
    llm = make(a)
    llm.begin_weight_update()
    names = llm.load_weights(fused)
    assert sorted(names) == sorted(sb)  # reported as the parts
    llm.finish_weight_update()
    assert run(llm) == run(make(b))
    with pytest.raises(ValueError, match=r"weight 'model.layers.0.mlp.gate_up_proj.weight' has "
                                         r"shape \(128, 64\), expected \(256, 64\) "
                                         r"\(128 \+ 128 rows: gate/up\)"):
        llm.update_weights({"model.layers.0.mlp.gate_up_proj.weight": torch.zeros(128, 64)})
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.5.self_attn.qkv_proj"):
        llm.update_weights({"model.layers.5.self_attn.qkv_proj.weight": torch.zeros(128, 64)})


def test_load_weights_from_a_checkpoint(dirs, want, tmp_path):
    llm = make(dirs[0])
    names = llm.load_weights(str(dirs[1]))  # no session: one update
    assert len(names) == 21 and llm.weight_version == 1
    assert run(llm) == want[1]
    llm.begin_weight_update()  # inside a session: staged like any chunk
    llm.load_weights(dirs[0] / "model.safetensors")
    assert run(llm) == want[1]
    llm.finish_weight_update()
    assert run(llm) == want[0] and llm.weight_version == 2
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        llm.load_weights(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .safetensors weights"):
        llm.load_weights(tmp_path / "empty")
    other = save_random_model(tmp_path / "big", {"num_hidden_layers": 2, "hidden_size": 32,
                                                  "head_dim": 8})
    with pytest.raises(ValueError, match="has shape"):
        llm.load_weights(other)
    assert run(llm) == want[0] and llm.weight_version == 2


def test_finish_waits_for_requests_in_flight(dirs, sds, want):
    llm = make(dirs[0])
    llm.begin_weight_update()
    llm.load_weights(sds[1])
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    it = llm.generate_iter(PROMPTS, [short, p, p], use_tqdm=False)
    first = next(it)[1]  # the short one; the others are in flight
    with pytest.raises(RuntimeError, match="in flight.*session stays open"):
        llm.finish_weight_update()
    rest = list(it)
    assert all(o.weight_version == 0 for o in [first] + [o for _, o in rest])
    llm.finish_weight_update()
    out = llm.generate(PROMPTS, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want[1][0]
    assert {o.weight_version for o in out} == {1}


def test_versions_prefix_cache_reset_and_explicit_version(dirs, sds, monkeypatch):
    llm = make(dirs[0])
    calls = []
    monkeypatch.setattr(llm.engine.blocks, "reset_prefix_cache", lambda: calls.append(1) or 0)
    assert llm.reset_prefix_cache() is True and len(calls) == 1
    llm.update_weights(sds[1])
    assert len(calls) == 2
    llm.begin_weight_update()
    llm.load_weights(sds[0])
    assert len(calls) == 2  # nothing applied yet
    llm.finish_weight_update(weight_version=7)
    assert len(calls) == 3 and llm.weight_version == 7
    assert llm.generate([[1, 2]], use_tqdm=False)[0].weight_version == 7
    llm.begin_weight_update()  # an empty session still counts as an update
    assert llm.finish_weight_update() == [] and llm.weight_version == 8
    llm.begin_weight_update()
    with pytest.raises(ValueError, match="weight_version must be an int >= 0"):
        llm.finish_weight_update(weight_version=-1)
    assert llm.weights.in_session
    llm.abort_weight_update()
    assert llm.get_metrics()["weight_version"] == 8


def test_check_finite_and_chunk_types():
    check_finite("w", torch.tensor([1e38, 1e38, 1e38]), torch.float32)  # sum overflows: fine
    with pytest.raises(ValueError, match=r"'w' has 1 NaN/inf values \(of 3\)"):
        check_finite("w", torch.tensor([1.0, float("-inf"), 2.0]), torch.float32)
    with pytest.raises(ValueError, match=r"'w' has values in \[-1e\+05, 1\], beyond "
                                         r"torch.float16's range"):
        check_finite("w", torch.tensor([1.0, -1e5]), torch.float16)
    check_finite("w", torch.tensor([1.0, -6e4]), torch.float16)


def test_not_a_chunk_is_a_clear_error(dirs):
    llm = make(dirs[0])
    llm.begin_weight_update()
    with pytest.raises(TypeError, match="weights must be a \\(name, tensor\\) pair, a dict"):
        llm.load_weights(torch.zeros(3))
    llm.begin_weight_update()
    with pytest.raises(TypeError, match="weight names must be str"):
        llm.load_weights([(3, torch.zeros(3))])
    with pytest.raises(RuntimeError, match="no weight update session is open"):
        llm.load_weights([("model.norm.weight", torch.ones(64))])


@pytest.mark.skipif(not (kernels.avx512_available(torch.float32) or kernels.avx2_available()),
                    reason="needs AVX-512 or AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, glu", [(192, 64, False), (100, 64, False), (70, 10, False),
                                       (256, 96, True), (128, 33, False)])
def test_repack_in_place_equals_a_fresh_pack(dtype, n, k, glu):
    if dtype == torch.bfloat16 and not (kernels.avx512_available(dtype)
                                        or kernels.avx2_available()):
        pytest.skip("needs AVX-512 BF16 or AVX2")
    old, new = torch.randn(n, k).to(dtype), torch.randn(n, k).to(dtype)
    pw = kernels.prepack(old, glu)
    fresh = kernels.prepack(new, glu)
    again = kernels.prepack(new, glu, reuse=pw)
    assert torch.equal(again.packed, fresh.packed)
    assert again.is_current(new) and again.glu == fresh.glu
    assert (again.packed is pw.packed) == (dtype == torch.float32 or k % 2 == 0)
    x = torch.randn(5, k).to(dtype)
    assert torch.equal(kernels.linear(x, again) if not glu else kernels.linear_glu(x, again),
                       kernels.linear(x, fresh) if not glu else kernels.linear_glu(x, fresh))


def test_update_after_wake_and_generate_equals_fresh(dirs, sds):
    """sleep -> wake_up -> generate rebuilds the kernels' packed copies inside the forward's
    inference mode; a weight update then rewrites them in place (it used to raise)."""
    llm = make(dirs[0])
    run(llm, 4)
    llm.sleep(1)
    llm.wake_up()
    run(llm, 4)
    llm.update_weights(sds[1])
    assert run(llm) == run(make(dirs[1]))
