"""``specengine serve``: a uvicorn server started in-process on 127.0.0.1 (a free port) over a
tiny random-weight model with SmolLM2's tokenizer, driven by the real ``openai`` client,
``requests`` and TRL's own ``VLLMClient``; every output is compared token for token with
offline ``LLM.generate`` / ``LLM.chat`` on a second engine of the same model."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import requests
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from specengine import LLM, SamplingParams  # noqa: E402
from specengine.server.app import build_app  # noqa: E402
from specengine.server.protocol import sampling_fields  # noqa: E402

MAX_LEN = 256
CONV = [{"role": "user", "content": "What is 17 * 23?"}]


def make_llm(path) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20,
               max_model_len=MAX_LEN)


class Server:
    """uvicorn serving ``app`` in a thread on a socket bound to 127.0.0.1:0."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def llm(tiny_llama_tok_dir):
    return make_llm(tiny_llama_tok_dir)


@pytest.fixture(scope="module")
def ref(tiny_llama_tok_dir):
    """The offline reference: a second engine of the same model."""
    return make_llm(tiny_llama_tok_dir)


@pytest.fixture(scope="module")
def server(llm):
    with Server(build_app(llm, "tiny", enable_control_routes=True)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key="none", base_url=f"{server.url}/v1", max_retries=0)


def metrics(server) -> dict:
    r = requests.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200
    return r.json()


def wait_idle(server, timeout=10.0) -> dict:
    """Metrics once every KV block is back in the pool."""
    deadline = time.time() + timeout
    while True:
        m = metrics(server)
        if m["kv_blocks_free"] == m["kv_blocks_total"] or time.time() > deadline:
            return m
        time.sleep(0.05)


def offline(ref, prompt, **kw):
    return ref.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


# ---- OpenAI routes ---------------------------------------------------------------------------
def test_completion_greedy_equals_offline(client, ref):
    r = client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=12,
                                  temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    want = offline(ref, "def fib(n):", temperature=0, max_tokens=12, ignore_eos=True)
    (c,) = r.choices
    assert c.token_ids == want.outputs[0].token_ids and len(c.token_ids) == 12
    assert c.text == want.outputs[0].text
    assert c.prompt_token_ids == want.prompt_token_ids
    assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == 12 + len(want.prompt_token_ids)
    assert r.model == "tiny" and r.object == "text_completion"


def test_chat_seeded_n_equals_offline(client, ref):
    r = client.chat.completions.create(
        model="tiny", messages=CONV, n=3, seed=5, temperature=0.9, top_p=0.95, max_tokens=10,
        extra_body={"top_k": 50, "min_p": 0.01, "return_token_ids": True})
    want = ref.chat(CONV, SamplingParams(n=3, seed=5, temperature=0.9, top_p=0.95, top_k=50,
                                         min_p=0.01, max_tokens=10), use_tqdm=False)[0]
    assert [c.index for c in r.choices] == [0, 1, 2]
    got = {c.index: c for c in r.choices}
    for o in want.outputs:
        assert got[o.index].token_ids == o.token_ids
        assert got[o.index].message.content == o.text
        assert got[o.index].message.role == "assistant"
    assert len({tuple(o.token_ids) for o in want.outputs}) > 1  # the samples differ
    assert r.prompt_token_ids == want.prompt_token_ids
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)


