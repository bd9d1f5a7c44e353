"""Sleep and wake (``specengine.lifecycle.memory`` through ``LLM``): bytes released and given back,
the same outputs after waking, level 2 needs new weights, errors while asleep, an EAGLE drafter's
own layer survives."""

import pytest
import torch

from specengine import LLM, SamplingParams
from specengine.lifecycle.memory import process_rss_bytes
from specengine.models.loader import iter_safetensors, safetensors_files, save_random_model

KW = {"block_size": 8, "kv_cache_memory_bytes": 8 << 20}
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42, 43] * 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("m"), {"num_hidden_layers": 2}, seed=1)


@pytest.fixture(scope="module")
def tiny_sd(tiny):
    return dict(iter_safetensors(safetensors_files(tiny)))


def run(llm, n=12, **kw):
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1, **kw)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, p, use_tqdm=False)]
    return [o.token_ids for o in outs], [o.sampled_logprobs for o in outs]


def test_level1_releases_everything_and_wakes_to_the_same_outputs(tiny, tmp_path):
    offload = tmp_path / "offload"
    offload.mkdir()
    llm = LLM(str(tiny), dtype="float32", offload_dir=str(offload), **KW)
    before = run(llm)
    held = llm.memory.resident_bytes()
    assert held["weights"] == 4 * sum(p.numel() for p in llm.engine.runner.model.parameters())
    assert held["kv_cache"] == llm.engine.runner.kv_cache.numel() * 4 == 8 << 20
    released = llm.sleep(level=1)
    assert released == held  # every byte of weights, packed copies and KV
    assert llm.memory.resident_bytes()["total"] == 0
    assert llm.is_sleeping() and llm.get_metrics()["sleep_level"] == 1
    assert list(offload.iterdir()) == []  # the offload file is anonymous (unlinked)
    with pytest.raises(RuntimeError, match=r"asleep \(sleep\(level=1\): weights offloaded, KV "
                                           r"cache released\); call wake_up\(\)"):
        llm.generate(PROMPTS, use_tqdm=False)
    with pytest.raises(RuntimeError, match="asleep"):  # the engine itself refuses too
        llm.engine.add_request([1, 2], SamplingParams())
    llm.sleep(level=1)  # again: nothing more to do
    llm.wake_up(["weights"])
    assert llm.memory.resident_bytes()["weights"] == held["weights"]
    with pytest.raises(RuntimeError, match=r"asleep \(sleep\(level=1\): KV cache released\)"):
        llm.generate(PROMPTS, use_tqdm=False)
    llm.wake_up(["kv_cache", "cuda_graph"])
    llm.wake_up()  # idempotent
    assert not llm.is_sleeping() and llm.get_metrics()["sleep_level"] == 0
    assert run(llm) == before
    assert llm.memory.resident_bytes() == held  # packed copies rebuilt on use
    assert llm.weight_version == 0


def test_level2_needs_new_weights(tiny, tiny_sd, tmp_path):
    llm = LLM(str(tiny), dtype="float32", **KW)
    before = run(llm)
    llm.sleep(level=2)
    assert llm.memory.resident_bytes()["total"] == 0
    llm.wake_up()  # re-allocates, does not restore
    with pytest.raises(RuntimeError, match=r"discarded by sleep\(level=2\) and 21 of 21 tensors "
                                           r"have not been loaded since"):
        llm.generate(PROMPTS, use_tqdm=False)
    part = {k: v for k, v in tiny_sd.items() if not k.startswith("model.layers.1.")}
    llm.update_weights(part)
    with pytest.raises(RuntimeError, match=r"9 of 21 tensors .*'model.layers.1.input_layernorm"):
        llm.generate(PROMPTS, use_tqdm=False)
    llm.begin_weight_update()
    llm.load_weights({k: v for k, v in tiny_sd.items() if k.startswith("model.layers.1.")})
    llm.finish_weight_update()
    assert run(llm) == before and llm.weight_version == 2

    # a weight update straight after sleep(2) (no wake_up) brings the weights back itself
    llm.sleep(level=2)
    llm.load_weights(str(tiny))
    assert llm.memory.weights == "resident" and not llm.memory.missing
    with pytest.raises(RuntimeError, match="KV cache released"):
        llm.generate(PROMPTS, use_tqdm=False)
    llm.wake_up(["kv_cache"])
    assert run(llm) == before

    # level 2 after level 1 drops the offloaded copy; level 1 after 2 does not restore it
    llm.sleep(level=1)
    llm.sleep(level=2)
    llm.sleep(level=1)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="21 of 21 tensors"):
        llm.generate(PROMPTS, use_tqdm=False)
    llm.update_weights(tiny_sd)
    assert run(llm) == before


