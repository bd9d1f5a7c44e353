"""Asynchronous and partial rollouts on tiny random models: pause modes (abort / keep /
retract), weight updates while paused with per-token weight versions, aborted requests
returning what they made, the prefix cache across weight updates (reset / keep_versioned).
Exactness is asserted token for token and logprob for logprob (the engine is batch-invariant:
see tests/test_determinism.py)."""

import pytest
from helpers import rand_prompts
from safetensors.torch import load_file

from specengine import LLM, SamplingParams, continuation_prompts
from specengine.models.loader import save_random_model

DTYPES = ["bfloat16", "float32"]


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """Weights of the same shapes as ``target_dir`` (2 layers) but another seed."""
    return save_random_model(tmp_path_factory.mktemp("other"), {"num_hidden_layers": 2}, seed=7)


def make(path, dtype="float32", spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 16 << 20)
    if spec is not None:
        spec = {"policy": "static", **spec}
    return LLM(str(path), dtype=dtype, block_size=8, speculative_config=spec, **kw)


def sp(seed=3, n=2, max_tokens=40):
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, logprobs=2)


def key(out):
    return [(tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in e.items()))
                                       for e in c.logprobs)) for c in out.outputs]


def start(llm, prompts, params, steps):
    """Queue ``prompts`` and run ``steps`` steps; returns the request ids and the outputs
    that finished meanwhile."""
    rids = [llm.add_request(p, params) for p in prompts]
    done = []
    for _ in range(steps):
        done += llm.step()
    return rids, done


def drain(llm):
    out = []
    while llm.has_unfinished_requests():
        out += llm.step()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["keep", "retract"])
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "ngram"])
def test_pause_and_resume_with_unchanged_weights_changes_nothing(target_dir, dtype, mode,
                                                                 spec):
    prompts = [p * 2 for p in rand_prompts(4, lo=5, hi=20, seed=5)]
    want = sorted(key(o) for o in make(target_dir, dtype, spec).generate(
        prompts, sp(), use_tqdm=False))
    llm = make(target_dir, dtype, spec)
    _, done = start(llm, prompts, sp(), 6)
    report = llm.pause_generation(mode)
    assert report["mode"] == mode and llm.is_paused()
    assert report["retracted"] == (report["running"] if mode == "retract" else 0)
    assert llm.step() == []  # nothing runs while paused
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate(prompts[:1], sp(), use_tqdm=False)
    if mode == "retract":
        assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    llm.resume_generation()
    got = sorted(key(o) for o in done + drain(llm))
    assert got == want


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_weight_update_while_paused_tags_each_token(target_dir, other_dir, mode):
    """Weights pushed while paused: the samples continue on the new version; each token
    carries the version that sampled it; ``keep`` continues on the old KV, ``retract``
    recomputes it (its continuation then equals a fresh engine of the new weights fed the
    same tokens)."""
    prompts = rand_prompts(3, lo=5, hi=20, seed=9)
    llm = make(target_dir)
    _, done = start(llm, prompts, sp(max_tokens=30), 8)
    assert not done
    with pytest.raises(RuntimeError, match="in flight"):
        llm.update_weights(load_file(str(other_dir / "model.safetensors")))
    llm.pause_generation(mode)
    llm.update_weights(load_file(str(other_dir / "model.safetensors")))
    llm.resume_generation()
    outs = drain(llm)
    assert len(outs) == 3
    for o in outs:
        assert o.weight_version == 1
        for c in o.outputs:
            v = c.weight_versions
            assert len(v) == len(c.token_ids) == 30
            assert v == sorted(v) and v[0] == 0 and v[-1] == 1 and 0 < v.count(0) < 30
    if mode == "retract":  # the continuation is what the new weights give after these tokens
        o, c = outs[0], outs[0].outputs[0]
        k = c.weight_versions.count(0)
        fresh = make(other_dir)
        sc = fresh.score([o.prompt_token_ids], [c.token_ids], sp(max_tokens=30))[0]
        assert sc.logprobs[k:] == [e[t].logprob for e, t in zip(c.logprobs[k:],
                                                                  c.token_ids[k:])]