def test_completion_token_prompts_n_logprobs(client, ref, llm):
    tok = llm.get_tokenizer()
    p0, p1 = tok("The capital of").input_ids, tok("Once upon a time").input_ids
    r = client.completions.create(
        model="tiny", prompt=[p0, p1], n=2, seed=9, temperature=1.0, max_tokens=6, logprobs=2,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    assert len(r.choices) == 4
    for i, p in enumerate([p0, p1]):
        want = ref.generate([p], SamplingParams(n=2, seed=9, temperature=1.0, max_tokens=6,
                                                logprobs=2), use_tqdm=False)[0]
        for o in want.outputs:
            c = r.choices[i * 2 + o.index]
            assert c.index == i * 2 + o.index
            assert c.prompt_token_ids == p and c.token_ids == o.token_ids
            lp = c.logprobs
            assert lp.tokens == [f"token_id:{t}" for t in o.token_ids]
            for t, v, top, e in zip(o.token_ids, lp.token_logprobs, lp.top_logprobs,
                                    o.logprobs):
                assert v == pytest.approx(e[t].logprob, abs=1e-5)
                assert set(top) == {f"token_id:{k}" for k in e}
                assert len(top) in (2, 3)  # the top 2, plus the sampled token if not in them


def test_chat_logprobs_top(client, ref):
    r = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    want = ref.chat(CONV, SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                         ignore_eos=True), use_tqdm=False)[0].outputs[0]
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry, t, e in zip(content, want.token_ids, want.logprobs):
        assert entry.logprob == pytest.approx(e[t].logprob, abs=1e-5)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top token
        values = [x.logprob for x in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_stream_completion_equals_offline(client, ref):
    want = offline(ref, "Hello there", temperature=0, max_tokens=16, ignore_eos=True)
    chunks = list(client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert len(finishes) > 2  # streamed in pieces, not all at the end
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_stream_stop_string(client, ref):
    full = offline(ref, "Hello there", temperature=0, max_tokens=24, ignore_eos=True)
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    want = offline(ref, "Hello there", temperature=0, max_tokens=24, ignore_eos=True,
                   stop=[stop]).outputs[0]
    assert want.finish_reason == "stop"
    chunks = list(client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=24, temperature=0, stop=[stop],
        stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_stream_chat_n(client, ref):
    want = ref.chat(CONV, SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=12),
                    use_tqdm=False)[0]
    texts, roles, finish = {0: "", 1: ""}, {}, {}
    for c in client.chat.completions.create(model="tiny", messages=CONV, n=2, seed=3,
                                            temperature=1.0, max_tokens=12, stream=True):
        for ch in c.choices:
            if ch.delta.role:
                roles[ch.index] = ch.delta.role
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {o.index: o.text for o in want.outputs}
    assert finish == {o.index: o.finish_reason for o in want.outputs}


def test_concurrent_requests_batched(client, ref, server):
    before = metrics(server)["server"]
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(16)]

    def one(i):
        return client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=32, temperature=1.0, seed=i,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    after = wait_idle(server)
    for i, ids in enumerate(got):
        want = offline(ref, prompts[i], max_tokens=32, temperature=1.0, seed=i,
                       ignore_eos=True)
        assert ids == want.outputs[0].token_ids
    steps = after["server"]["steps"] - before["steps"]
    assert steps < 16 * 32  # tokens of several requests per step
    assert after["server"]["max_batch_seqs"] > 1
    assert after["kv_blocks_free"] == after["kv_blocks_total"]


BAD = [  # (body or raw bytes, route, status, param)
    (b"{not json", "/v1/completions", 400, None),
    (b"[1, 2]", "/v1/completions", 400, None),
    ({"prompt": "x", "foo": 1}, "/v1/completions", 400, "foo"),
    ({"prompt": "x", "temperature": -1}, "/v1/completions", 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, "/v1/completions", 400, "top_p"),
    ({"prompt": "x", "n": 0}, "/v1/completions", 400, "n"),
    ({"prompt": "x", "max_tokens": 0}, "/v1/completions", 400, "max_tokens"),
    ({"prompt": "x", "logprobs": 50}, "/v1/completions", 400, "logprobs"),
    ({"prompt": "x", "temperature": "hot"}, "/v1/completions", 400, "temperature"),
    ({"prompt": [7] * MAX_LEN}, "/v1/completions", 400, "prompt"),
    ({"prompt": [10 ** 6]}, "/v1/completions", 400, "prompt"),
    ({"prompt": "x", "max_tokens": MAX_LEN}, "/v1/completions", 400, "max_tokens"),
    ({"prompt": "x", "model": "gpt-9"}, "/v1/completions", 404, "model"),
    ({"prompt": "x", "echo": True}, "/v1/completions", 400, "echo"),
    ({"messages": []}, "/v1/chat/completions", 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}], "stream": True}, "/v1/chat/completions", 400,
     "messages[0].content"),
    ({"messages": CONV, "top_logprobs": 2}, "/v1/chat/completions", 400, "top_logprobs"),
    ({"messages": CONV, "min_p": 2.0}, "/v1/chat/completions", 400, "min_p"),
    ({"messages": CONV, "max_completion_tokens": MAX_LEN}, "/v1/chat/completions", 400,
     "max_completion_tokens"),
    ({"messages": CONV, "stream": True, "top_k": -5}, "/v1/chat/completions", 400, "top_k"),
    ({"prompts": ["x"], "top_k": 1.5}, "/generate/", 400, "top_k"),
    ({"prompts": ["x"], "generation_kwargs": {"bogus": 1}}, "/generate/", 400,
     "generation_kwargs.bogus"),
]


