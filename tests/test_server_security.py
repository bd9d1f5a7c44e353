"""``specengine serve`` under hostile or careless clients (issue 23, items 1-3): validation at
the routes, limits, authentication, control routes, hosts, chat templates, weights from disk
and all-or-nothing weight updates.

A uvicorn server runs in-process (``test_server.Server``) over a tiny random-weight model with
SmolLM2's tokenizer. Every case runs while a *victim* (a greedy streamed completion of 200
tokens, each engine step slowed by 10 ms so that it lasts >= 2 s) is in flight: the victim
must still be running when the case is done and must finish token for token as offline
``LLM.generate`` on another engine of the same model."""

from __future__ import annotations

import base64
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_server import Server, make_llm  # noqa: E402

from specengine import SamplingParams  # noqa: E402
from specengine.lifecycle.weights import WeightUpdateFailed  # noqa: E402
from specengine.server.app import build_app  # noqa: E402
from specengine.server.state import ServerOptions  # noqa: E402

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
VICTIM_PROMPT = "The weather today"
VICTIM_TOKENS = 200
STEP_DELAY = 0.01
CONV = [{"role": "user", "content": "What is 17 * 23?"}]
LOOP_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                 "{% endfor %}")


def slow(llm):
    """Each engine step of ``llm`` takes >= ``STEP_DELAY`` s more (the victim outlasts the
    cases whatever the machine)."""
    step = llm.engine.step

    def slow_step():
        time.sleep(STEP_DELAY)
        return step()

    llm.engine.step = slow_step
    return llm


@pytest.fixture(scope="module")
def ref(tiny_llama_tok_dir):
    return make_llm(tiny_llama_tok_dir)