def test_update_while_asleep_at_level1_restores_then_applies(tiny, tiny_sd, tmp_path):
    other = save_random_model(tmp_path / "o", {"num_hidden_layers": 2}, seed=5)
    want = run(LLM(str(other), dtype="float32", **KW))
    llm = LLM(str(tiny), dtype="float32", **KW)
    llm.sleep(level=1)
    part = {k: v for k, v in iter_safetensors(safetensors_files(other))
            if k.startswith("model.layers.0.")}
    llm.update_weights(part)  # the offloaded weights come back first, then the subset
    llm.wake_up()
    llm.update_weights({k: v for k, v in iter_safetensors(safetensors_files(other))
                        if not k.startswith("model.layers.0.")})
    assert run(llm) == want


def test_bad_calls(tiny):
    llm = LLM(str(tiny), dtype="float32", **KW)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="level must be 1 .* or 2"):
            llm.sleep(level=level)
    with pytest.raises(ValueError, match=r"unknown tags \['weight'\]; known tags: \['weights', "
                                         r"'kv_cache', 'cuda_graph'\]"):
        llm.wake_up(["weight"])
    with pytest.raises(ValueError, match="tags must be None or a list"):
        llm.wake_up(3)
    llm.wake_up("weights")  # one tag as a str
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    it = llm.generate_iter(PROMPTS, [short, p, p], use_tqdm=False)
    next(it)
    with pytest.raises(RuntimeError, match="sleep: requests are in flight"):
        llm.sleep()
    list(it)
    assert not llm.is_sleeping()


def test_eagle_drafter_layer_survives_level2(tiny, tiny_sd):
    spec = {"method": "eagle", "model": "random", "policy": "static",
            "num_speculative_tokens": 3}
    llm = LLM(str(tiny), dtype="float32", speculative_config=spec, **KW)
    eagle = llm.engine.drafter.model
    own = {k: v.clone() for k, v in eagle.state_dict().items()}
    before = run(llm)
    steps = llm.get_metrics()["spec_steps"]
    assert steps > 0
    released = llm.sleep(level=2)
    assert released["kv_cache"] == (8 << 20) + llm.engine.drafter.kv.numel() * 4
    assert llm.engine.drafter.kv.untyped_storage().nbytes() == 0
    llm.wake_up()
    llm.update_weights(tiny_sd)
    for k, v in eagle.state_dict().items():
        assert torch.equal(v, own[k]), k
    assert run(llm) == before  # lossless, and the drafter drafts again
    assert llm.get_metrics()["spec_steps"] > 2 * steps - 1


def test_rss_drops_by_the_bytes_released(tmp_path):
    """Process RSS (not only tensor bookkeeping) goes down during a level-1 sleep."""
    if process_rss_bytes() is None:
        pytest.skip("needs /proc/self/statm")
    d = save_random_model(tmp_path / "m", {"num_hidden_layers": 4, "hidden_size": 256,
                                           "intermediate_size": 1024, "head_dim": 64,
                                           "vocab_size": 32000}, seed=3)
    llm = LLM(str(d), dtype="float32", block_size=16, kv_cache_memory_bytes=32 << 20)
    before = run(llm, 4)
    rss0 = process_rss_bytes()
    released = llm.sleep(level=1)["total"]
    rss1 = process_rss_bytes()
    assert released > 150 << 20
    assert rss0 - rss1 > 0.8 * released, (rss0 - rss1, released)
    llm.wake_up()
    assert process_rss_bytes() - rss1 > 0.5 * released  # weights and KV are back
    assert run(llm, 4) == before


@pytest.mark.integration
def test_default_model_sleep_level1_rss_and_outputs():
    llm = LLM(kv_cache_memory_bytes=256 << 20)
    kv = llm.engine.runner.kv_cache
    before = run(llm, 16)
    rss0 = process_rss_bytes()
    released = llm.sleep(level=1)
    rss1 = process_rss_bytes()
    print(f"default model: released {released}, RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
    assert released["weights"] > 250 << 20  # 135M bfloat16 parameters
    assert released["kv_cache"] == kv.numel() * 2 > 255 << 20
    assert rss0 - rss1 > 0.8 * released["total"]
    llm.wake_up()
    assert run(llm, 16) == before
