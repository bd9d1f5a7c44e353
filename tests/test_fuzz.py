"""Fuzzing every route of ``specengine serve`` (issue 23, item 7).

A uvicorn server runs in-process (``test_server.Server``) over a tiny random-weight model with
SmolLM2's tokenizer, in two configurations: ``default`` (the security defaults: no key, control
routes off, no request chat templates) and ``locked`` (an API key, control routes on, request
chat templates trusted with a short time limit, weights from disk below one directory, small
body limits, a short queue and request timeout). Both have low resource limits
(``max_model_len``, ``max_n``, prompts per request) so that no request spends long generating.

Every route the app serves is fuzzed: the operations of its own OpenAPI schema (``/openapi.json``)
with schemathesis, positive and negative cases (the schema is completed first: the routes that
read their body themselves get their pydantic model's schema, ``prompt`` / ``messages`` get the
shapes the routes accept), and the routes registered without a schema (``/docs``, ``/redoc``,
...) listed from ``app.routes``. On top of that: hand-written strategies for the generation
and control routes (every field valid, at a boundary or invalid: huge integers, ``NaN`` /
``Infinity``, wrong types, lone surrogates, huge strings and lists), and mutations of every
request (a field replaced by such a value, non-JSON bodies, other content types, chunked
bodies, bad hosts, keys, origins, methods, clients that hang up). Generation requests go in
pairs, at the same time; on ``locked`` each control request runs beside a generation request
(pause, sleep and weight updates with requests in flight), and the server is brought back to
serving after each (``Restorer``).

Asserted: no response is a 500 (nor a stream carrying an internal error), at least
``MIN_REQUESTS`` requests in all, ``/health`` answers 200 afterwards, every KV block is free
again, the process RSS never grows more than 1 GiB above its value before fuzzing, and a
greedy *victim* completion that runs again and again throughout the fuzzing is token for token
the offline ``LLM.generate`` of a second engine of the same model (on ``locked``, a victim may
also end early by contract: aborted by ``/pause?mode=abort`` or ``abort_all_requests`` with a
prefix of the expected tokens, or a 503 / 504 / 429 while the engine is asleep, past the
request timeout, or with the queue full).

``SPECENGINE_FUZZ_SEED`` changes the seed (default fixed, so a CI run is reproducible);
``SPECENGINE_FUZZ_SCALE`` multiplies the number of examples; ``SPECENGINE_FUZZ_LOG=FILE`` appends
every request and its response to FILE. Run with ``-s`` to see the requests and statuses per
route and the timings.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import threading
import time
import warnings
from collections import Counter, defaultdict
from urllib.parse import quote

import pytest
import requests

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from safetensors import safe_open  # noqa: E402
from test_server import Server  # noqa: E402

from specengine import LLM, SamplingParams  # noqa: E402
from specengine.server import control_routes, trl_routes  # noqa: E402
from specengine.server.app import build_app, is_control_path  # noqa: E402
from specengine.server.protocol import sampling_fields  # noqa: E402

MAX_LEN = 96
KEY = "fuzz-key"
SEED = int(os.environ.get("SPECENGINE_FUZZ_SEED", "23"))
SCALE = float(os.environ.get("SPECENGINE_FUZZ_SCALE", "1"))
LOG = open(os.environ["SPECENGINE_FUZZ_LOG"], "a") if os.environ.get(
    "SPECENGINE_FUZZ_LOG") else None  # every request and response, one line each
MIN_REQUESTS = 2000  # over both configurations
RSS_MARGIN = 1 << 30
VICTIM_PROMPT = "The weather today"
VICTIM_TOKENS = 40
LIMITS = dict(max_n=4, max_prompts_per_request=4, max_queued_requests=16, max_stop_strings=4,
              max_stop_string_len=16, max_request_memory_bytes=8 << 20)


def make_llm(path) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20,
               max_model_len=MAX_LEN)


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


# ---- the served routes and their schema ------------------------------------------------------
def served_routes(app) -> list[tuple[str, str]]:
    """``(method, path)`` of every route the app serves, in its schema or not (``/docs``,
    ``/openapi.json``, ...; included routers flattened)."""
    out, todo = [], list(app.routes)
    while todo:
        r = todo.pop(0)
        inner = getattr(getattr(r, "original_router", None), "routes", None)
        if inner is not None:
            todo.extend(inner)
            continue
        path = getattr(r, "path", None)
        for m in sorted(getattr(r, "methods", None) or ()):
            if path is not None and m != "HEAD":
                out.append((m, path))
    return sorted(set(out))


def _model_schema(model, components: dict) -> dict:
    s = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(s.pop("$defs", {}))
    return s


TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"},
                                              "text": {"type": "string"}},
             "required": ["type", "text"]}
MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"anyOf": [{"enum": ["system", "user", "assistant", "tool"]}, {"type": "string"}]},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"},
                          {"type": "array", "items": TEXT_PART}]}}}
PROMPT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                    {"type": "array", "items": {"type": "integer"}},
                    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]}
OCTET = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
TENSOR_QUERY = [{"name": k, "in": "query", "required": False, "schema": {"type": "string"}}
                for k in ("name", "dtype", "shape")]
# routes that read their body themselves (no body in the app's schema): (model or models,
# query parameters they also read, more content types)
SELF_READ = {
    "/sleep": ("SleepRequest", [{"name": "level", "in": "query", "schema": {"type": "integer"}}],
               {}),
    "/wake_up": ("TagsRequest", [{"name": "tags", "in": "query", "schema": {
        "type": "array", "items": {"type": "string"}}}], {}),
    "/release_memory_occupation": ("TagsRequest", [], {}),
    "/resume_memory_occupation": ("TagsRequest", [], {}),
    "/update_weights_from_disk": ("UpdateFromDiskRequest", [], {}),
    "/pause": ("PauseRequest", [{"name": "mode", "in": "query", "schema": {"type": "string"}}],
               {}),
    "/pause_generation": ("PauseRequest", [], {}),
    "/start_weight_update": ("StartWeightUpdate", [], {}),
    "/finish_weight_update": ("FinishWeightUpdate", [], {}),
    "/update_named_param/": ("UpdateNamedParam", TENSOR_QUERY, OCTET),
    "/update_weights": (("UpdateNamedParam", "WeightBucket"), TENSOR_QUERY, OCTET),
}


def fuzz_schema(app) -> dict:
    """The app's OpenAPI schema, completed where the code accepts more than it declares:
    the bodies (and query parameters) of the routes that read them themselves, and the shapes
    of ``prompt`` / ``messages`` (declared ``Any``)."""
    s = json.loads(json.dumps(app.openapi()))
    comps = s.setdefault("components", {}).setdefault("schemas", {})
    models = {**vars(trl_routes), **vars(control_routes)}
    for path, (names, query, more) in SELF_READ.items():
        op = s["paths"].get(path, {}).get("post")
        if op is None or "requestBody" in op:
            continue
        names = names if isinstance(names, tuple) else (names,)
        schemas = [_model_schema(models[n], comps) for n in names]
        body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        op["requestBody"] = {"required": False, "content": {
            "application/json": {"schema": body}, **more}}
        op.setdefault("parameters", []).extend(query)
    comps["CompletionRequest"]["properties"]["prompt"] = PROMPT
    comps["ChatCompletionRequest"]["properties"]["messages"] = {
        "type": "array", "items": MESSAGE}
    comps["TRLChatRequest"]["properties"]["messages"] = {
        "type": "array", "items": {"type": "array", "items": MESSAGE}}
    # one operation id per operation (FastAPI gives GET and POST /flush_cache the same one)
    for path, ops in s["paths"].items():
        for method, op in ops.items():
            op["operationId"] = f"{method}_{path}"
    return s


MISSING = object()  # a field left out


# ---- JSON with values json.dumps cannot write -------------------------------------------------
class Raw(str):
    """A JSON fragment written as is (``NaN``, ``1e400``, a 5,000-digit integer, ...)."""


def dumps(x) -> str:
    """JSON text of ``x``; strings with ``\\uXXXX`` escapes (lone surrogates stay lone), Raw
    fragments verbatim, non-finite floats as ``NaN`` / ``Infinity``."""
    if isinstance(x, Raw):
        return str(x)
    if isinstance(x, dict):
        return "{" + ",".join(f"{dumps(str(k))}:{dumps(v)}" for k, v in x.items()
                              if v is not MISSING) + "}"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in x) + "]"
    return json.dumps(x, ensure_ascii=True, allow_nan=True)


NASTY = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"),
         Raw("1e-400"), Raw("-0"), Raw("-0.0"), Raw("9" * 5000), Raw("-" + "9" * 5000),
         Raw("1" + "0" * 400 + ".5"), 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64,
         -(2 ** 63) - 1, 10 ** 30, -1, 0, 1.5, True, False, None, "", "\ud800", "a\udc00b",
         "\x00", "\u202e\ufeff", "x" * 100_000, ["x"] * 10_000, list(range(20_000)), {},
         {"": None}, [], [[]], Raw("[" * 3000 + "]" * 3000), Raw('{"a":' * 3000 + "1" +
                                                                 "}" * 3000), "NaN", "1"]


def nasty() -> st.SearchStrategy:
    return st.sampled_from(NASTY)


H11_MAX_HEAD = 16 * 1024  # h11's max_incomplete_event_size: uvicorn refuses longer heads
FRAMING = {"content-length", "transfer-encoding"}  # mutated headers that break HTTP framing


# ---- the client --------------------------------------------------------------------------------
class Fuzzer:
    """Sends requests to one server (http.client: exact control of the method, target,
    headers and body), counts them per route and keeps every 500."""

    def __init__(self, server, auth: dict[str, str]):
        self.host, port = server.url.removeprefix("http://").split(":")
        self.port = int(port)
        self.auth = auth
        self.counts: Counter = Counter()
        self.statuses: Counter = Counter()
        self.route_statuses: dict[str, Counter] = defaultdict(Counter)
        self.failures: list[str] = []
        self._local = threading.local()  # a connection per thread (concurrent pairs)
        self.lock = threading.Lock()
        self.current = None  # what is in flight (read by the RSS sampler)
        self.dropped = 0  # requests uvicorn's HTTP parser refused (see send)

    @property
    def conn(self) -> http.client.HTTPConnection | None:
        return getattr(self._local, "conn", None)

    @conn.setter
    def conn(self, c) -> None:
        self._local.conn = c

    def _connect(self):
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)

    def send(self, label: str, method: str, target: str, headers: dict | None = None,
             body: bytes | None = None, chunked: bool = False, auth: bool = True,
             count: bool = True, hangup: bool = False) -> tuple[int, bytes]:
        """One request; ``label`` (``"POST /v1/completions"``) is the route it counts for;
        ``hangup``: the client goes away once the response has started. Returns (status,
        body); status 0 when no response came (kept as a failure)."""
        h = {**(self.auth if auth else {}), **(headers or {})}
        if "host" not in {k.lower() for k in h}:
            h["Host"] = f"{self.host}:{self.port}"
        if count:
            with self.lock:
                self.counts[label] += 1
        self.current = f"{label} {target[:200]!r}"
        for attempt in range(2):
            if self.conn is None:
                self._connect()
            try:
                self.conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for k, v in h.items():
                    self.conn.putheader(k, v.encode("latin-1", "replace")
                                        if isinstance(v, str) else v)
                if body is not None and not chunked:
                    self.conn.putheader("Content-Length", str(len(body)))
                if chunked:
                    self.conn.putheader("Transfer-Encoding", "chunked")
                self.conn.endheaders()
                if body is not None:
                    if chunked:
                        for i in range(0, len(body), 8192):
                            part = body[i:i + 8192]
                            self.conn.send(b"%x\r\n%s\r\n" % (len(part), part))
                        self.conn.send(b"0\r\n\r\n")
                    else:
                        self.conn.send(body)
                resp = self.conn.getresponse()
                data = resp.read(64) if hangup else resp.read()
                if hangup or resp.getheader("connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                break
            except (http.client.HTTPException, OSError) as e:
                self.conn.close()
                self.conn = None
                if attempt == 0 and not isinstance(e, TimeoutError):
                    continue  # a kept-alive connection the server had closed: once more
                self.current = None
                head = len(target) + sum(len(k) + len(v) for k, v in h.items())
                if head > H11_MAX_HEAD or FRAMING & {k.lower() for k in h}:
                    # uvicorn's HTTP parser refused it (a 400 it may not get to send: the
                    # connection is reset with the body unread); the app never saw it
                    self.dropped += 1
                    status = self.send("health", "GET", "/health", count=False)[0]
                    if status == 200:
                        return 0, b""
                self.failures.append(f"{label}: no response ({e!r}) to {method} "
                                     f"{target[:300]!r} {h} body={(body or b'')[:500]!r}")
                return 0, b""
        self.current = None
        status = resp.status
        if count:
            with self.lock:
                self.statuses[status] += 1
                self.route_statuses[label][status] += 1
        if LOG is not None:
            LOG.write(f"{label}\t{status}\t{target[:100]!r}\t{(body or b'')[:300]!r}\t"
                      f"{data[:300]!r}\n")
        internal = status == 500 or (status == 200 and b"internal_server_error" in data
                                     and "event-stream" in (resp.getheader("content-type")
                                                            or ""))
        if internal or (status > 500 and status not in (501, 503, 504)):
            self.failures.append(
                f"{label}: {status} for {method} {target[:300]!r} headers={h} "
                f"body={(body or b'')[:1500]!r} -> {data[:1500]!r}")
        return status, data

    def json(self, label, method, path, obj=None, query: dict | None = None, **kw):
        body = None if obj is None else dumps(obj).encode("utf-8", "surrogatepass")
        headers = {"Content-Type": "application/json"} if body is not None else {}
        return self.send(label, method, path + qs(query), {**headers, **kw.pop("headers", {})},
                         body, **kw)


def qs(query: dict | None) -> str:
    if not query:
        return ""
    parts = []
    for k, v in query.items():
        for x in v if isinstance(v, list) else [v]:
            x = x if isinstance(x, str) else dumps(x)
            parts.append(f"{quote(str(k), safe='', errors='surrogatepass')}="
                         f"{quote(x, safe='', errors='surrogatepass')}")
    return "?" + "&".join(parts)


def run_examples(strategy, n: int, fn, salt: int) -> None:
    """``fn(x)`` for ``n`` examples of ``strategy`` (generation only: nothing to shrink, the
    failures are collected, not raised)."""

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(SEED * 1_000_003 + salt)
    @given(strategy)
    def run(x):
        fn(x)

    try:
        run()
    except Unsatisfiable:  # nothing to vary (e.g. no parameters in negative mode)
        pass


# ---- background: RSS and the victim -------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RSSWatch:
    """Samples this process's RSS every 10 ms; keeps the largest and what was in flight."""

    def __init__(self, fuzzer: Fuzzer):
        self.fuzzer = fuzzer
        self.base = rss_bytes()
        self.peak, self.at = self.base, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.01):
            r = rss_bytes()
            if r > self.peak:
                self.peak, self.at = r, self.fuzzer.current

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)