@pytest.fixture(scope="module")
def victim_ids(ref):
    return ref.generate([VICTIM_PROMPT], SamplingParams(temperature=0, max_tokens=VICTIM_TOKENS,
                                                        ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def allowed_dir(tmp_path_factory, tiny_llama_tok_dir):
    """A directory the secure server may load weights from: ``ckpt`` (a copy of the served
    checkpoint's safetensors), ``escape`` (a symlink to a checkpoint outside it)."""
    root = tmp_path_factory.mktemp("allowed")
    (root / "ckpt").mkdir()
    for f in tiny_llama_tok_dir.glob("*.safetensors"):
        shutil.copy(f, root / "ckpt" / f.name)
    os.symlink(tiny_llama_tok_dir, root / "escape")
    return root


SECURE = dict(api_key=KEY, enable_control_routes=True, trust_request_chat_template=True,
              chat_template_timeout=1.0, max_request_body_bytes=64 << 10,
              max_queued_requests=8, max_prompts_per_request=8, max_n=16, max_stop_strings=2,
              max_stop_string_len=8, max_request_memory_bytes=32 << 20, request_timeout=60)


@pytest.fixture(scope="module")
def secure_llm(tiny_llama_tok_dir):
    return slow(make_llm(tiny_llama_tok_dir))


@pytest.fixture(scope="module")
def secure(secure_llm, allowed_dir):
    """Key, control routes on, request templates trusted, tight limits."""
    app = build_app(secure_llm, "tiny", allowed_weight_dirs=[str(allowed_dir)], **SECURE)
    with Server(app) as s:
        s.state = app.state.server
        s.headers = AUTH
        yield s


@pytest.fixture(scope="module")
def plain(tiny_llama_tok_dir):
    """The defaults: no key, no control routes, loopback hosts only, no request templates."""
    llm = slow(make_llm(tiny_llama_tok_dir))
    app = build_app(llm, "tiny")
    with Server(app) as s:
        s.state = app.state.server
        s.headers = {}
        yield s


def post(s, route, body=None, headers=None, **kw) -> requests.Response:
    h = {**s.headers, **(headers or {})}
    if isinstance(body, (bytes, str)) or body is None:
        return requests.post(f"{s.url}{route}", data=body, headers=h, timeout=60, **kw)
    return requests.post(f"{s.url}{route}", json=body, headers=h, timeout=60, **kw)


def error(r: requests.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    assert e["param"] == param, e
    if code is not None:
        assert e["code"] == code, e
    return e


class Victim:
    """A greedy streamed completion in flight for the ``with`` block; on exit it must still
    be running (``overlap``) and then finish token for token as offline."""

    def __init__(self, s, want: list[int], overlap: bool = True):
        self.s, self.want, self.overlap = s, want, overlap
        self.ids: list[int] = []
        self.events: list[dict] = []

    def __enter__(self):
        self.r = requests.post(f"{self.s.url}/v1/completions", stream=True, timeout=120,
                               headers=self.s.headers, json={
                                   "prompt": VICTIM_PROMPT, "max_tokens": VICTIM_TOKENS,
                                   "temperature": 0, "ignore_eos": True, "stream": True,
                                   "return_token_ids": True})
        assert self.r.status_code == 200, self.r.text
        self.lines = self.r.iter_lines()
        self._read(next(line for line in self.lines if line))  # in flight
        self.thread = threading.Thread(target=self._rest, daemon=True)
        self.thread.start()
        return self

    def _read(self, line: bytes):
        if line.startswith(b"data: {"):
            ev = json.loads(line[6:])
            self.events.append(ev)
            for c in ev.get("choices", []):
                self.ids += c.get("token_ids") or []

    def _rest(self):
        for line in self.lines:
            self._read(line)

    def __exit__(self, *exc):
        running = self.thread.is_alive()
        self.thread.join(120)
        if exc[0] is not None:
            return False
        assert not any("error" in ev for ev in self.events), self.events[-1]
        assert self.ids == self.want, "the victim's tokens changed"
        if self.overlap:
            assert running, "the victim finished before the case did: not concurrent"
        return False


def wait_idle(s, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while True:
        m = requests.get(f"{s.url}/metrics", headers=s.headers, timeout=30).json()
        if m["kv_blocks_free"] == m["kv_blocks_total"] or time.time() > deadline:
            return m
        time.sleep(0.05)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- 1. validation ---------------------------------------------------------------------------
VALIDATION = [  # (route, body, param)
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "bad \udfff"]}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]},
     "messages[0].content"),
    ("/generate/", {"prompts": ["\ud800"]}, "prompts[0]"),
    ("/chat/", {"messages": [[{"role": "user", "content": "\ud800"}]]},
     "messages[0][0].content"),
    ("/v1/completions", {"prompt": "x", "user": "\udc00"}, "user"),
    ("/v1/chat/completions", {"messages": CONV, "chat_template_kwargs": {"\ud800": 1}},
     "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1000000}, "logprobs"),
    ("/v1/chat/completions", {"messages": CONV, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/generate/", {"prompts": ["x"], "logprobs": 1000000}, "logprobs"),
    ("/generate/", {"prompts": ["x"], "generation_kwargs": {"logprobs": 21}},
     "generation_kwargs.logprobs"),
    ("/generate/", {"prompts": ["x"], "generation_kwargs": {"prompt_logprobs": 21}},
     "generation_kwargs.prompt_logprobs"),
    ("/chat/", {"messages": [CONV], "logprobs": 50}, "logprobs"),
    ("/chat/", {"messages": [CONV], "generation_kwargs": {"prompt_logprobs": 1000000}},
     "generation_kwargs.prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2, "max_tokens": 4,
                         "stop_token_ids": [1000000]}, "stop_token_ids"),
    ("/generate/", {"prompts": ["x"], "generation_kwargs": {"stop_token_ids": [-1]}},
     "generation_kwargs.stop_token_ids"),
    ("/generate/", {"prompts": ["x"], "generation_kwargs": {"stop_token_ids": "abc"}},
     "generation_kwargs.stop_token_ids"),
    ("/v1/completions", {"prompt": [5, 49152]}, "prompt"),
    ("/generate/", {"prompts": [[1, 2, 10 ** 12]]}, "prompts[0]"),
    ("/v1/completions", {"prompt": [7] * 256}, "prompt"),
    ("/v1/completions", {"prompt": "x" * 50000}, "prompt"),  # refused before tokenizing
    ("/generate/", {"prompts": ["ok", "y" * 50000]}, "prompts[1]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10 ** 12}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CONV, "max_completion_tokens": 256},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 70}, "seed"),
    ("/generate/", {"prompts": ["x"], "generation_kwargs": {"seed": 1.5}},
     "generation_kwargs.seed"),
    ("/generate/", {"prompts": ["x"], "generation_kwargs": {"temperature": -1}},
     "generation_kwargs.temperature"),
    ("/generate/", {"prompts": ["x"], "generation_kwargs": {"return_hidden_states": True}},
     "generation_kwargs.return_hidden_states"),
    ("/generate/", {"prompts": ["x"], "generation_kwargs": {"ignore_eos": "yes"}},
     "generation_kwargs.ignore_eos"),
    ("/v1/completions", {"prompt": "x", "n": 300}, "n"),
    ("/generate/", {"prompts": ["x"], "n": 10 ** 9}, "n"),
]
RAW = [  # (route, raw JSON text, param): Python's JSON parser takes these, JSON does not
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": Infinity}', "top_p"),
    ("/generate/", '{"prompts": ["x"], "generation_kwargs": {"min_p": -Infinity}}',
     "generation_kwargs.min_p"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
]


def test_validation_errors_name_the_field(plain, victim_ids):
    """Every bad field is a 400 naming it, on the OpenAI and the TRL routes, while a victim
    runs; nothing reaches the engine."""
    before = requests.get(f"{plain.url}/metrics", timeout=30).json()["requests"]
    with Victim(plain, victim_ids), ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda c: post(plain, c[0], c[1]), VALIDATION))
        raws = list(pool.map(lambda c: post(plain, c[0], c[1].encode(),
                                            {"content-type": "application/json"}), RAW))
    for (route, body, param), r in zip(VALIDATION + RAW, rs + raws):
        assert r.status_code == 400, (route, body, r.text)
        assert r.json()["error"]["param"] == param, (route, body, r.json())
    after = wait_idle(plain)
    assert after["requests"] == before + 1  # the victim only
    assert requests.get(f"{plain.url}/health", timeout=10).status_code == 200


def test_lone_surrogate_is_400_not_500(plain, victim_ids):
    with Victim(plain, victim_ids):
        e = error(post(plain, "/v1/completions", {"prompt": "\ud800", "max_tokens": 4}), 400,
                  "prompt", "invalid_utf8")
        assert "UTF-8" in e["message"]
        r = post(plain, "/generate/", b'{"prompts": ["ok", "a\\ud800b"]}',
                 {"content-type": "application/json"})
        error(r, 400, "prompts[1]", "invalid_utf8")
        r = post(plain, "/v1/completions", b'{"prompt": "\xff\xfe"}',
                 {"content-type": "application/json"})  # not UTF-8 at all
        assert r.status_code == 400


# ---- 2. limits -------------------------------------------------------------------------------
def test_body_size_limit_413(secure, victim_ids):
    big = {"prompt": "x" * (70 << 10), "max_tokens": 2}
    with Victim(secure, victim_ids):
        e = error(post(secure, "/v1/completions", big), 413, None, "request_too_large")
        assert "65536" in e["message"]

        def chunks():  # no Content-Length: counted while read
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * (10 << 10)
            yield b'"}'

        r = requests.post(f"{secure.url}/v1/completions", data=chunks(), timeout=60,
                          headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    # a weight push has its own (larger) limit: this one gets through to its checks (after
    # the victim: a weight update waits for the requests in flight)
    r = post(secure, "/update_named_param/", {
        "name": "model.nope", "dtype": "float32", "shape": [20000],
        "data": base64.b64encode(bytes(80000)).decode()})
    error(r, 400, "name")


def test_queue_full_429(secure, victim_ids):
    """8 engine requests at most in flight: the victim plus 8 prompts is one too many (429
    with Retry-After); once the victim is done the same request runs."""
    body = {"prompt": [f"p{i}" for i in range(8)], "max_tokens": 2}
    with Victim(secure, victim_ids):
        r = post(secure, "/v1/completions", body)
        e = error(r, 429, None, "too_many_requests")
        assert r.headers["retry-after"] == "1" and "max-queued-requests" in e["message"]
        error(post(secure, "/generate/", {"prompts": [f"p{i}" for i in range(8)]}), 429)
    wait_idle(secure)
    r = post(secure, "/v1/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_prompts_per_request(secure, victim_ids):
    with Victim(secure, victim_ids):
        error(post(secure, "/v1/completions", {"prompt": ["a"] * 9}), 400, "prompt")
        error(post(secure, "/generate/", {"prompts": [[1, 2]] * 9}), 400, "prompts")
        error(post(secure, "/chat/", {"messages": [CONV] * 9}), 400, "messages")


def test_stop_string_limits(secure, victim_ids):
    with Victim(secure, victim_ids):
        e = error(post(secure, "/v1/completions", {"prompt": "x", "stop": ["a", "b", "c"]}),
                  400, "stop")
        assert "at most 2" in e["message"]
        e = error(post(secure, "/v1/chat/completions", {"messages": CONV,
                                                        "stop": "123456789"}), 400, "stop")
        assert "9 characters" in e["message"]
        error(post(secure, "/generate/", {"prompts": ["x"], "generation_kwargs": {
            "stop": ["a", "b", "c"]}}), 400, "generation_kwargs.stop")
        r = post(secure, "/v1/completions", {"prompt": "x", "stop": ["ab", "12345678"],
                                             "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_n_limit_and_no_oom(secure, victim_ids):
    """``n=1000000000`` (issue 23: an OOM kill) is a 400 in no time and no memory."""
    rss = rss_bytes()
    with Victim(secure, victim_ids):
        t0 = time.perf_counter()
        e = error(post(secure, "/v1/chat/completions", {"messages": CONV, "n": 1000000000}),
                  400, "n")
        assert time.perf_counter() - t0 < 5 and "at most 16" in e["message"]
        error(post(secure, "/v1/completions", {"prompt": "x", "n": 17}), 400, "n")
        error(post(secure, "/generate/", {"prompts": ["x"], "n": 300}), 400, "n")
    assert rss_bytes() - rss < 200 << 20


def test_memory_bound_per_request(secure, victim_ids):
    """4 prompts x n=16 x 200 tokens with 20 logprobs each would hold ~53 MiB of logprob
    entries: over the 32 MiB bound, a 400 naming logprobs; without logprobs it runs."""
    body = {"prompt": ["a", "b", "c", "d"], "n": 16, "max_tokens": 200, "logprobs": 20}
    with Victim(secure, victim_ids):
        e = error(post(secure, "/v1/completions", body), 400, "logprobs")
        assert "max-request-memory-bytes" in e["message"]
        error(post(secure, "/generate/", {"prompts": ["a", "b", "c", "d"], "n": 16,
                                          "max_tokens": 200, "logprobs": 20}), 400,
              "logprobs")
    st = secure.state
    assert st.request_memory_bytes([st_prompt(4)] * 4, [SamplingParams(
        n=16, max_tokens=200, logprobs=20)] * 4) > 32 << 20


def st_prompt(n: int):
    from specengine.server.state import Prompt

    return Prompt(None, [1] * n)


def test_request_timeout_aborts_only_that_request(secure, victim_ids):
    """A request past the timeout is aborted (KV freed) and answered 504 (a stream: an error
    event, then [DONE]); the victim, admitted before the timeout was lowered, runs on."""
    st = secure.state
    with Victim(secure, victim_ids):
        st.options.request_timeout = 0.3
        try:
            t0 = time.perf_counter()
            e = error(post(secure, "/v1/completions", {"prompt": "long", "max_tokens": 200,
                                                       "ignore_eos": True}), 504, None,
                      "request_timeout")
            assert time.perf_counter() - t0 < 10 and "request timeout" in e["message"]
            r = post(secure, "/v1/chat/completions", {"messages": CONV, "max_tokens": 200,
                                                      "ignore_eos": True, "stream": True})
            events = [line for line in r.iter_lines() if line]
            assert events[-1] == b"data: [DONE]"
            err = json.loads(events[-2][6:])["error"]
            assert err["code"] == "request_timeout" and err["type"] == "timeout_error"
            error(post(secure, "/generate/", {"prompts": ["x"], "max_tokens": 200,
                                              "generation_kwargs": {"ignore_eos": True}}),
                  504)
        finally:
            st.options.request_timeout = 60
    m = wait_idle(secure)
    assert m["kv_blocks_free"] == m["kv_blocks_total"]


# ---- 3. authentication, control routes, hosts -------------------------------------------------
def test_api_key_required_except_health(secure, victim_ids):
    routes = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions"), ("POST", "/generate/"), ("POST", "/sleep"),
              ("POST", "/update_named_param/"), ("GET", "/get_world_size/"),
              ("GET", "/openapi.json"), ("GET", "/server_info")]
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                   {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}]
    with Victim(secure, victim_ids):
        for method, route in routes:
            for h in bad_headers:
                r = requests.request(method, f"{secure.url}{route}", headers=h, timeout=30,
                                     json={"level": 1} if method == "POST" else None)
                e = error(r, 401, None, "invalid_api_key")
                assert r.headers["www-authenticate"] == "Bearer", e
        for route in ("/health", "/health/"):
            assert requests.get(f"{secure.url}{route}", timeout=30).status_code == 200
        client = openai.OpenAI(api_key=KEY, base_url=f"{secure.url}/v1", max_retries=0)
        assert client.models.list().data[0].id == "tiny"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(api_key="nope", base_url=f"{secure.url}/v1",
                          max_retries=0).models.list()
    assert not secure.state.llm.is_sleeping()


def test_control_routes_off_by_default(plain, victim_ids):
    """Without --enable-control-routes every control route is a 404 that says so, and
    nothing changes (no sleep, no weights, no reset)."""
    llm = plain.state.llm
    routes = ["/sleep", "/wake_up", "/release_memory_occupation", "/resume_memory_occupation",
              "/update_weights_from_disk", "/start_weight_update", "/update_weights",
              "/finish_weight_update", "/abort_weight_update", "/reset_prefix_cache",
              "/flush_cache", "/update_named_param/", "/init_communicator/",
              "/close_communicator/", "/reset_prefix_cache/", "/sleep/"]
    with Victim(plain, victim_ids):
        for route in routes:
            e = error(post(plain, route, {}), 404, None, "control_routes_disabled")
            assert "--enable-control-routes" in e["message"]
        for route in ("/flush_cache", "/is_sleeping", "/get_weight_version"):
            error(requests.get(f"{plain.url}{route}", timeout=30), 404)
    assert not llm.is_sleeping() and llm.weight_version == 0


def test_control_routes_content_type_and_cross_site(secure, victim_ids):
    """Only JSON / octet-stream bodies (or none): a form or text/plain POST, what a web page
    can send without a preflight, is a 415; a browser's cross-site request is a 403."""
    llm = secure.state.llm
    with Victim(secure, victim_ids):
        for ctype in ("text/plain", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x"):
            e = error(post(secure, "/sleep", '{"level": 1}', {"content-type": ctype}), 415,
                      None, "unsupported_media_type")
            assert "application/json" in e["message"]
        error(post(secure, "/sleep", b"level=1", {"content-type": ""}), 415)
        for h in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                  {"Origin": "http://evil.example"}, {"Origin": "null"},
                  {"Origin": "http://localhost:1"}):
            error(post(secure, "/sleep", {"level": 1}, h), 403, None, "cross_site_request")
            error(requests.get(f"{secure.url}/flush_cache", headers={**AUTH, **h},
                               timeout=30), 403)
        assert not llm.is_sleeping()
    # what a trainer sends is accepted: JSON, no body at all, the server's own origin (after
    # the victim: a reset waits for the requests in flight)
    assert post(secure, "/reset_prefix_cache", None).json() == {"success": True}
    assert post(secure, "/reset_prefix_cache/", {}).status_code == 200
    assert post(secure, "/flush_cache", {}, {"Origin": secure.url,
                                             "Sec-Fetch-Site": "same-origin"}).status_code == 200
    r = requests.post(f"{secure.url}/update_named_param/", data=b"\0" * 4, timeout=60,
                      params={"name": "model.nope", "dtype": "float32", "shape": "1"},
                      headers={**AUTH, "content-type": "application/octet-stream"})
    error(r, 400, "name")


def test_host_allow_list_on_loopback(plain, victim_ids):
    port = plain.url.rsplit(":", 1)[1]
    with Victim(plain, victim_ids):
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
            r = requests.get(f"{plain.url}/v1/models", headers={"Host": host}, timeout=30)
            error(r, 400, None, "invalid_host")
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
            r = requests.get(f"{plain.url}/v1/models", headers={"Host": host}, timeout=30)
            assert r.status_code == 200, (host, r.text)
    assert ServerOptions(host="0.0.0.0").host_allow_list() is None
    assert ServerOptions(host="::1").host_allow_list() == {"localhost", "127.0.0.1", "::1"}
    assert ServerOptions(host="0.0.0.0", allowed_hosts=["Api.Example"]).host_allow_list() == \
        {"api.example"}
    assert ServerOptions(allowed_hosts=["*"]).host_allow_list() is None


def test_cli_flags_env_key_and_exposure_warning(monkeypatch):
    from specengine.cli import parse_args
    from specengine.server.cli import exposure_warnings, server_options

    monkeypatch.delenv("SPECENGINE_API_KEY", raising=False)
    opts = server_options(parse_args(["serve"]))
    defaults = ServerOptions()
    assert opts == defaults and opts.api_key is None and not opts.enable_control_routes
    assert exposure_warnings(opts) == []
    wide = server_options(parse_args(["serve", "--host", "0.0.0.0", "--enable-control-routes"]))
    warnings = exposure_warnings(wide)
    assert len(warnings) == 2 and "without an API key" in warnings[0]
    monkeypatch.setenv("SPECENGINE_API_KEY", "from-env")
    opts = server_options(parse_args(["serve", "--host", "0.0.0.0"]))
    assert opts.api_key == "from-env" and exposure_warnings(opts) == []
    assert server_options(parse_args(["serve", "--api-key", "flag"])).api_key == "flag"
    args = parse_args(["serve", "--max-queued-requests", "5", "--max-n", "4",
                       "--request-timeout", "0", "--allowed-weight-dirs", "/a", "/b",
                       "--allowed-hosts", "x.example", "--trust-request-chat-template",
                       "--max-logprobs", "5"])
    opts = server_options(args)
    assert (opts.max_queued_requests, opts.max_n, opts.request_timeout,
            opts.allowed_weight_dirs, opts.allowed_hosts, opts.trust_request_chat_template,
            args.max_logprobs) == (5, 4, None, ["/a", "/b"], ["x.example"], True, 5)
    with pytest.raises(ValueError, match="max_n"):
        ServerOptions(max_n=0)


# ---- 3. chat templates -----------------------------------------------------------------------
def test_request_chat_template_refused_by_default(plain, victim_ids):
    with Victim(plain, victim_ids):
        e = error(post(plain, "/v1/chat/completions", {"messages": CONV,
                                                       "chat_template": "{{ 'x' }}"}),
                  400, "chat_template")
        assert "--trust-request-chat-template" in e["message"]
        error(post(plain, "/v1/chat/completions", {
            "messages": CONV, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}),
            400, "chat_template_kwargs.chat_template")
        error(post(plain, "/chat/", {"messages": [CONV], "chat_template": "{{ 'x' }}"}),
              400, "chat_template")
        error(post(plain, "/v1/chat/completions", {
            "messages": CONV, "chat_template_kwargs": {"tokenize": True}}),
            400, "chat_template_kwargs.tokenize")


def test_chat_template_time_limit(secure, victim_ids):
    """A trusted request template that loops forever is stopped after
    ``chat_template_timeout`` (1 s) off the event loop: a 400, and the server (the victim's
    stream, other routes) keeps answering meanwhile."""
    tok = secure.state.tokenizer

    def timed_post(*args):  # (response, seconds from t0 to its answer)
        r = post(secure, *args)
        return r, time.perf_counter() - t0

    # The server shares this process's GIL with three traced render threads: at the default
    # 5 ms switch interval, a 2-core CI machine can take the whole second to serve a GET
    # even though the event loop is free; the ordering below is what is under test.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        with Victim(secure, victim_ids), ThreadPoolExecutor(3) as pool:
            t0 = time.perf_counter()
            loops = [pool.submit(timed_post, "/v1/chat/completions",
                                 {"messages": CONV, "chat_template": LOOP_TEMPLATE})
                     for _ in range(2)]
            loops.append(pool.submit(timed_post, "/chat/", {"messages": [CONV],
                                                            "chat_template": LOOP_TEMPLATE}))
            time.sleep(0.2)  # the renders are running now: the event loop still answers
            r = requests.get(f"{secure.url}/v1/models", headers=AUTH, timeout=30)
            answered = time.perf_counter() - t0
            assert r.status_code == 200
            for f in loops:
                resp, took = f.result()
                e = error(resp, 400, "chat_template", "chat_template_timeout")
                assert "1 s" in e["message"]
                assert answered < took and took >= 1.0, (answered, took)
            assert time.perf_counter() - t0 < 10
    finally:
        sys.setswitchinterval(switch)
    r = post(secure, "/v1/chat/completions", {
        "messages": CONV, "max_tokens": 2, "return_token_ids": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == tok(CONV[0]["content"],
                                               add_special_tokens=False).input_ids


# ---- 3. weights from disk, all-or-nothing updates ---------------------------------------------
def test_update_weights_from_disk_allowed_dirs(secure, victim_ids, allowed_dir,
                                               tiny_llama_tok_dir, tmp_path):
    """Only checkpoints below --allowed-weight-dirs load; every other path gets one and the
    same refusal (missing or existing, outside, ``..``, a symlink out); a refused request
    with abort_all_requests aborts nothing."""
    st = secure.state
    m0 = requests.get(f"{secure.url}/metrics", headers=AUTH, timeout=30).json()
    (tmp_path / "x.safetensors").write_bytes(b"not a checkpoint")
    bad = [str(tiny_llama_tok_dir), "/no/such/dir", str(allowed_dir / "nope"),
           str(allowed_dir / "escape"), str(allowed_dir / "ckpt" / ".." / "ckpt"),
           f"{allowed_dir}/../{allowed_dir.name}/ckpt", str(tmp_path / "x.safetensors"),
           str(allowed_dir), "/etc/passwd", "relative/path", "", "/tmp\x00/x"]
    with Victim(secure, victim_ids):
        messages = set()
        for path in bad:
            e = error(post(secure, "/update_weights_from_disk",
                           {"model_path": path, "abort_all_requests": True}), 400,
                      "model_path", "weight_path_refused")
            messages.add(e["message"])
        assert len(messages) == 1 and "--allowed-weight-dirs" in messages.pop()
    m = wait_idle(secure)
    assert m["server"]["requests_aborted"] == m0["server"]["requests_aborted"]
    assert st.llm.weight_version == 0
    r = post(secure, "/update_weights_from_disk", {"model_path": str(allowed_dir / "ckpt")})
    assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
    with Victim(secure, victim_ids):  # the same weights: the same tokens
        pass


def test_failed_repack_restores_old_weights(tiny_llama_tok_dir, ref, victim_ids):
    """A weight update whose repack fails after the copy leaves the old weights serving (the
    version unchanged), through ``LLM.update_weights`` and over HTTP."""
    llm = make_llm(tiny_llama_tok_dir)
    model = llm.engine.runner.model
    old = {n: t.detach().clone() for n, t in model.hf_parameters().items()}
    new = {n: t * -0.5 for n, t in old.items()}
    calls = {"n": 0}
    prepack = model.prepack

    def failing_prepack():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated out of memory while repacking")
        prepack()

    model.prepack = failing_prepack
    with pytest.raises(WeightUpdateFailed, match="old weights were restored"):
        llm.update_weights(new)
    assert calls["n"] == 2  # failed, then the restore repacked
    assert all(torch.equal(model.hf_parameters()[n], t) for n, t in old.items())
    assert llm.weight_version == 0
    out = llm.generate([VICTIM_PROMPT], SamplingParams(temperature=0, max_tokens=VICTIM_TOKENS,
                                                       ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == victim_ids

    calls["n"] = 0
    name = "model.norm.weight"
    data = base64.b64encode(new[name].numpy().tobytes()).decode()
    slow(llm)
    with Server(build_app(llm, "tiny", enable_control_routes=True)) as s:
        s.headers = {}
        with Victim(s, victim_ids, overlap=False):  # the update waits for it, then fails
            r = post(s, "/update_named_param/", {"name": name, "dtype": "float32",
                                                 "shape": list(new[name].shape), "data": data})
        e = error(r, 500, None, "weight_update_failed")
        assert "old weights were restored" in e["message"]
        assert torch.equal(model.hf_parameters()[name], old[name])
        assert requests.get(f"{s.url}/get_weight_version",
                            timeout=30).json() == {"weight_version": 0}
        with Victim(s, victim_ids):
            pass