def test_abort_returns_what_was_made(target_dir):
    llm = make(target_dir)
    prompts = rand_prompts(3, lo=5, hi=20, seed=13)
    rids, _ = start(llm, prompts, sp(max_tokens=50), 5)
    out = llm.abort_request(rids[1])
    assert out is not None and out.finished and out.request_id == rids[1]
    for c in out.outputs:
        assert c.finish_reason == "abort" and len(c.token_ids) >= 4
        assert len(c.logprobs) == len(c.weight_versions) == len(c.token_ids)
    assert llm.abort_request(rids[1]) is None and llm.abort_request("nope") is None
    # the aborted tokens are the ones an uninterrupted run would have made
    full = make(target_dir).generate([prompts[1]], sp(max_tokens=50), use_tqdm=False)[0]
    for a, b in zip(out.outputs, full.outputs):
        assert list(a.token_ids) == list(b.token_ids[:len(a.token_ids)])
    report = llm.pause_generation("abort")
    assert sorted(o.request_id for o in report["aborted"]) == sorted([rids[0], rids[2]])
    assert all(c.finish_reason == "abort" for o in report["aborted"] for c in o.outputs)
    llm.resume_generation()
    assert not llm.has_unfinished_requests()
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_pause_mode_is_checked(target_dir):
    with pytest.raises(ValueError, match="pause mode"):
        make(target_dir).pause_generation("sometimes")


@pytest.mark.parametrize("policy", ["reset", "keep_versioned"])
def test_prefix_cache_across_weight_updates(target_dir, other_dir, policy):
    """``reset`` forgets the cache on an update; ``keep_versioned`` keeps it, but a request
    of the new version never hits blocks of the old one (and outputs equal a fresh engine of
    the new weights)."""
    prompts = rand_prompts(3, lo=30, hi=40, seed=17)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = make(target_dir, prefix_cache_policy=policy)
    llm.generate(prompts, greedy, use_tqdm=False)
    cached = llm.engine.blocks.num_cached_blocks
    assert cached > 0
    llm.update_weights(load_file(str(other_dir / "model.safetensors")))
    assert llm.engine.blocks.num_cached_blocks == (0 if policy == "reset" else cached)
    h = llm.get_metrics()["prefix_cache_hit_tokens"]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert llm.get_metrics()["prefix_cache_hit_tokens"] == h  # nothing stale was found
    fresh = make(other_dir)
    assert got == [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy,
                                                                    use_tqdm=False)]
    llm.generate(prompts, greedy, use_tqdm=False)  # the new version's blocks are found
    assert llm.get_metrics()["prefix_cache_hit_tokens"] > h
    with pytest.raises(ValueError, match="prefix_cache_policy"):
        make(target_dir, prefix_cache_policy="sometimes")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "ngram"])