def post(server, route, body, **kw):
    if isinstance(body, bytes):
        return requests.post(f"{server.url}{route}", data=body, timeout=60,
                             headers={"content-type": "application/json"}, **kw)
    return requests.post(f"{server.url}{route}", json=body, timeout=60, **kw)


def test_bad_requests_interleaved_with_good(client, ref, server):
    def good(i):
        if i % 2:
            return [c.choices[0].text for c in client.completions.create(
                model="tiny", prompt=f"Item {i}", max_tokens=20, temperature=0, stream=True,
                extra_body={"ignore_eos": True})]
        return client.completions.create(model="tiny", prompt=f"Item {i}", max_tokens=20,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ).choices[0].text

    def bad(case):
        body, route, status, param = case
        r = post(server, route, body)
        return r.status_code, r.json()

    with ThreadPoolExecutor(12) as pool:
        goods = [pool.submit(good, i) for i in range(8)]
        bads = [pool.submit(bad, case) for case in BAD]
        good_out = [f.result() for f in goods]
        bad_out = [f.result() for f in bads]
    for (body, _route, status, param), (code, js) in zip(BAD, bad_out):
        assert code == status, (body, js)
        err = js["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param, (body, err)
    for i, out in enumerate(good_out):
        text = "".join(out) if isinstance(out, list) else out
        assert text == offline(ref, f"Item {i}", temperature=0, max_tokens=20,
                               ignore_eos=True).outputs[0].text
    m = wait_idle(server)
    assert m["kv_blocks_free"] == m["kv_blocks_total"]


def test_error_messages(server):
    js = post(server, "/v1/completions", {"prompt": "x", "temperature": -1}).json()["error"]
    assert js["message"] == "SamplingParams.temperature=-1.0: must be >= 0"
    js = post(server, "/v1/completions", {"prompt": "x", "foo": 1}).json()["error"]
    assert js["message"] == "unknown field 'foo'" and js["type"] == "invalid_request_error"
    js = post(server, "/v1/completions", {"prompt": [7] * MAX_LEN}).json()["error"]
    assert f"the prompt has {MAX_LEN} tokens" in js["message"]
    js = post(server, "/v1/completions", {"prompt": "x", "max_tokens": MAX_LEN}).json()
    assert "maximum context length is 256 tokens" in js["error"]["message"]
    r = requests.get(f"{server.url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found: GET /v1/nothing"


@pytest.fixture
def slow_steps(llm, monkeypatch):
    """Each engine step takes at least 10 ms more, so a 240-token request lasts >= 2.4 s
    whatever the machine: a client that leaves after 0.3 s is always gone mid-request."""
    step = llm.engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)


def test_client_disconnect_aborts_only_that_request(client, ref, server, slow_steps):
    m0 = metrics(server)
    before, tokens_before = m0["server"]["requests_aborted"], m0["generated_tokens"]
    r = requests.post(f"{server.url}/v1/completions", stream=True, timeout=60, json={
        "prompt": "A long story", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
        "stream": True})
    lines = r.iter_lines()
    first = next(line for line in lines if line)
    assert first.startswith(b"data: {")
    with ThreadPoolExecutor(1) as pool:  # another request runs on while the first one goes
        other = pool.submit(lambda: client.completions.create(
            model="tiny", prompt="Meanwhile", max_tokens=40, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text)
        r.close()
        assert other.result() == offline(ref, "Meanwhile", temperature=0, max_tokens=40,
                                         ignore_eos=True).outputs[0].text
    m = wait_idle(server)
    assert m["server"]["requests_aborted"] == before + 1
    assert m["generated_tokens"] - tokens_before < 240 + 40  # it stopped before its end
    assert m["kv_blocks_free"] == m["kv_blocks_total"]


def test_non_streaming_disconnect_aborts(server, slow_steps):
    m0 = metrics(server)
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{server.url}/v1/completions", timeout=(5, 0.3), json={
            "prompt": "Another long story", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True})
    m = wait_idle(server)
    assert m["server"]["requests_aborted"] == m0["server"]["requests_aborted"] + 1
    assert m["generated_tokens"] - m0["generated_tokens"] < 240
    assert m["kv_blocks_free"] == m["kv_blocks_total"]


def test_models_health_metrics(server):
    r = requests.get(f"{server.url}/v1/models", timeout=10).json()
    assert r["object"] == "list" and r["data"][0]["id"] == "tiny"
    assert r["data"][0]["max_model_len"] == MAX_LEN
    assert requests.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    m = metrics(server)
    for key in ("requests", "generated_tokens", "steps", "kv_blocks_total"):
        assert isinstance(m[key], int)
    assert m["server"]["steps"] <= m["steps"]