class Victims:
    """Greedy completions of ``VICTIM_PROMPT`` (streamed and not, in turn) one after another
    for the ``with`` block; each must come out as ``want``. ``lenient``: also accept the ends
    the locked server's settings cause by contract (an abort with a prefix of ``want``, a 503
    while asleep, a 504 past the request timeout, a 429 with the queue full)."""

    def __init__(self, url: str, headers: dict, want: list[int], lenient: bool = False):
        self.url, self.headers, self.want, self.lenient = url, headers, want, lenient
        self.done = self.ended_early = 0
        self.bad: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, stream: bool) -> None:
        body = {"prompt": VICTIM_PROMPT, "max_tokens": VICTIM_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": stream}
        r = requests.post(f"{self.url}/v1/completions", json=body, headers=self.headers,
                          timeout=120, stream=stream)
        if r.status_code != 200:
            if self.lenient and r.status_code in (429, 503, 504):
                self.ended_early += 1
                time.sleep(0.05)
                return
            self.bad.append(f"victim: {r.status_code} {r.text[:500]}")
            return
        ids, finish, errors = [], None, []
        if stream:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        errors.append(ev["error"])
                    for c in ev.get("choices", []):
                        ids += c.get("token_ids") or []
                        finish = c.get("finish_reason") or finish
        else:
            (c,) = r.json()["choices"]
            ids, finish = c["token_ids"], c["finish_reason"]
        if ids == self.want and not errors:
            self.done += 1
        elif self.lenient and (finish == "abort" or errors) and ids == self.want[:len(ids)] \
                and all(e.get("code") in ("engine_sleeping", "request_timeout", None)
                        and e.get("type") != "internal_server_error" for e in errors):
            self.ended_early += 1
        else:
            self.bad.append(f"victim changed: finish={finish} errors={errors} ids={ids} "
                            f"want={self.want}")

    def _run(self):
        stream = False
        while not self.stop.is_set():
            try:
                self._one(stream)
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.bad.append(f"victim: {e!r}")
                time.sleep(0.1)
            stream = not stream

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(180)


# ---- strategies ------------------------------------------------------------------------------

def weighted(*pairs) -> st.SearchStrategy:
    """One of the strategies, chosen with the given integer weights."""
    total = sum(w for w, _ in pairs)

    def pick(i):
        for w, s in pairs:
            if i < w:
                return s
            i -= w

    return st.integers(0, total - 1).flatmap(pick)


def field(valid, bad=()) -> st.SearchStrategy:
    """A request field: mostly valid, sometimes one of ``bad`` or of the generic ``NASTY``."""
    valid = valid if isinstance(valid, st.SearchStrategy) else st.sampled_from(list(valid))
    return weighted((16, valid), (1, st.sampled_from(list(bad) or NASTY)), (1, nasty()))


def body(required: dict, optional: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries(required, optional=optional)


WORDS = st.sampled_from(["Hello", "def fib(n):", "1 + 1 =", "\n\n", "<|im_end|>",
                         "<|endoftext|>", "é中🙂"])
TEXT = st.text(max_size=24) | WORDS
TEXT1 = st.text(min_size=1, max_size=24) | WORDS  # a prompt: not empty
BOOL = field(st.booleans(), ["true", 1, 0, None])
UNICODE_DIGITS = ["²", "١٢", "１２", "⁵", "①"]


def sampling_opts(vocab: int) -> dict:
    """The sampling fields the OpenAI routes share (``SamplingFields``)."""
    ids = st.lists(st.integers(0, vocab - 1), max_size=4)
    return {
        "model": field(["tiny"], ["other", "", 5]),
        "n": field(st.integers(1, 4), [0, -1, 5, 10 ** 9, 2 ** 64, 1.0, "2"]),
        "temperature": field(st.floats(0, 2) | st.just(1e-9),
                             [-0.1, -1e308, "1", 1e308]),
        "top_p": field(st.floats(1e-6, 1) | st.just(1.0), [0, 1.0000001, -1, 2]),
        "top_k": field(st.integers(-1, 64) | st.sampled_from([vocab - 1, vocab, vocab + 1,
                                                              2 ** 31, 2 ** 63 - 1]),
                       [-2, 2 ** 64, 1.5, -(2 ** 63)]),
        "min_p": field(st.floats(0, 1), [-0.1, 1.1]),
        "seed": field(st.integers(-(2 ** 63), 2 ** 64 - 1), [2 ** 64, -(2 ** 63) - 1, 1.0]),
        "stop": field(st.none() | TEXT.filter(bool) | st.lists(TEXT.filter(bool), max_size=4),
                      ["", [""], ["x" * 17], ["a"] * 5, [1], [None]]),
        "stop_token_ids": field(st.none() | ids, [[vocab], [-1], [1.5], [True], [0] * 300,
                                                  "1", [2 ** 64]]),
        "min_tokens": field(st.integers(0, 8), [-1, 2 ** 40, 17]),
        "presence_penalty": field(st.floats(-2, 2), [2.5, -3]),
        "frequency_penalty": field(st.floats(-2, 2), [2.5, -3]),
        "repetition_penalty": field(st.floats(0.05, 3), [0, -1, 1e-320]),
        "logit_bias": field([None, {}], [{"1": 1.0}, {"x": "y"}]),
        "user": field(TEXT),
        "ignore_eos": BOOL, "include_stop_str_in_output": BOOL, "skip_special_tokens": BOOL,
        "return_token_ids": BOOL, "return_tokens_as_token_ids": BOOL,
        "stream": BOOL,
        "stream_options": field(st.none() | st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(),
                          "continuous_usage_stats": st.booleans()}), [{"x": 1}, []]),
    }


