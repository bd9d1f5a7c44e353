"""The server's RL control routes (``control_routes``): sleep / wake-up (vLLM's and SGLang's
names), weights from disk, the weight version, and a streamed weight session over HTTP. A
uvicorn server runs in-process over a tiny random-weight model with SmolLM2's tokenizer (as in
``test_server``); every output is compared token for token with offline ``LLM.generate`` on
another engine of the same weights."""

from __future__ import annotations

import base64
import json
import threading
import time

import pytest
import requests
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_server import Server, make_llm, post  # noqa: E402

from specengine import SamplingParams  # noqa: E402
from specengine.models.loader import iter_safetensors, safetensors_files, save_random_model  # noqa: E402,I001
from specengine.server.app import build_app  # noqa: E402

PROMPT = "The weather today"
GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def new_weights_dir(tmp_path_factory, default_model_dir):
    """A checkpoint of other weights for the same architecture (what a trainer saves)."""
    return save_random_model(tmp_path_factory.mktemp("new_weights"),
                             {"tie_word_embeddings": True}, tokenizer_from=default_model_dir,
                             seed=5)


@pytest.fixture(scope="module")
def ref(tiny_llama_tok_dir):
    return make_llm(tiny_llama_tok_dir)


@pytest.fixture(scope="module")
def fresh_new(new_weights_dir):
    """A fresh engine loaded from the new checkpoint."""
    return make_llm(new_weights_dir)


def offline(llm, prompt=PROMPT, **kw) -> list[int]:
    return llm.generate([prompt], SamplingParams(**{**GREEDY, **kw}),
                        use_tqdm=False)[0].outputs[0].token_ids


def complete(s, prompt=PROMPT, **kw) -> requests.Response:
    return post(s, "/v1/completions", {"prompt": prompt, "return_token_ids": True,
                                       **GREEDY, **kw})