# ---- TRL -------------------------------------------------------------------------------------
def test_trl_vllm_client(server, ref):
    vc = pytest.importorskip("trl.generation.vllm_client")
    with mock.patch.object(vc, "is_vllm_available", return_value=True):
        trl_client = vc.VLLMClient(base_url=server.url)
    assert trl_client.model == "tiny"
    assert trl_client.get_world_size() == 1
    info = trl_client.get_server_info()  # what GRPOTrainer reads
    assert info["model_config"]["logprobs_mode"] == "raw_logprobs"
    assert info["weight_transfer_config"] is None
    out = trl_client.generate(["Hello", "Tell me a joke"], n=2, temperature=1.0, max_tokens=8,
                              generation_kwargs={"seed": 11, "ignore_eos": True})
    tok = ref.get_tokenizer()
    assert out["prompt_ids"] == [tok("Hello").input_ids, tok("Tell me a joke").input_ids]
    for i, prompt in enumerate(["Hello", "Tell me a joke"]):
        want = ref.generate([prompt], SamplingParams(n=2, seed=11, temperature=1.0,
                                                     max_tokens=8, logprobs=0,
                                                     ignore_eos=True), use_tqdm=False)[0]
        for o in want.outputs:
            k = 2 * i + o.index
            assert out["completion_ids"][k] == o.token_ids
            assert [ids[0] for ids in out["logprob_token_ids"][k]] == o.token_ids
            assert [v[0] for v in out["logprobs"][k]] == pytest.approx(
                [e[t].logprob for t, e in zip(o.token_ids, o.logprobs)], abs=1e-5)
    chat = trl_client.chat([CONV], n=2, temperature=1.0, max_tokens=6,
                           generation_kwargs={"seed": 2})
    want = ref.chat(CONV, SamplingParams(n=2, seed=2, temperature=1.0, max_tokens=6,
                                         logprobs=0), use_tqdm=False)[0]
    assert chat["prompt_ids"] == [want.prompt_token_ids]
    assert chat["completion_ids"] == [o.token_ids for o in want.outputs]
    assert [[v[0] for v in lp] for lp in chat["logprobs"]] == [pytest.approx(
        [e[t].logprob for t, e in zip(o.token_ids, o.logprobs)], abs=1e-5)
        for o in want.outputs]
    trl_client.reset_prefix_cache()  # raises unless 200


def test_trl_legacy_generate_replay(server, ref, llm):
    """The JSON of TRL's ``vllm-serve`` client, replayed: its exact request and response."""
    tok = llm.get_tokenizer()
    ids = tok("Count: 1, 2, 3,").input_ids
    payload = {"prompts": [ids, tok("Why is the sky blue?").input_ids], "images": None, "n": 2,
               "repetition_penalty": 1.0, "temperature": 0.8, "top_p": 0.95, "top_k": -1,
               "min_p": 0.0, "max_tokens": 6, "logprobs": 1, "structured_outputs_regex": None,
               "generation_kwargs": {"seed": 4}}
    r = post(server, "/generate/", payload)
    assert r.status_code == 200
    js = r.json()
    assert set(js) == {"prompt_ids", "completion_ids", "logprobs", "logprob_token_ids"}
    assert js["prompt_ids"] == payload["prompts"]
    assert len(js["completion_ids"]) == 4
    for i, p in enumerate(payload["prompts"]):
        want = ref.generate([p], SamplingParams(n=2, temperature=0.8, top_p=0.95, top_k=-1,
                                                max_tokens=6, logprobs=1, seed=4),
                            use_tqdm=False)[0]
        for o in want.outputs:
            k = 2 * i + o.index
            assert js["completion_ids"][k] == o.token_ids
            for t, lps, tids, e in zip(o.token_ids, js["logprobs"][k],
                                       js["logprob_token_ids"][k], o.logprobs):
                ranked = sorted(e.items(), key=lambda kv: kv[1].rank)
                assert tids == [tid for tid, _ in ranked] and t in tids
                assert lps == pytest.approx([v.logprob for _, v in ranked], abs=1e-5)
    js = post(server, "/generate/", {**payload, "logprobs": None}).json()
    assert js["logprobs"] is None and js["logprob_token_ids"] is None
    assert requests.get(f"{server.url}/health/", timeout=10).json() == {"status": "ok"}
    assert requests.get(f"{server.url}/get_world_size/", timeout=10).json() == {"world_size": 1}
    assert post(server, "/reset_prefix_cache/", {}).json() == {
        "message": "Request received, resetting prefix cache status: True"}
    assert post(server, "/close_communicator/", {}).status_code == 200