def max_tokens_field():
    return field(st.none() | st.integers(1, 12) | st.integers(1, MAX_LEN),
                 [0, -1, MAX_LEN + 1, 2 ** 63, 2 ** 64, 1.5])


def prompts_field(vocab: int, long_text: str):
    ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24)
    return field(TEXT1 | st.lists(TEXT1, min_size=1, max_size=4) | ids
                 | st.lists(ids, min_size=1, max_size=4),
                 ["", [], [[]], [vocab], [-1], [2 ** 64], ["a", 1], [[1], []], [[1], "a"],
                  long_text, [long_text], ["a"] * 5, [[1]] * 5, ["a"] * 10_000,
                  list(range(MAX_LEN)), [[0] * (MAX_LEN - 1)], {"prompt": "x"}])


def message(role=None):
    content = TEXT | st.none() | st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": TEXT}), max_size=2)
    msg = st.fixed_dictionaries({"role": role or st.sampled_from(
        ["user", "system", "assistant", "tool", "developer"]), "content": content})
    return field(msg, [{"role": 1}, {"content": "x"}, {"role": "user", "content": 5},
                       {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                       {"role": "user", "content": "x", "tool_calls": [{}]}, "hi", None])


def conversation():
    return field(st.lists(message(), min_size=1, max_size=3),
                 [[], "hi", [[]], [None], [{"role": "user", "content": "x" * 200_000}]])


TEMPLATES = ["{% for m in messages %}{{ m['content'] }}{% endfor %}", "{% for %}",
             "{{ raise_exception('no') }}", "{{ foo.bar.baz }}", "",
             "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
             "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{ messages[99] }}",
             "{{ ''.__class__.__mro__ }}", "{{ bos_token }}{{ add_generation_prompt }}"]


def template_fields() -> dict:
    return {
        "chat_template_kwargs": field(st.none() | st.just({}) | st.fixed_dictionaries(
            {}, optional={"enable_thinking": st.booleans(), "foo": TEXT}),
            [{"tokenize": True}, {"chat_template": TEMPLATES[0]}, {"conversation": []},
             {"return_tensors": "pt"}, []]),
        "chat_template": weighted((6, st.just(MISSING)), (2, st.sampled_from(TEMPLATES)),
                                  (1, nasty())),
    }


def completion_body(vocab, long_text):
    return body({"prompt": prompts_field(vocab, long_text)}, {
        **sampling_opts(vocab), "max_tokens": max_tokens_field(),
        "logprobs": field(st.none() | st.integers(0, 20), [-1, 21, vocab, 2 ** 63]),
        "echo": field([False], [True]), "best_of": field([None, 1], [2, 0]),
        "suffix": field([None], ["x"]), "add_special_tokens": BOOL})


def chat_body(vocab):
    return body({"messages": conversation()}, {
        **sampling_opts(vocab), **template_fields(), "max_tokens": max_tokens_field(),
        "max_completion_tokens": max_tokens_field(), "logprobs": BOOL,
        "top_logprobs": field(st.none() | st.integers(0, 20), [-1, 21, 2 ** 63]),
        "response_format": field([None, {"type": "text"}], [{"type": "json_object"}]),
        "tools": field([None, []], [[{"type": "function"}]]),
        "tool_choice": field([None, "none"], ["auto", {}]),
        "parallel_tool_calls": BOOL, "metadata": field([None, {}, {"a": "b"}]),
        "store": BOOL, "add_generation_prompt": BOOL})


def generation_kwargs(vocab):
    """TRL's ``generation_kwargs``: any ``SamplingParams`` field (and unknown ones) with valid,
    boundary and invalid values."""
    per_key = {**sampling_opts(vocab), "max_tokens": max_tokens_field(),
               "logprobs": field(st.none() | st.integers(0, 20), [-1, 21, 2 ** 63]),
               "prompt_logprobs": field(st.none() | st.integers(0, 20), [-1, 21, vocab]),
               "return_hidden_states": field([False], [True, 1])}
    keys = sorted(sampling_fields()) + ["bogus", "structured_outputs", "logits_processors"]
    pair = st.sampled_from(keys).flatmap(lambda k: st.tuples(st.just(k),
                                                             per_key.get(k, nasty())))
    return field(st.lists(pair, max_size=4).map(dict), [[], "x", {"n": {"x": 1}}])


def trl_opts(vocab):
    return {
        "n": field(st.integers(1, 4), [0, 5, 2 ** 64]),
        "repetition_penalty": field(st.floats(0.05, 3), [0, -1]),
        "temperature": field(st.floats(0, 2), [-1]),
        "top_p": field(st.floats(1e-6, 1), [0, 2]),
        "top_k": field(st.integers(-1, 64) | st.just(vocab + 1), [-2]),
        "min_p": field(st.floats(0, 1), [2]),
        "max_tokens": field(st.integers(1, 12) | st.integers(1, MAX_LEN), [0, MAX_LEN + 1]),
        "logprobs": field(st.none() | st.integers(0, 20), [-1, 21, vocab]),
        "truncate_prompt_tokens": field(st.none() | st.integers(1, 100), [0, -1, 2 ** 64]),
        "structured_outputs_regex": field([None], ["a+"]),
        "generation_kwargs": generation_kwargs(vocab),
    }


def trl_generate_body(vocab, long_text):
    ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24)
    return body({"prompts": field(st.lists(TEXT1, min_size=1, max_size=4)
                                  | st.lists(ids, min_size=1, max_size=4),
                                  [[], ["a"] * 5, [[]], [[vocab]], ["a", [1]], [long_text]])},
                {**trl_opts(vocab), "images": field([None, [None]], [["x"]]),
                 "guided_decoding_regex": field([None], ["x"])})