def ids(r: requests.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def get(s, route) -> dict:
    r = requests.get(f"{s.url}{route}", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def error(r: requests.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def asleep_error(r: requests.Response, words: str) -> None:
    e = error(r, 503)
    assert (e["type"], e["code"]) == ("service_unavailable", "engine_sleeping")
    assert words in e["message"], e["message"]


def test_sleep_refuses_generation_then_wake_restores(tiny_llama_tok_dir, ref):
    llm = make_llm(tiny_llama_tok_dir)
    want = offline(ref)
    with Server(build_app(llm, "tiny", enable_control_routes=True)) as s:
        assert ids(complete(s)) == want
        r = post(s, "/sleep", {"level": 1})
        assert r.status_code == 200, r.text
        released = r.json()["released_bytes"]
        assert released["weights"] > 0 and released["kv_cache"] > 0
        assert get(s, "/is_sleeping") == {"is_sleeping": True}
        asleep_error(complete(s), "asleep (sleep(level=1)")
        asleep_error(post(s, "/generate/", {"prompts": [PROMPT], "max_tokens": 4}), "asleep")
        asleep_error(post(s, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "stream": True}), "asleep")
        r = post(s, "/wake_up", {"tags": ["weights"]})
        assert r.status_code == 200 and r.json() == {"success": True, "is_sleeping": True}
        asleep_error(complete(s), "KV cache released")
        r = post(s, "/wake_up", {"tags": ["kv_cache"]})
        assert r.json() == {"success": True, "is_sleeping": False}
        assert ids(complete(s)) == want
        # vLLM's query-parameter forms
        assert requests.post(f"{s.url}/sleep?level=1", timeout=60).status_code == 200
        r = requests.post(f"{s.url}/wake_up?tags=weights&tags=kv_cache", timeout=60)
        assert r.json()["is_sleeping"] is False
        assert ids(complete(s)) == want
        # errors
        e = error(post(s, "/sleep", {"level": 3}))
        assert e["param"] == "level" and e["message"].startswith("sleep: level must be 1")
        assert error(post(s, "/sleep", {"level": "2"}))["param"] == "level"
        assert error(requests.post(f"{s.url}/sleep?level=x", timeout=60))["param"] == "level"
        assert error(post(s, "/sleep", {"levl": 1}))["message"] == "unknown field 'levl'"
        e = error(post(s, "/wake_up", {"tags": ["gpu"]}))
        assert e["message"] == ("wake_up: unknown tags ['gpu']; known tags: ['weights', "
                                "'kv_cache', 'cuda_graph']") and e["param"] == "tags"
        assert error(post(s, "/wake_up", {"tags": "weights"}))["param"] == "tags"
        assert get(s, "/is_sleeping") == {"is_sleeping": False}
        assert ids(complete(s)) == want


def test_sleep_waits_for_requests_in_flight(tiny_llama_tok_dir, ref):
    """A request in flight finishes on the awake engine before the sleep runs; one that
    arrives while the sleep waits is held back, then refused (503), never run asleep."""
    llm = make_llm(tiny_llama_tok_dir)
    want = offline(ref, max_tokens=200)
    app = build_app(llm, "tiny", enable_control_routes=True)
    loop = app.state.server.engine
    with Server(app) as s:
        stream = requests.post(f"{s.url}/v1/completions", stream=True, timeout=60, json={
            "prompt": PROMPT, **GREEDY, "max_tokens": 200, "stream": True,
            "return_token_ids": True})
        lines = stream.iter_lines()
        first = next(line for line in lines if line)  # in flight
        results = {}
        sleeper = threading.Thread(target=lambda: results.update(
            sleep=post(s, "/sleep", {"level": 1})))
        sleeper.start()
        deadline = time.time() + 30
        while not loop._exclusive:  # the sleep is queued, waiting for the request
            assert time.time() < deadline
            time.sleep(0.005)
        late = threading.Thread(target=lambda: results.update(late=complete(s)))
        late.start()
        while not loop._deferred:  # the late request is held back behind the sleep
            assert time.time() < deadline
            time.sleep(0.005)
        got = json.loads(first[6:])["choices"][0]["token_ids"]
        for line in lines:
            if line.startswith(b"data: {"):
                got += json.loads(line[6:])["choices"][0]["token_ids"]
        sleeper.join(30)
        late.join(30)
        assert got == want
        assert results["sleep"].status_code == 200
        asleep_error(results["late"], "asleep")
        post(s, "/wake_up", {})
        assert ids(complete(s, max_tokens=200)) == want


def test_level2_update_from_disk_equals_fresh_engine(tiny_llama_tok_dir, new_weights_dir,
                                                      fresh_new, ref):
    llm = make_llm(tiny_llama_tok_dir)
    old, new = offline(ref), offline(fresh_new)
    assert old != new
    app = build_app(llm, "tiny", enable_control_routes=True,
                    allowed_weight_dirs=[tiny_llama_tok_dir, new_weights_dir])
    with Server(app) as s:
        assert get(s, "/get_weight_version") == {"weight_version": 0}
        assert post(s, "/sleep", {"level": 2}).status_code == 200
        asleep_error(complete(s), "asleep (sleep(level=2): weights discarded")
        assert post(s, "/wake_up", {"tags": None}).json()["is_sleeping"] is False
        asleep_error(complete(s), "discarded by sleep(level=2)")  # awake, nothing loaded
        r = post(s, "/update_weights_from_disk", {"model_path": str(new_weights_dir)})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["success"] is True and body["weight_version"] == 1
        assert body["num_tensors"] == len(llm.engine.runner.model.hf_parameters())
        assert get(s, "/get_weight_version") == {"weight_version": 1}
        assert get(s, "/weight_info") == {"weight_version": 1}
        assert ids(complete(s)) == new
        # SGLang sends the version as a string; back to the old weights from their directory
        r = post(s, "/update_weights_from_disk", {"model_path": str(tiny_llama_tok_dir),
                                                  "weight_version": "7", "flush_cache": True,
                                                  "abort_all_requests": True})
        assert r.json()["weight_version"] == 7
        assert ids(complete(s)) == old
        # errors: nothing changes
        e = error(post(s, "/update_weights_from_disk", {"model_path": "/no/such/dir"}))
        assert e["param"] == "model_path" and "--allowed-weight-dirs" in e["message"]
        e = error(post(s, "/update_weights_from_disk", {"model_path": str(new_weights_dir),
                                                        "weight_version": "v2"}))
        assert e["param"] == "weight_version"
        e = error(post(s, "/update_weights_from_disk", {"model_path": str(new_weights_dir),
                                                        "load_format": "gguf"}))
        assert e["param"] == "load_format"
        assert error(post(s, "/update_weights_from_disk", {}))["message"] == \
            "field 'model_path' is required"
        assert get(s, "/get_weight_version") == {"weight_version": 7}
        assert ids(complete(s)) == old


def b64(t: torch.Tensor) -> dict:
    t = t.contiguous()
    return {"dtype": str(t.dtype), "shape": list(t.shape),
            "data": base64.b64encode(t.view(torch.uint8).numpy().tobytes()).decode()}


def test_streamed_session_over_http(tiny_llama_tok_dir, new_weights_dir, ref):
    """start -> update_weights (raw bytes, single JSON, JSON buckets; float32 and bfloat16)
    -> finish equals a one-call update_weights of the same tensors; the old weights serve
    until finish; abort keeps them; chunks with no session open are 400s."""
    llm = make_llm(tiny_llama_tok_dir)
    new = dict(iter_safetensors(safetensors_files(new_weights_dir)))
    names = sorted(new)
    new[names[0]] = new[names[0]].to(torch.bfloat16)  # any float dtype, cast on load
    old_ids = offline(ref)
    with Server(build_app(llm, "tiny", enable_control_routes=True)) as s:
        assert post(s, "/start_weight_update", {"is_checkpoint_format": True}).json() == {
            "message": "Weight update started"}
        first = new[names[0]]
        r = requests.post(f"{s.url}/update_weights",
                          data=first.view(torch.uint8).numpy().tobytes(),
                          params={"name": names[0], "dtype": "bfloat16",
                                  "shape": ",".join(map(str, first.shape))},
                          headers={"content-type": "application/octet-stream"}, timeout=60)
        assert r.status_code == 200 and r.json()["names"] == [names[0]]
        r = post(s, "/update_weights", {"name": names[1], **b64(new[names[1]])})
        assert r.json()["names"] == [names[1]]
        rest = names[2:]
        for i in range(0, len(rest), 4):
            bucket = [{"name": n, **b64(new[n])} for n in rest[i:i + 4]]
            r = post(s, "/update_weights", {"named_tensors": bucket})
            assert r.status_code == 200 and r.json()["names"] == rest[i:i + 4]
        assert ids(complete(s)) == old_ids  # staged, not applied
        assert get(s, "/get_weight_version") == {"weight_version": 0}
        r = post(s, "/finish_weight_update", {})
        assert r.json() == {"message": "Weight update finished", "weight_version": 1,
                            "num_tensors": len(names)}
        got = ids(complete(s))
        one_call = make_llm(tiny_llama_tok_dir)
        one_call.update_weights(new)
        assert got == offline(one_call) and got != old_ids

        # abort keeps the weights serving now
        norm = "model.norm.weight"
        assert post(s, "/start_weight_update", None).status_code == 200
        e = error(post(s, "/start_weight_update", {}))
        assert "already open" in e["message"]
        assert post(s, "/update_weights",
                    {"name": norm, **b64(new[norm] * -3)}).status_code == 200
        assert post(s, "/abort_weight_update", {}).json() == {
            "message": "Weight update aborted", "aborted": True}
        assert post(s, "/abort_weight_update", {}).json()["aborted"] is False
        assert ids(complete(s)) == got
        e = error(post(s, "/update_weights", {"name": norm, **b64(new[norm])}))
        assert e["message"].startswith("no weight update session is open")
        e = error(post(s, "/finish_weight_update", {}))
        assert e["message"].startswith("no weight update session is open")

        # a bad chunk mid-session aborts it: nothing applied
        post(s, "/start_weight_update", {})
        assert post(s, "/update_weights",
                    {"name": norm, **b64(new[norm] * -3)}).status_code == 200
        e = error(post(s, "/update_weights",
                       {"named_tensors": [{"name": norm, **b64(new[norm][:5])}]}))
        assert e["message"].startswith(f"weight {norm!r} has shape (5,), expected (64,)")
        e = error(post(s, "/finish_weight_update", {"weight_version": 9}))
        assert "was aborted" in e["message"]
        e = error(post(s, "/update_weights", {"name": norm, "dtype": "float32",
                                              "shape": [64]}))
        assert e["param"] == "data" and "no NCCL communicator" in e["message"]
        assert error(post(s, "/update_weights", {"name": norm}))["message"] == \
            "field 'dtype' is required"
        assert error(post(s, "/start_weight_update", {"is_checkpoint_format": False}))[
            "param"] == "is_checkpoint_format"
        assert get(s, "/get_weight_version") == {"weight_version": 1}
        assert ids(complete(s)) == got


def test_sglang_memory_aliases_and_flush_cache(tiny_llama_tok_dir, ref):
    llm = make_llm(tiny_llama_tok_dir)
    want = offline(ref)
    mem = llm.memory
    with Server(build_app(llm, "tiny", enable_control_routes=True)) as s:
        r = post(s, "/release_memory_occupation", {})
        assert r.status_code == 200 and r.json()["released_bytes"]["weights"] > 0
        assert (mem.weights, mem.kv_resident) == ("offloaded", False)
        asleep_error(complete(s), "asleep")
        assert post(s, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
        assert post(s, "/resume_memory_occupation",
                    {"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
        assert ids(complete(s)) == want
        # the KV cache only: the weights stay resident
        r = post(s, "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert r.status_code == 200
        assert (mem.weights, mem.kv_resident) == ("resident", False)
        asleep_error(complete(s), "KV cache released")
        assert post(s, "/resume_memory_occupation", {}).status_code == 200
        assert ids(complete(s)) == want
        e = error(post(s, "/release_memory_occupation", {"tags": ["gpu"]}))
        assert e["param"] == "tags" and "unknown tags ['gpu']" in e["message"]
        assert get(s, "/flush_cache")["success"] is True
        assert post(s, "/flush_cache", None).json()["success"] is True
        assert post(s, "/reset_prefix_cache", None).json() == {"success": True}
        assert not mem.is_sleeping