def test_reset_prefix_cache_routes_really_reset(server):
    """vLLM's and TRL's reset routes empty the prefix cache that served requests fill (and
    that a repeated prompt hits)."""
    body = {"model": "tiny", "prompt": "Count: " + ", ".join(map(str, range(1, 30))),
            "max_tokens": 4, "temperature": 0}
    for route, want in [("/reset_prefix_cache", {"success": True}),
                        ("/reset_prefix_cache/", {"message": "Request received, resetting "
                                                             "prefix cache status: True"})]:
        assert post(server, "/v1/completions", body).status_code == 200
        hits = wait_idle(server)["prefix_cache_hit_tokens"]
        assert post(server, "/v1/completions", body).status_code == 200
        m = wait_idle(server)
        assert m["prefix_cache_blocks"] > 0 and m["prefix_cache_hit_tokens"] > hits
        assert post(server, route, {}).json() == want
        assert metrics(server)["prefix_cache_blocks"] == 0


def test_trl_repetition_penalty(server, ref):
    """TRL always sends ``repetition_penalty``: 1.3 gives offline's tokens, which differ from
    the unpenalised ones (the penalty is applied, not dropped)."""
    assert {"repetition_penalty", "presence_penalty", "frequency_penalty"} <= sampling_fields()
    body = {"prompts": ["Count: 1, 2, 3,"], "max_tokens": 16, "temperature": 0,
            "generation_kwargs": {"ignore_eos": True}}
    r = post(server, "/generate/", {**body, "repetition_penalty": 1.3})
    assert r.status_code == 200
    want = offline(ref, "Count: 1, 2, 3,", repetition_penalty=1.3, max_tokens=16,
                   temperature=0, ignore_eos=True)
    assert r.json()["completion_ids"] == [want.outputs[0].token_ids]
    unpenalised = post(server, "/generate/", body).json()["completion_ids"]
    assert unpenalised == [offline(ref, "Count: 1, 2, 3,", max_tokens=16, temperature=0,
                                   ignore_eos=True).outputs[0].token_ids]
    assert unpenalised != r.json()["completion_ids"]
    r = post(server, "/generate/", {**body, "repetition_penalty": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"


def test_openai_penalties_equal_offline(client, ref, server):
    """``presence_penalty`` / ``frequency_penalty`` (OpenAI's) and ``repetition_penalty``
    (vLLM's extension) reach the engine: the same tokens as offline, not the unpenalised
    ones; out-of-range values are 400s naming the field."""
    kw = dict(presence_penalty=1.5, frequency_penalty=0.5, max_tokens=16, temperature=0)
    r = client.completions.create(model="tiny", prompt="a a a a a", **kw,
                                  extra_body={"repetition_penalty": 1.2, "ignore_eos": True,
                                              "return_token_ids": True})
    want = offline(ref, "a a a a a", repetition_penalty=1.2, ignore_eos=True, **kw)
    assert r.choices[0].token_ids == want.outputs[0].token_ids
    plain = offline(ref, "a a a a a", max_tokens=16, temperature=0, ignore_eos=True)
    assert plain.outputs[0].token_ids != want.outputs[0].token_ids
    c = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=8,
                                       temperature=0, frequency_penalty=-1.0,
                                       extra_body={"ignore_eos": True,
                                                   "return_token_ids": True})
    want = ref.chat(CONV, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                         frequency_penalty=-1.0), use_tqdm=False)[0]
    assert c.choices[0].token_ids == want.outputs[0].token_ids
    assert c.choices[0].token_ids != ref.chat(CONV, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "presence_penalty": 3})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "presence_penalty"
    assert "must be in [-2, 2]" in r.json()["error"]["message"]