def trl_chat_body(vocab):
    return body({"messages": field(st.lists(st.lists(message(), min_size=1, max_size=2),
                                            min_size=1, max_size=3), [[], [[]], [[None]]])},
                {**trl_opts(vocab), **template_fields(), "tools": field([None, []], [[{}]])})


# ---- mutations of any request ----------------------------------------------------------------
CTYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
          "application/json; charset=latin-1", "application/json; charset=utf-16",
          "APPLICATION/JSON", "application/octet-stream", "application/xml", "\x7f", "",
          "application/json;;;", "application/jsonx"]
RAW_BODIES = [b"", b"{", b"}", b"\xff\xfe\x00", b"null", b"[]", b"1", b'"x"', b"{}" * 3,
              b'{"n": 1, "n": 2}', b"\xef\xbb\xbf{}", '{"prompt": "x"}'.encode("utf-16"),
              b'{"prompt": "x"} trailing', b"[" * 100_000, b'{"prompt": "\xed\xa0\x80"}',
              b'{"prompt": "\\ud800\\udc00"}', b'{"prompts": ["\\udfff"]}', b"\x00" * 1000,
              b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
              b"x" * (2 << 20)]
HEADER_SETS = [
    {"Host": "evil.example"}, {"Host": "localhost:1"}, {"Host": "[::1]"}, {"Host": ""},
    {"Host": "a" * 5000}, {"Origin": "http://evil.example"}, {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-origin"},
    {"Authorization": "Bearer wrong"}, {"Authorization": "Basic Zm9vOmJhcg=="},
    {"Authorization": b"Bearer \xff\xfe"}, {"Authorization": "Bearer " + KEY + " "},
    {"Authorization": ""}, {"Content-Length": "abc"}, {"Accept": "text/event-stream"},
    {"Transfer-Encoding": "gzip"}, {"Content-Encoding": "gzip"}, {"X-" + "a" * 100: "b" * 8000},
]
QUERY_VALUE = TEXT | nasty().map(lambda v: str(v)[:3000])
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO"]


def mutation() -> st.SearchStrategy:
    """Nothing (most often), or one change to a request: a JSON value replaced by a nasty
    one, a raw body, a content type, chunked transfer, odd headers, another method, no key,
    a client that goes away once the response has started."""
    one = st.one_of(
        st.tuples(st.just("leaf"), st.tuples(st.integers(0, 10 ** 6), nasty())),
        st.tuples(st.just("add"), st.tuples(TEXT | st.sampled_from(["\ud800", ""]), nasty())),
        st.tuples(st.just("ctype"), st.sampled_from(CTYPES)),
        st.tuples(st.just("raw"), st.sampled_from(RAW_BODIES)),
        st.tuples(st.just("chunked"), st.just(True)),
        st.tuples(st.just("headers"), st.sampled_from(HEADER_SETS)),
        st.tuples(st.just("method"), st.sampled_from(METHODS)),
        st.tuples(st.just("noauth"), st.just(True)),
        st.tuples(st.just("hangup"), st.just(True)),
        st.tuples(st.just("query"), st.dictionaries(TEXT, QUERY_VALUE, max_size=3)))
    return weighted((3, st.just(None)), (1, one))


def leaf_paths(x, path=()):
    yield path
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaf_paths(v, path + (k,))
    elif isinstance(x, list) and not isinstance(x, Raw):
        for i, v in enumerate(x[:50]):
            yield from leaf_paths(v, path + (i,))


def replaced(x, path, value):
    if not path:
        return value
    x = dict(x) if isinstance(x, dict) else list(x)
    x[path[0]] = replaced(x[path[0]], path[1:], value)
    return x


# ---- requests ------------------------------------------------------------------------------------
def send(fz: Fuzzer, label: str, method: str, path: str, query=None, obj=MISSING, raw=None,
         ctype=None, mut=None, headers=None) -> tuple[int, bytes]:
    """Send one request after applying the mutation ``mut`` (``mutation()``)."""
    headers = {k: v for k, v in (headers or {}).items()}
    chunked = close = hangup = False
    auth = True
    if mut is not None:
        kind, v = mut
        if kind == "leaf" and obj is not MISSING:
            paths = list(leaf_paths(obj))
            obj = replaced(obj, paths[v[0] % len(paths)], v[1])
        elif kind == "add":
            obj = {**obj, v[0]: v[1]} if isinstance(obj, dict) else {v[0]: v[1]}
        elif kind == "ctype":
            ctype = v
        elif kind == "raw":
            raw, obj = v, MISSING
        elif kind == "chunked":
            chunked = True
        elif kind == "headers":
            headers.update(v)
            close = True
        elif kind == "method":
            method = v
        elif kind == "noauth":
            auth = False
        elif kind == "hangup":
            hangup = True
        elif kind == "query":
            query = {**(query or {}), **v}
    data = raw if raw is not None else \
        None if obj is MISSING else dumps(obj).encode("utf-8", "surrogatepass")
    if data is not None and ctype is None:
        ctype = "application/json"
    if ctype is not None:
        headers.setdefault("Content-Type", ctype)
    if chunked and data is None:
        data = b""
    out = fz.send(label, method, path + qs(query), headers, data, chunked=chunked, auth=auth,
                  hangup=hangup)
    if close and fz.conn is not None:
        fz.conn.close()
        fz.conn = None
    return out


def send_case(fz: Fuzzer, case, mut) -> None:
    """Send a schemathesis ``Case``."""
    from schemathesis.core import NotSet

    obj, raw, ctype = MISSING, None, None
    b = case.body
    if not isinstance(b, NotSet):
        ctype = case.media_type
        if isinstance(b, (bytes, bytearray)):
            raw = bytes(b)
        elif isinstance(b, str) and not (ctype and "json" in ctype):
            raw = b.encode("utf-8", "surrogatepass")
        else:
            obj = b
    headers = {str(k): str(v) for k, v in (case.headers or {}).items()}
    send(fz, f"{case.method.upper()} {case.operation.path}", case.method.upper(),
         case.formatted_path, case.query, obj, raw, ctype, mut, headers)


def noise(method: str, path: str) -> st.SearchStrategy:
    """Any route, whatever its schema: its method (or another), odd query strings, any
    body, any content type (for the routes outside the schema, and the schema's routes
    without parameters)."""
    anybody = st.one_of(st.just(MISSING), nasty(), st.dictionaries(TEXT, nasty(), max_size=3))
    return st.fixed_dictionaries({
        "method": weighted((4, st.just(method)), (1, st.sampled_from(METHODS))),
        "query": st.none() | st.dictionaries(TEXT | st.just("\ud800"), QUERY_VALUE,
                                             max_size=3),
        "obj": anybody, "mut": mutation()})


# ---- control routes (locked server) --------------------------------------------------------------
NORMS = ["model.norm.weight", "model.layers.0.input_layernorm.weight",
         "model.layers.1.self_attn.k_proj.weight", "model.layers.2.mlp.up_proj.weight"]
NAN = {"float32": b"\x00\x00\xc0\x7f", "float16": b"\x00\x7e", "bfloat16": b"\xc0\x7f",
       "float64": b"\x00" * 6 + b"\xf8\x7f"}


def tensor_entry(weights: dict) -> st.SearchStrategy:
    """One tensor as ``/update_named_param/`` takes it: a real name with its exact float32
    bytes (an update that changes nothing, so the victim stays the same), NaN of the right
    size (refused), the wrong size or shape, an unknown name or dtype, bad base64, ..."""

    def build(name, kind, dtype, shape_kind, extra):
        real = weights.get(name)
        shape = list(real.shape) if real is not None else [4]
        if shape_kind == "neg":
            shape = [-1] + shape
        elif shape_kind == "huge":
            shape = [2 ** 40, 2 ** 40]
        elif shape_kind == "empty":
            shape = [0]
        elif shape_kind == "scalar":
            shape = []
        n = 1
        for d in shape:
            n *= max(d, 0)
        if kind == "copy" and real is not None and shape_kind == "same":
            data = base64.b64encode(real.contiguous().view(-1).numpy().tobytes()).decode()
            dtype = "float32"
        elif kind == "nan" and n < 10 ** 6:
            data = base64.b64encode(NAN.get(dtype.removeprefix("torch."), b"\x00") * n)
            data = data.decode()
        elif kind == "short":
            data = base64.b64encode(b"\x00" * 3).decode()
        elif kind == "b64":
            data = extra
        else:
            data = None
        return {"name": name, "dtype": dtype, "shape": shape, "data": data}

    return st.builds(
        build, st.sampled_from(NORMS + ["model.nope.weight", "", "lm_head.weight", "\ud800"]),
        st.sampled_from(["copy", "copy", "nan", "short", "b64", "none"]),
        st.sampled_from(["float32", "torch.float32", "bfloat16", "float16", "float64", "int8",
                         "torch.int64", "", "float"]),
        st.sampled_from(["same"] * 4 + ["neg", "huge", "empty", "scalar"]),
        st.sampled_from(["!!!", "AAA", "", "A" * 5, "====", "\ud800"]))


def raw_bytes(data: str | None) -> bytes:
    """The bytes a tensor entry's ``data`` stands for (``\x00`` when it is not base64)."""
    try:
        return base64.b64decode(data or "", validate=True) or b"\x00"
    except (ValueError, TypeError):
        return b"\x00"


def control_requests(ckpt: str, root: str, weights: dict) -> dict:
    """Hand-written requests for each control route: ``path -> strategy`` of ``(method,
    query, obj, raw, ctype)``."""
    tags = field(st.none() | st.lists(st.sampled_from(["weights", "kv_cache", "cuda_graph"]),
                                      max_size=3, unique=True), [["x"], "weights", [None]])
    version = field(st.none() | st.integers(0, 10 ** 6) | st.integers(0, 99).map(str),
                    ["x", -1, 2 ** 64, "-1", "", "9" * 5000] + UNICODE_DIGITS)
    mode = field(st.sampled_from(["keep", "abort", "retract", "in_place"]),
                 ["", "KEEP", "pause", "\ud800"])
    paths = st.sampled_from([ckpt, root, f"{root}/escape", f"{ckpt}/model.safetensors", "", "/",
                             "/etc/passwd", "../x", f"{ckpt}/../ckpt", "a\x00b", "x" * 5000,
                             "/nonexistent", "ckpt", f"{root}/escape/model.safetensors",
                             "~", "\ud800", f"{ckpt}/config.json"])

    def js(strategy):
        return strategy.map(lambda o: ("POST", None, o, None, None))

    def in_query(key, values):
        return st.sampled_from(values).map(lambda v: ("POST", {key: v}, MISSING, None, None))

    entry = tensor_entry(weights)
    octet = st.tuples(entry, st.sampled_from(["application/octet-stream"])).map(
        lambda ec: ("POST", {"name": ec[0]["name"], "dtype": ec[0]["dtype"],
                             "shape": ",".join(map(str, ec[0]["shape"]))}, MISSING,
                    raw_bytes(ec[0]["data"]), ec[1]))
    return {
        "/sleep": js(body({}, {"level": field([1, 2], [0, 3, "1", 1.0, True])}))
        | in_query("level", ["1", "2", "0", "x", "1e3", "", "-1", "9" * 30] + UNICODE_DIGITS),
        "/wake_up": js(body({}, {"tags": tags}))
        | in_query("tags", ["weights", "kv_cache", "x", "", "\ud800"]),
        "/release_memory_occupation": js(body({}, {"tags": tags})),
        "/resume_memory_occupation": js(body({}, {"tags": tags})),
        "/update_weights_from_disk": js(body({"model_path": field(paths)}, {
            "load_format": field([None, "auto", "safetensors"], ["pt", "gguf", ""]),
            "weight_version": version, "abort_all_requests": BOOL, "flush_cache": BOOL})),
        "/pause": js(body({}, {"mode": mode})) | in_query("mode", ["keep", "abort", "x"]),
        "/pause_generation": js(body({}, {"mode": mode})),
        "/resume": js(st.just(MISSING) | nasty()),
        "/continue_generation": js(st.just(MISSING) | nasty()),
        "/start_weight_update": js(body({}, {"is_checkpoint_format": BOOL})),
        "/finish_weight_update": js(body({}, {"weight_version": version})),
        "/abort_weight_update": js(st.just(MISSING)),
        "/update_weights": js(entry | st.lists(entry, max_size=3).map(
            lambda es: {"named_tensors": es}) | body({}, {"named_tensors": nasty()})) | octet,
        "/update_named_param/": js(entry) | octet,
    }


class Restorer:
    """Brings the locked server back to serving after a request paused it, put it to sleep
    or discarded its weights (so that the next request fuzzes a serving server)."""

    def __init__(self, fz: Fuzzer, llm, ckpt: str):
        self.fz, self.llm, self.ckpt = fz, llm, ckpt
        self.restores: Counter = Counter()

    def __call__(self) -> None:
        llm = self.llm
        if llm.is_paused():
            self.restores["resume"] += 1
            self.fz.send("restore", "POST", "/resume", count=False)
        if llm.is_sleeping():
            self.restores["wake_up"] += 1
            self.fz.send("restore", "POST", "/wake_up", count=False)
        if llm.memory.weights == "discarded" or llm.memory.missing:
            self.restores["reload"] += 1
            self.fz.send("restore", "POST", "/abort_weight_update", count=False)  # one open?
            status, data = self.fz.send("restore", "POST", "/update_weights_from_disk",
                                        {"Content-Type": "application/json"},
                                        json.dumps({"model_path": self.ckpt}).encode(),
                                        count=False)
            assert status == 200, data
        assert not llm.is_paused() and not llm.is_sleeping() and not llm.memory.missing, \
            "could not restore the server"


# ---- the runs ------------------------------------------------------------------------------------
N_SCHEMA = 15  # per operation of the schema and per mode (positive, negative)
N_NOISE = 8  # per served route
N_OFF = 3  # for each of the above on the default server's control routes (all 404)
N_GEN = 120  # per generation route, pairs of hand-written bodies sent at once
N_CONTROL = 16  # per control route, hand-written requests (locked)


def fuzz(s, app, llm, fz: Fuzzer, want: list[int], locked: bool, ckpt: str | None = None,
         root: str | None = None, weights: dict | None = None) -> dict:
    """Every phase against one server, with the victims running and the RSS watched."""
    state = app.state.server
    vocab = state.vocab_size
    long_text = "a" * (2 * MAX_LEN * state.max_token_bytes + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schema = schemathesis.openapi.from_dict(fuzz_schema(app))
        ops = [r.ok() for r in schema.get_all_operations()]
    restore = Restorer(fz, llm, ckpt) if locked else (lambda: None)
    routes = served_routes(app)
    timings = {}
    gen = [("/v1/completions", completion_body(vocab, long_text)),
           ("/v1/chat/completions", chat_body(vocab)),
           ("/generate/", trl_generate_body(vocab, long_text)), ("/chat/", trl_chat_body(vocab))]
    with RSSWatch(fz) as rss, Victims(s.url, fz.auth, want, lenient=locked) as victims:
        t0 = time.time()
        for i, op in enumerate(ops):
            n = N_SCHEMA if locked or not is_control_path(op.path) else N_OFF
            for j, mode in enumerate(schemathesis.GenerationMode):
                def one(cm):
                    send_case(fz, *cm)
                    restore()

                run_examples(st.tuples(op.as_strategy(generation_mode=mode), mutation()),
                             examples(n), one, salt=100 * i + j)
        timings["schema"] = time.time() - t0

        t0 = time.time()
        for k, (method, path) in enumerate(routes):
            def one(d, method=method, path=path):
                send(fz, f"{method} {path}", d["method"], path, d["query"], d["obj"],
                     mut=d["mut"])
                restore()

            n = N_NOISE if locked or not is_control_path(path) else N_OFF
            run_examples(noise(method, path), examples(n), one, salt=10_000 + k)
        timings["noise"] = time.time() - t0

        t0 = time.time()
        anyone = st.sampled_from(range(len(gen))).flatmap(
            lambda k: st.tuples(st.just(k), gen[k][1], mutation()))
        for k in range(len(gen)):
            def one(pair):  # two requests at once: they share engine steps
                threads = [threading.Thread(target=send, args=(
                    fz, f"POST {gen[i][0]}", "POST", gen[i][0]), kwargs={"obj": b, "mut": m})
                    for i, b, m in pair]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            run_examples(st.tuples(st.tuples(st.just(k), gen[k][1], mutation()), anyone),
                         examples(N_GEN), one, salt=20_000 + k)
        timings["generation"] = time.time() - t0

        if locked:
            t0 = time.time()
            for k, (path, strategy) in enumerate(control_requests(ckpt, root,
                                                                  weights).items()):
                def one(x, path=path):
                    # a generation request in flight (often) while the control request runs
                    (method, query, obj, raw, ctype), mut, (i, b, m), delay = x
                    t = threading.Thread(target=send, args=(
                        fz, f"POST {gen[i][0]}", "POST", gen[i][0]), kwargs={"obj": b, "mut": m})
                    t.start()
                    time.sleep(delay)
                    send(fz, f"POST {path}", method, path, query, obj, raw, ctype, mut=mut)
                    restore()  # resumes a paused server: the generation request goes on
                    t.join()
                    restore()

                run_examples(st.tuples(strategy, mutation(), anyone,
                                       st.sampled_from([0, 0.005, 0.02, 0.1])),
                             examples(N_CONTROL), one, salt=30_000 + k)
            timings["control"] = time.time() - t0
    return {"rss": rss, "victims": victims, "timings": timings, "routes": routes,
            "restores": getattr(restore, "restores", None)}


def loop_stats(s, fz: Fuzzer) -> dict:
    return requests.get(f"{s.url}/metrics", headers=fz.auth, timeout=30).json()["server"]


def check(s, fz: Fuzzer, result: dict, name: str) -> None:
    """The assertions every configuration shares (and a summary on stdout)."""
    rss, victims, routes = result["rss"], result["victims"], result["routes"]
    total = sum(fz.counts.values())
    print(f"\n[{name}] {total} requests; statuses {dict(sorted(fz.statuses.items()))}; "
          f"seconds {({k: round(v, 1) for k, v in result['timings'].items()})}; victims "
          f"{victims.done} identical, {victims.ended_early} ended by contract; RSS "
          f"{rss.base >> 20} MiB -> peak {rss.peak >> 20} MiB (at {rss.at}); restores "
          f"{dict(result['restores'] or {})}; refused by uvicorn's HTTP parser: {fz.dropped}; "
          f"engine loop {loop_stats(s, fz)}")
    for label, n in sorted(fz.counts.items(), key=lambda kv: kv[0].split(" ", 1)[::-1]):
        print(f"  {n:5d}  {label:32s} {dict(sorted(fz.route_statuses[label].items()))}")
    assert not fz.failures, f"{len(fz.failures)} internal errors:\n" + "\n\n".join(
        fz.failures[:20])
    assert total >= MIN_REQUESTS // 2 or SCALE < 1, total
    missed = {f"{m} {p}" for m, p in routes} - set(fz.counts)
    assert not missed, f"routes never fuzzed: {sorted(missed)}"
    assert not victims.bad, victims.bad[:5]
    assert victims.done >= 3, "the victims did not run through the fuzzing"
    status, _ = fz.send("health", "GET", "/health", count=False)
    assert status == 200
    deadline = time.time() + 20
    while True:
        m = requests.get(f"{s.url}/metrics", headers=fz.auth, timeout=30).json()
        if m["kv_blocks_free"] == m["kv_blocks_total"]:
            break
        assert time.time() < deadline, f"KV blocks still in use: {m}"
        time.sleep(0.05)
    # no engine step failed (a request validation let through that the engine chokes on; its
    # own response may have gone to a client that hung up)
    loop = m["server"]
    assert loop["step_failures"] == 0 and loop["unexplained_step_failures"] == 0, loop
    assert rss.peak - rss.base <= RSS_MARGIN, (
        f"RSS grew by {(rss.peak - rss.base) >> 20} MiB (peak while {rss.at})")


@pytest.fixture(scope="module")
def ref(tiny_llama_tok_dir):
    return make_llm(tiny_llama_tok_dir)


@pytest.fixture(scope="module")
def want(ref) -> list[int]:
    return ref.generate([VICTIM_PROMPT], SamplingParams(temperature=0, max_tokens=VICTIM_TOKENS,
                                                        ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids


def test_fuzz_default_options(tiny_llama_tok_dir, want):
    """The security defaults (no key, control routes off: they answer 404) with low limits."""
    llm = make_llm(tiny_llama_tok_dir)
    app = build_app(llm, "tiny", request_timeout=30, **LIMITS)
    with Server(app) as s:
        fz = Fuzzer(s, {})
        result = fuzz(s, app, llm, fz, want, locked=False)
        check(s, fz, result, "default options")


def test_fuzz_locked_with_control_routes(tiny_llama_tok_dir, want, tmp_path):
    """An API key, control routes on (pause, sleep, weight pushes and loads fuzzed too),
    request chat templates trusted (0.5 s limit), small body limits, 6 queued requests (429s)
    and a 2 s request timeout (504s)."""
    root = tmp_path / "allowed"
    (root / "ckpt").mkdir(parents=True)
    for f in tiny_llama_tok_dir.glob("*.safetensors"):
        shutil.copy(f, root / "ckpt" / f.name)
    os.symlink(tiny_llama_tok_dir, root / "escape")
    weights = {}
    for f in tiny_llama_tok_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            weights.update({k: sf.get_tensor(k) for k in sf.keys() if k in NORMS})
    llm = make_llm(tiny_llama_tok_dir)
    app = build_app(llm, "tiny", api_key=KEY, enable_control_routes=True,
                    trust_request_chat_template=True, chat_template_timeout=0.5,
                    allowed_weight_dirs=[str(root)], max_request_body_bytes=64 << 10,
                    max_weight_body_bytes=256 << 10,
                    **{**LIMITS, "max_queued_requests": 6, "request_timeout": 2})
    with Server(app) as s:
        fz = Fuzzer(s, {"Authorization": f"Bearer {KEY}"})
        result = fuzz(s, app, llm, fz, want, locked=True, ckpt=str(root / "ckpt"),
                      root=str(root), weights=weights)
        check(s, fz, result, "locked, control routes on")
        assert llm.weight_version >= 1, "no weight update was applied during the fuzzing"


# ---- what the fuzzing found ------------------------------------------------------------------
DEEP = "[" * 5000 + "]" * 5000
REGRESSIONS = [  # (route, raw JSON body, the param the 400 names)
    # json.loads raised RecursionError (a 500) before the body reached its parser
    ("/update_weights", '{"named_tensors": ' + DEEP + "}", None),
    ("/update_weights", '{"x": ' + DEEP + "}", None),
    # "①" and "²" pass str.isdigit but not int(): a 500 from weight_version's parsing
    ("/finish_weight_update", '{"weight_version": "\\u2460"}', "weight_version"),
    ("/finish_weight_update", '{"weight_version": "\\u00b2"}', "weight_version"),
    ("/finish_weight_update", '{"weight_version": "' + "9" * 5000 + '"}', "weight_version"),
    ("/update_weights_from_disk", '{"model_path": "/x", "weight_version": "\\u00b2"}',
     "weight_version"),
]


@pytest.mark.parametrize("route,raw,param", REGRESSIONS)
def test_fuzz_findings_are_400s(locked_small, route, raw, param):
    """Each request the fuzzing once got a 500 for is a 400 naming its field."""
    r = requests.post(f"{locked_small}{route}", data=raw.encode(), timeout=60, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert requests.get(f"{locked_small}/health", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def locked_small(tiny_llama_tok_dir):
    app = build_app(make_llm(tiny_llama_tok_dir), "tiny", api_key=KEY,
                    enable_control_routes=True)
    with Server(app) as s:
        yield s.url