def test_continued_partial_samples_equal_uninterrupted_ones(target_dir, dtype, spec):
    """Aborted mid-flight, continued with ``continuation_prompts`` and the same params:
    tokens, logprobs (recomputed for the partial part) and versions equal a run never
    interrupted; penalties and min_tokens count the partial tokens as output."""
    prompts = [p * 2 for p in rand_prompts(3, lo=5, hi=20, seed=21)]
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=11, max_tokens=40,
                            min_tokens=30, repetition_penalty=1.3, logprobs=2)
    want = make(target_dir, dtype, spec).generate(prompts, params, use_tqdm=False)
    llm = make(target_dir, dtype, spec)
    rids, done = start(llm, prompts, params, 9)
    assert not done
    partial = [llm.abort_request(r) for r in rids]
    conts = [p for out in partial for p in continuation_prompts(out)]
    assert len(conts) == 9 and all(0 < len(c["partial"]["token_ids"]) < 40 for c in conts)
    got = llm.generate(conts, params, use_tqdm=False)
    for k, out in enumerate(got):
        (c,) = out.outputs
        w = want[k // 3].outputs[c.index]
        assert c.token_ids == w.token_ids and c.weight_versions == w.weight_versions
        assert c.logprobs == w.logprobs and c.cumulative_logprob == w.cumulative_logprob
        assert c.finish_reason == "length"


def test_partial_is_checked(target_dir):
    llm = make(target_dir)
    p = SamplingParams(max_tokens=5)
    for part, msg in [({"token_ids": [10**6]}, "vocabulary"),
                      ({"token_ids": [1] * 5}, "nothing is left"),
                      ({"token_ids": [1], "weight_versions": [0, 0]}, "weight versions"),
                      ({"token_ids": [1], "index": -1}, "index"),
                      ({"tokens": [1]}, "partial")]:
        with pytest.raises(ValueError, match=msg):
            llm.generate([{"prompt_token_ids": [1, 2], "partial": part}], p, use_tqdm=False)


def test_server_pause_keep_update_resume_and_abort(tiny_llama_tok_dir, tmp_path):
    """Over HTTP with vLLM's routes (what TRL's async GRPO calls): requests in flight survive
    ``/pause?mode=keep``, a weight push while paused, and ``/resume``; their tokens carry
    both versions; ``/pause?mode=abort`` ends the rest with their partial output."""
    pytest.importorskip("fastapi")
    import threading

    import requests
    from test_server import Server

    from specengine.server.app import build_app

    llm = make(tiny_llama_tok_dir)
    other = save_random_model(tmp_path / "o", {"tie_word_embeddings": True},
                              tokenizer_from=tiny_llama_tok_dir, seed=9)
    body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 60, "temperature": 1.0,
            "seed": 2, "ignore_eos": True, "return_token_ids": True}
    results = {}
    with Server(build_app(llm, "tiny", enable_control_routes=True,
                          allowed_weight_dirs=[str(tmp_path)])) as s:
        def post(name, b):
            results[name] = requests.post(f"{s.url}/v1/completions", json=b, timeout=120)

        def wait_running(k):
            while len(llm.engine.scheduler.running) < k:
                pass

        a = threading.Thread(target=post, args=("a", body))
        a.start()
        wait_running(1)
        r = requests.post(f"{s.url}/pause", params={"mode": "keep"}, timeout=30)
        assert r.status_code == 200 and r.json()["mode"] == "keep", r.text
        assert requests.get(f"{s.url}/is_paused", timeout=30).json() == {"is_paused": True}
        r = requests.post(f"{s.url}/update_weights_from_disk",
                          json={"model_path": str(other)}, timeout=60)
        assert r.status_code == 200, r.text
        assert requests.post(f"{s.url}/resume", timeout=30).status_code == 200
        a.join(120)
        c = results["a"].json()["choices"][0]
        v = c["weight_versions"]
        assert len(v) == len(c["token_ids"]) == 60 and v[0] == 0 and v[-1] == 1
        b = threading.Thread(target=post, args=("b", {**body, "max_tokens": 200}))
        b.start()
        wait_running(1)
        while not llm.engine.requests or not any(
                s.num_output_tokens for r in llm.engine.requests.values() for s in r.seqs):
            pass
        r = requests.post(f"{s.url}/pause", json={"mode": "abort"}, timeout=30)
        assert r.status_code == 200 and r.json()["aborted"] == 1, r.text
        b.join(120)
        c = results["b"].json()["choices"][0]
        assert c["finish_reason"] == "abort" and 0 < len(c["token_ids"]) < 200
        assert requests.post(f"{s.url}/pause", params={"mode": "bogus"},
                             timeout=30).status_code == 400
        assert requests.post(f"{s.url}/continue_generation", timeout=30).status_code == 200
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_trl_async_grpo_client_drives_the_server(tiny_llama_tok_dir):
    """TRL 1.16's experimental async GRPO talks to its server through
    ``trl.experimental.async_grpo.vllm_client.VLLMClient`` (readiness, model length, pause /
    resume around weight updates) and posts token-id prompts to ``/v1/completions`` reading
    ``token_ids`` and ``logprobs.token_logprobs``; all of that runs against specengine (its
    NCCL weight transfer cannot run on a CPU machine)."""
    pytest.importorskip("fastapi")
    vc = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
    import threading

    import requests
    from accelerate import PartialState
    from test_server import Server

    from specengine.server.app import build_app

    PartialState()  # TRL logs through accelerate, as its trainer process does
    llm = make(tiny_llama_tok_dir)
    payload = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 50, "temperature": 1.0,
               "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "n": 1,
               "return_token_ids": True, "logprobs": 0, "seed": 12345}
    with Server(build_app(llm, "tiny", enable_control_routes=True)) as s:
        client = vc.VLLMClient(s.url, server_timeout=30)
        client.wait_for_server_ready(poll_interval_s=0.1)
        assert client.get_max_model_len() == llm.engine_config.max_model_len
        got = {}
        t = threading.Thread(target=lambda: got.update(r=requests.post(
            f"{s.url}/v1/completions", json=payload, timeout=120)))
        t.start()
        while not llm.engine.scheduler.running:
            pass
        client.pause()
        client.resume()
        t.join(120)
    choice = got["r"].json()["choices"][0]
    want = make(tiny_llama_tok_dir).generate([[5, 6, 7]], SamplingParams(
        max_tokens=50, temperature=1.0, seed=12345, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert choice["token_ids"] == want.token_ids
    assert choice["logprobs"]["token_logprobs"] == want.sampled_logprobs