def test_update_named_param_in_body(tiny_llama_tok_dir, ref):
    """Weights pushed over HTTP (base64 JSON and raw bytes) are what later requests use; a
    request in flight finishes on the old weights first."""
    llm = make_llm(tiny_llama_tok_dir)
    name = "model.norm.weight"
    old = llm.engine.runner.model.hf_parameters()[name].detach().clone()
    new = (old * -1.5).to(torch.bfloat16)
    prompt = "The weather today"
    before = offline(ref, prompt, temperature=0, max_tokens=40, ignore_eos=True).outputs[0]
    with Server(build_app(llm, "tiny", enable_control_routes=True)) as s:
        stream = requests.post(f"{s.url}/v1/completions", stream=True, timeout=60, json={
            "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True})
        lines = stream.iter_lines()
        first = next(line for line in lines if line)  # the request is in flight
        r = post(s, "/update_named_param/", {
            "name": name, "dtype": "torch.bfloat16", "shape": list(new.shape),
            "data": base64.b64encode(new.view(torch.uint8).numpy().tobytes()).decode()})
        assert r.status_code == 200 and r.json()["names"] == [name]
        ids = json.loads(first[6:])["choices"][0]["token_ids"]
        for line in lines:
            if line.startswith(b"data: {"):
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
        assert ids == before.token_ids  # the whole request ran on the old weights
        assert torch.equal(llm.engine.runner.model.hf_parameters()[name],
                           new.to(torch.float32))
        got = post(s, "/v1/completions", {"prompt": prompt, "max_tokens": 40,
                                          "temperature": 0, "ignore_eos": True}).json()
        ref.update_weights([(name, new)])
        try:
            want = offline(ref, prompt, temperature=0, max_tokens=40, ignore_eos=True)
            assert want.outputs[0].token_ids != before.token_ids
            assert got["choices"][0]["text"] == want.outputs[0].text
        finally:
            ref.update_weights([(name, old)])
        # raw bytes back to the old weights
        r = requests.post(f"{s.url}/update_named_param/", data=old.numpy().tobytes(),
                          params={"name": name, "dtype": "float32",
                                  "shape": ",".join(map(str, old.shape))},
                          headers={"content-type": "application/octet-stream"}, timeout=60)
        assert r.status_code == 200
        assert torch.equal(llm.engine.runner.model.hf_parameters()[name], old)
        bad = [({"name": name, "dtype": "float32", "shape": [3], "data": "AAAA"}, "data",
                f"{name}: got 3 bytes; shape [3] of float32 needs 12"),
               ({"name": "model.nope", "dtype": "float32", "shape": [1],
                 "data": base64.b64encode(b"\0" * 4).decode()}, "name", None),
               ({"name": name, "dtype": "int8", "shape": [1], "data": "AA=="}, "dtype", None),
               ({"name": name, "dtype": "float32", "shape": list(old.shape)}, "data", None),
               ({"name": name, "dtype": "float32", "shape": [1], "data": "%%"}, "data", None)]
        for body, param, message in bad:
            r = post(s, "/update_named_param/", body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
            if message:
                assert r.json()["error"]["message"] == message
        assert torch.equal(llm.engine.runner.model.hf_parameters()[name], old)


def test_init_communicator_is_501(server):
    r = post(server, "/init_communicator/", {"host": "x", "port": 1, "world_size": 2,
                                             "client_device_uuid": "u"})
    assert r.status_code == 501 and "update_named_param" in r.json()["error"]["message"]


# ---- engine and CLI --------------------------------------------------------------------------
def test_engine_abort_request_frees_only_that_request(tiny_llama_tok_dir):
    llm = make_llm(tiny_llama_tok_dir)
    e = llm.engine
    tok = llm.get_tokenizer()
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = e.add_request(tok("first prompt").input_ids, SamplingParams(
        n=3, temperature=1.0, seed=1, max_tokens=50))
    b = e.add_request(tok("second prompt").input_ids, p)
    e.step()
    c = e.add_request(tok("third prompt").input_ids, p)  # still waiting at the abort
    assert len(e.scheduler.waiting) == 1
    assert e.abort_request(c) and e.abort_request(a)
    assert not e.abort_request(a) and not e.abort_request("unknown")
    done = []
    while e.has_unfinished():
        done += e.step()
    assert [o.request_id for o in done] == [b]
    want = llm.generate([tok("second prompt").input_ids], p, use_tqdm=False)[0]
    assert done[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert e.blocks.num_free == e.blocks.num_blocks


def test_cli_serve_arguments():
    from specengine.cli import main, parse_args

    args = parse_args(["serve", "--model", "m", "--host", "0.0.0.0", "--port", "9000",
                       "--dtype", "float32", "--max-model-len", "512", "--seed", "3",
                       "--speculative-config", '{"method": "ngram"}'])
    assert (args.command, args.model, args.host, args.port, args.dtype, args.max_model_len,
            args.seed) == ("serve", "m", "0.0.0.0", 9000, "float32", 512, 3)
    assert main(["serve", "--speculative-config", "{bad"]) == 2
    assert main(["serve", "--port", "70000"]) == 2
