"""What every route needs: the served ``LLM``, its ``AsyncEngine``, the model's name, the
server's options (limits, authentication, control routes: ``ServerOptions``), and request
preparation (tokenize, render chat templates off the event loop, validate, admit, submit,
wait) shared by the OpenAI and TRL routes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import ipaddress
import math
import os
import sys
import time
from dataclasses import dataclass, field

from starlette.requests import Request

from specengine.engine.outputs import RequestOutput
from specengine.kv.block_manager import cdiv
from specengine.sampling.params import SamplingParams
from specengine.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    RequestAborted,
)
from specengine.server.protocol import APIError

DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks whether its client is gone
MiB, GiB = 1 << 20, 1 << 30

# Host memory one request's outputs take, per token (measured with tracemalloc on CPython
# 3.11): a token id in a list ~40 bytes; with logprobs a {token: Logprob} dict per token,
# ~400 bytes for the sampled token alone and ~185 bytes per further top entry.
TOKEN_BYTES = 40
LOGPROB_DICT_BYTES = 400
LOGPROB_ENTRY_BYTES = 185

# Arguments of transformers' ``apply_chat_template`` that ``chat_template_kwargs`` must not
# set (they change what is rendered or returned, not what the template sees).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts connections from this
    machine."""
    h = host.strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


@dataclass
class ServerOptions:
    """How ``specengine serve`` limits, authenticates and exposes itself; every field is a
    flag of ``specengine serve`` (``--api-key``, ``--max-queued-requests``, ...) and a keyword
    of ``build_app``. The defaults are the safe ones: loopback only, no control routes, no
    request-supplied chat templates, no weights from disk.

    Attributes:
        api_key: when set, every route but ``/health`` (and TRL's ``/health/``) needs
            ``Authorization: Bearer <api_key>`` (401 otherwise; compared in constant time).
            The CLI reads ``SPECENGINE_API_KEY`` when ``--api-key`` is not given.
        enable_control_routes: serve the routes that change the server (sleep / wake-up,
            weight pushes and weights from disk, prefix-cache reset, TRL's
            ``/update_named_param/``, ``/init_communicator/``, ``/close_communicator/``,
            ``/reset_prefix_cache/``); off: they answer 404. On, they accept only
            ``application/json`` or ``application/octet-stream`` bodies (415), or none, and
            refuse requests a browser marks as cross-site (403).
        host: the address served; decides ``allowed_hosts``' default.
        allowed_hosts: the ``Host`` header values accepted (port ignored; ``"*"``: any), else
            a 400. None: ``localhost`` / ``127.0.0.1`` / ``[::1]`` when ``host`` is a
            loopback address (a web page that rebinds its own DNS name to 127.0.0.1 cannot
            reach the server), any host otherwise.
        trust_request_chat_template: accept a ``chat_template`` in the request (or in
            ``chat_template_kwargs``); off: a 400.
        chat_template_timeout: seconds a chat template may take to render (it runs on a
            worker thread, never on the event loop); longer: the render is stopped, a 400.
        allowed_weight_dirs: directories ``/update_weights_from_disk`` may load from (the
            path, symlinks resolved, must be below one; ``..`` is refused). Empty: the route
            refuses every path.
        max_request_body_bytes: largest request body, bytes (413), weight pushes excepted.
        max_weight_body_bytes: largest body of a weight push (``/update_named_param/``,
            ``/update_weights``), bytes (413).
        max_queued_requests: most engine requests (one per prompt) admitted and not finished,
            running or waiting, over all clients; a request that would pass it is a 429 with
            ``Retry-After`` (SGLang's ``--max-queued-requests``).
        max_n: most samples per prompt (``n``); the engine's ``max_num_seqs`` caps it too (the
            samples of a prompt are admitted together).
        max_prompts_per_request: most prompts in one request (batch completions, TRL's
            ``/generate/`` and ``/chat/``).
        max_stop_strings: most stop strings per request; max_stop_string_len: the longest, in
            characters; max_stop_token_ids: most stop token ids.
        request_timeout: seconds from admission until a request must have finished; then it is
            aborted (its KV freed) and answered 504 (a stream gets an error event); 0 or None:
            no limit.
        max_request_memory_bytes: most host memory the outputs of one request may take at
            their longest (token ids, and logprob entries: see ``request_memory_bytes``), bytes;
            more: a 400 naming ``n`` (or ``logprobs`` when logprobs make the difference).
    """

    api_key: str | None = None
    enable_control_routes: bool = False
    host: str = "127.0.0.1"
    allowed_hosts: list[str] | None = None
    trust_request_chat_template: bool = False
    chat_template_timeout: float = 10.0
    allowed_weight_dirs: list[str] = field(default_factory=list)
    max_request_body_bytes: int = 16 * MiB
    max_weight_body_bytes: int = 4 * GiB
    max_queued_requests: int = 4096
    max_n: int = 256
    max_prompts_per_request: int = 1024
    max_stop_strings: int = 16
    max_stop_string_len: int = 512
    max_stop_token_ids: int = 256
    request_timeout: float | None = 1800.0
    max_request_memory_bytes: int = 1 * GiB

    def __post_init__(self):
        for name in ("max_request_body_bytes", "max_weight_body_bytes", "max_queued_requests",
                     "max_n", "max_prompts_per_request", "max_stop_strings",
                     "max_stop_string_len", "max_stop_token_ids", "max_request_memory_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ServerOptions.{name}={v!r}: must be an integer >= 1")
        for name in ("chat_template_timeout", "request_timeout"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0):
                raise ValueError(f"ServerOptions.{name}={v!r}: must be a number of seconds "
                                 ">= 0")
        if not self.chat_template_timeout:
            raise ValueError("ServerOptions.chat_template_timeout must be > 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerOptions.api_key must not be empty (None: no key)")
        if isinstance(self.allowed_weight_dirs, (str, os.PathLike)):
            self.allowed_weight_dirs = [self.allowed_weight_dirs]
        self.allowed_weight_dirs = [str(d) for d in self.allowed_weight_dirs]
        if isinstance(self.allowed_hosts, str):
            self.allowed_hosts = [self.allowed_hosts]

    def host_allow_list(self) -> set[str] | None:
        """The ``Host`` names accepted (lower case, no brackets, no port), or None for any."""
        hosts = self.allowed_hosts
        if hosts is None:
            if not is_loopback(self.host):
                return None
            hosts = list(LOOPBACK_HOSTS)
        names = {h.strip().strip("[]").lower() for h in hosts if h.strip()}
        return None if "*" in names else names


@dataclass
class Prompt:
    """One prompt ready to submit: its text (None for token ids) and token ids."""

    text: str | None
    token_ids: list[int]


class TemplateTimeout(BaseException):
    """Raised inside a chat-template render that ran past its deadline (a BaseException, so
    that no ``except Exception`` in the template's or the library's code swallows it)."""


def _deadline_tracer(deadline: float):
    """A ``sys.settrace`` function that raises ``TemplateTimeout`` at the first line run after
    ``deadline`` (``time.monotonic()``): a template looping forever (Jinja compiles to Python)
    is stopped."""

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout()
        return trace

    return trace


def run_with_deadline(fn, timeout: float, *args):
    """``fn(*args)`` on this thread with Python-level tracing that stops it (raising
    ``TemplateTimeout``) once ``timeout`` seconds have passed."""
    old = sys.gettrace()
    sys.settrace(_deadline_tracer(time.monotonic() + timeout))
    try:
        return fn(*args)
    finally:
        sys.settrace(old)


class ServerState:
    """The served model, its engine loop and the server's options (``app.state.server``).

    Args:
        llm: the ``specengine.LLM`` to serve.
        engine: its ``AsyncEngine`` (started by the app's lifespan).
        model_name: the name clients pass as ``model`` (default: ``llm.model_name``).
        options: limits and security options (default ``ServerOptions()``).
    """

    def __init__(self, llm, engine: AsyncEngine, model_name: str | None = None,
                 options: ServerOptions | None = None):
        self.llm = llm
        self.engine = engine
        self.options = options or ServerOptions()
        self.model_name = model_name or str(llm.model_name)
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = llm.engine_config.max_model_len
        self.vocab_size = llm.engine.runner.model.config.vocab_size
        cap = getattr(getattr(llm, "engine_args", None), "max_logprobs", 20)
        self.max_logprobs = self.vocab_size if cap is None or cap < 0 else min(cap,
                                                                               self.vocab_size)
        self.max_n = min(self.options.max_n, llm.engine_config.max_num_seqs)
        # bytes of text one token can stand for at most (its string's UTF-8 length bounds it:
        # byte-level BPE, SentencePiece and byte-fallback pieces are all at least as long)
        self.max_token_bytes = max((len(t.encode("utf-8", "surrogatepass"))
                                    for t in self.tokenizer.get_vocab()), default=1) \
            if self.tokenizer is not None else None
        self._live: list = []  # handles admitted and not finished (max_queued_requests)
        self._workers = concurrent.futures.ThreadPoolExecutor(
            4, thread_name_prefix="specengine-render")

    def close(self) -> None:
        """Stop the rendering threads (a render still running is left to finish)."""
        self._workers.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> None:
        """Raise a 404 ``APIError`` unless ``model`` is None or names the served model."""
        if model is not None and model not in (self.model_name, str(self.llm.model_name)):
            raise APIError(f"The model `{model}` does not exist.", param="model", status=404,
                           type="NotFoundError", code="model_not_found")

    # ---- prompts --------------------------------------------------------------------------
    async def _off_loop(self, fn, *args, timeout: float | None = None):
        """``fn(*args)`` on a worker thread (the event loop keeps serving meanwhile); with
        ``timeout``, stopped after that many seconds (``TemplateTimeout``)."""
        loop = asyncio.get_running_loop()
        if timeout is None:
            return await loop.run_in_executor(self._workers, fn, *args)
        fut = loop.run_in_executor(self._workers, run_with_deadline, fn, timeout, *args)
        try:  # the tracer stops Python code; the grace covers a render stuck in C code
            return await asyncio.wait_for(fut, timeout + 1.0)
        except TimeoutError:
            raise TemplateTimeout() from None

    async def encode_text(self, text: str, param: str,
                          add_special_tokens: bool = True) -> Prompt:
        """Tokenize ``text`` on a worker thread.

        Raises:
            APIError: 400 naming ``param`` when the model has no tokenizer, or when the text
                has more UTF-8 bytes than twice ``max_model_len`` of the vocabulary's longest
                tokens (it could not fit: refused before spending seconds tokenizing it).
        """
        if self.tokenizer is None:
            raise APIError(f"{param}: the model has no tokenizer; send token ids", param=param)
        size, most = len(text.encode("utf-8")), 2 * self.max_model_len * self.max_token_bytes
        if size > most:
            raise APIError(f"{param}: the prompt has {size} bytes of text, more than "
                           f"max_model_len={self.max_model_len} tokens can ever hold; send a "
                           "shorter prompt", param=param)
        tok = self.tokenizer
        ids = await self._off_loop(
            lambda: tok(text, add_special_tokens=add_special_tokens).input_ids)
        return Prompt(text, ids)

    def template_kwargs(self, kwargs: dict | None, template: str | None,
                        param: str = "chat_template_kwargs") -> dict | None:
        """The keyword arguments of the chat-template render: ``kwargs`` checked, plus the
        request's own ``template`` when the server trusts request templates.

        Raises:
            APIError: 400 for a request template (field or kwarg) without
                ``trust_request_chat_template``, or a reserved ``apply_chat_template``
                argument in ``kwargs`` (``tokenize``, ``return_tensors``, ...).
        """
        kwargs = dict(kwargs or {})
        if "chat_template" in kwargs:
            if template is not None:
                raise APIError("give chat_template once, not also in chat_template_kwargs",
                               param=f"{param}.chat_template")
            template, where = kwargs.pop("chat_template"), f"{param}.chat_template"
        else:
            where = "chat_template"
        if template is not None:
            if not self.options.trust_request_chat_template:
                raise APIError("request-supplied chat templates are refused: this server "
                               "renders only the model's own template (start it with "
                               "--trust-request-chat-template to allow them)", param=where)
            if not isinstance(template, str):
                raise APIError(f"{where} must be a string", param=where)
            kwargs["chat_template"] = template
        bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS - {"chat_template"})
        if bad:
            raise APIError(f"{param}: {bad} cannot be set here (they are arguments of the "
                           "render itself, not template variables)", param=f"{param}.{bad[0]}")
        return kwargs or None

    async def encode_chat(self, messages: list[dict], param: str,
                          add_generation_prompt: bool = True,
                          chat_template_kwargs: dict | None = None) -> Prompt:
        """Render a conversation with the chat template (``LLM.encode_chat``) on a worker
        thread, stopped after ``chat_template_timeout`` seconds. ``chat_template_kwargs`` come
        from ``template_kwargs``.

        Raises:
            APIError: 400 naming ``param`` (or ``chat_template``): no chat template, a
                malformed conversation, a template error, or a render past its time limit.
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(f"model {self.model_name!r} has no chat template", param=param)
        own = bool(chat_template_kwargs and "chat_template" in chat_template_kwargs)
        limit = self.options.chat_template_timeout
        try:
            text, ids = await self._off_loop(self.llm.encode_chat, messages, param,
                                             add_generation_prompt, chat_template_kwargs,
                                             timeout=limit)
        except TemplateTimeout:
            raise APIError(f"{param}: rendering the chat template took longer than "
                           f"{limit:g} s; stopped", param="chat_template" if own else param,
                           code="chat_template_timeout") from None
        except (ValueError, TypeError) as e:
            raise APIError(f"{param}: {e}", param=param) from None
        except RecursionError:
            raise APIError(f"{param}: the chat template recursed too deeply",
                           param="chat_template" if own else param) from None
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(f"{param}: the chat template failed: {e}",
                           param="chat_template" if own else param) from None
        return Prompt(text, ids)

    # ---- checks ---------------------------------------------------------------------------
    def check_prompt_count(self, count: int, param: str) -> None:
        """Raise a 400 when a request carries more than ``max_prompts_per_request`` prompts."""
        cap = self.options.max_prompts_per_request
        if count > cap:
            raise APIError(f"{param}: {count} prompts in one request; at most {cap} "
                           "(--max-prompts-per-request)", param=param)

    def check_params(self, p: SamplingParams, names: dict[str, str] | None = None) -> None:
        """Everything in ``p`` beyond ``SamplingParams``' own range checks that the server
        limits, as a 400 naming the request's field (``names`` maps a ``SamplingParams``
        field to it, e.g. ``logprobs`` -> ``top_logprobs``):

        - ``n`` <= ``max_n`` and the engine's ``max_num_seqs``;
        - ``logprobs`` / ``prompt_logprobs`` <= ``max_logprobs`` (the LLM's, vLLM's flag);
        - at most ``max_stop_strings`` stop strings of at most ``max_stop_string_len``
          characters; at most ``max_stop_token_ids`` stop token ids, each an integer in the
          vocabulary;
        - ``seed`` a 64-bit integer; boolean fields booleans; no ``return_hidden_states``
          (hidden states are not sent over HTTP).
        """
        names = names or {}

        def fail(f: str, msg: str):
            raise APIError(msg, param=names.get(f, f))

        if p.n > self.max_n:
            why = "--max-n" if self.max_n == self.options.max_n else \
                "the engine's max_num_seqs: a prompt's samples are admitted together"
            fail("n", f"n={p.n} is more than this server allows per prompt: at most "
                      f"{self.max_n} ({why})")
        for f in ("logprobs", "prompt_logprobs"):
            k = getattr(p, f)
            if k is not None and k > self.max_logprobs:
                fail(f, f"{names.get(f, f)}={k} is above max_logprobs={self.max_logprobs} "
                        "(the server's --max-logprobs)")
        stops = p.stop_strings
        if len(stops) > self.options.max_stop_strings:
            fail("stop", f"{len(stops)} stop strings; at most "
                         f"{self.options.max_stop_strings} (--max-stop-strings)")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.options.max_stop_string_len:
            fail("stop", f"a stop string of {longest} characters; at most "
                         f"{self.options.max_stop_string_len} (--max-stop-string-len)")
        ids = p.stop_token_ids
        if len(ids) > self.options.max_stop_token_ids:
            fail("stop_token_ids", f"{len(ids)} stop token ids; at most "
                                   f"{self.options.max_stop_token_ids}")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < self.vocab_size]
        if bad:
            fail("stop_token_ids", f"stop_token_ids {bad[:5]!r} are not token ids of the "
                                   f"vocabulary [0, {self.vocab_size})")
        if p.seed is not None and not -(1 << 63) <= p.seed < (1 << 64):
            fail("seed", f"seed={p.seed} must be a 64-bit integer")
        for f in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                  "return_hidden_states"):
            if not isinstance(getattr(p, f), bool):
                fail(f, f"{names.get(f, f)} must be true or false")
        if p.return_hidden_states:
            fail("return_hidden_states", "return_hidden_states is not available over HTTP")

    def check_prompt(self, prompt: Prompt, params: SamplingParams, param: str) -> None:
        """Everything ``Engine.add_request`` and the scheduler would refuse, as a 400 before
        anything is submitted: empty or too long prompts, token ids outside the vocabulary,
        stop strings without a tokenizer, and a request no KV pool size could hold."""
        engine = self.llm.engine
        try:
            engine.validate_prompt(prompt.token_ids, param)
        except ValueError as e:
            raise APIError(str(e), param=param) from None
        if params.stop_strings and self.tokenizer is None:
            raise APIError("stop strings need a tokenizer; the model has none", param="stop")
        cfg = engine.config
        total = min(len(prompt.token_ids) + params.max_tokens, cfg.max_model_len)
        need = cdiv(total, cfg.block_size) + (1 if engine.drafter is not None else 0)
        if need > engine.blocks.num_blocks:
            raise APIError(f"{param}: {total} tokens need {need} KV blocks but the server's "
                           f"pool has {engine.blocks.num_blocks}; send a shorter prompt or a "
                           "smaller max_tokens", param=param)

    @staticmethod
    def request_memory_bytes(prompts: list[Prompt], params: list[SamplingParams]) -> int:
        """Host memory the outputs of one request take at their longest, bytes: per sample
        its token ids (prompt + ``max_tokens``, ``TOKEN_BYTES`` each) and, with ``logprobs``
        = k, a dict of k + 1 entries per output token; with ``prompt_logprobs`` the same per
        prompt token (once per prompt)."""
        total = 0
        for pr, sp in zip(prompts, params):
            n_prompt = len(pr.token_ids)
            per_sample = (n_prompt + sp.max_tokens) * TOKEN_BYTES
            if sp.logprobs is not None:
                per_sample += sp.max_tokens * (LOGPROB_DICT_BYTES
                                               + sp.logprobs * LOGPROB_ENTRY_BYTES)
            total += sp.n * per_sample
            if sp.prompt_logprobs is not None:
                total += n_prompt * (LOGPROB_DICT_BYTES + sp.prompt_logprobs
                                     * LOGPROB_ENTRY_BYTES)
        return total

    def check_memory(self, prompts: list[Prompt], params: list[SamplingParams],
                     names: dict[str, str] | None = None) -> None:
        """Raise a 400 when ``request_memory_bytes`` is above ``max_request_memory_bytes``:
        naming ``logprobs`` when the request would fit without them, else ``n``."""
        cap = self.options.max_request_memory_bytes
        need = self.request_memory_bytes(prompts, params)
        if need <= cap:
            return
        names = names or {}
        plain = [dataclasses.replace(sp, logprobs=None, prompt_logprobs=None) for sp in params]
        param = "logprobs" if self.request_memory_bytes(prompts, plain) <= cap else "n"
        raise APIError(f"this request's outputs could take {need / MiB:.0f} MiB of host memory "
                       f"at their longest (prompts x n x max_tokens, with logprobs); at most "
                       f"{cap / MiB:.0f} MiB (--max-request-memory-bytes): ask for fewer "
                       "samples, tokens or logprobs", param=names.get(param, param))

    # ---- running --------------------------------------------------------------------------
    def check_ready(self) -> None:
        """Raise a 503 ``APIError`` while the engine is asleep (``/sleep``) or its weights were
        discarded and not loaded since. (Read on the event loop, so a request can still pass
        just before a sleep runs: the engine thread checks again and fails it the same way.)"""
        check = getattr(self.llm.engine, "ready_check", None)
        if check is not None:
            try:
                check()
            except RuntimeError as e:
                raise as_api_error(EngineNotReadyError(str(e))) from None

    def in_flight(self) -> int:
        """Engine requests admitted by the routes and not finished (running or waiting)."""
        self._live = [h for h in self._live if not h.finished]
        return len(self._live)

    def submit(self, prompts: list[Prompt], params: list[SamplingParams], stream: bool):
        """Submit prompts (already checked) to the engine loop; returns their handles.

        Raises:
            APIError: 429 (with ``Retry-After``) when admitting them would put more than
                ``max_queued_requests`` engine requests in flight; 503 while the engine is
                asleep or its loop has stopped.
        """
        self.check_ready()
        cap = self.options.max_queued_requests
        if self.in_flight() + len(prompts) > cap:
            raise APIError(f"the server is full: {len(self._live)} requests in flight, "
                           f"{len(prompts)} more would pass --max-queued-requests={cap}; "
                           "retry later", status=429, type="rate_limit_error",
                           code="too_many_requests", headers={"Retry-After": "1"})
        try:
            handles = [self.engine.submit(p.token_ids, sp, p.text, stream)
                       for p, sp in zip(prompts, params)]
        except EngineDeadError as e:
            raise APIError(str(e), status=503, type="service_unavailable") from None
        self._live.extend(handles)
        return handles

    def deadline(self) -> float | None:
        """When a request admitted now must have finished (``loop.time()``), or None."""
        t = self.options.request_timeout
        return asyncio.get_running_loop().time() + t if t else None

    def timeout_error(self) -> APIError:
        return APIError(f"the request did not finish within the server's request timeout "
                        f"({self.options.request_timeout:g} s, --request-timeout); it was "
                        "aborted", status=504, type="timeout_error", code="request_timeout")

    async def collect(self, request: Request, handles,
                      deadline: float | None = None) -> list[RequestOutput]:
        """Wait for every handle's ``RequestOutput``. If one fails, the client disconnects or
        ``deadline`` (``loop.time()``) passes, the others are aborted (their KV freed) and the
        error is raised.

        Raises:
            APIError: 400 for a request the engine refused, 499 for a client that went away,
                503 when the engine loop stopped or the engine is asleep, 504 past the
                deadline, 500 for an engine failure.
        """
        loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(h.result()) for h in handles]
        try:
            pending = set(tasks)
            while pending:
                wait = DISCONNECT_POLL_S
                if deadline is not None:
                    left = deadline - loop.time()
                    if left <= 0:
                        raise self.timeout_error()
                    wait = min(wait, left)
                done, pending = await asyncio.wait(pending, timeout=wait,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    if t.exception() is not None:
                        raise as_api_error(t.exception())
                if pending and await request.is_disconnected():
                    raise APIError("the client disconnected", status=499,
                                   type="client_closed_request")
            return [t.result() for t in tasks]
        finally:
            for h in handles:
                h.abort()
            for t in tasks:
                t.cancel()


def as_api_error(e: BaseException) -> APIError:
    """The HTTP error for an exception raised by a request's handle."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, TypeError)):
        return APIError(str(e), param=getattr(e, "param", None))
    if isinstance(e, EngineNotReadyError):
        return APIError(str(e), status=503, type="service_unavailable", code="engine_sleeping")
    if isinstance(e, RequestAborted):
        return APIError(str(e), status=499, type="client_closed_request")
    if isinstance(e, EngineDeadError):
        return APIError(str(e), status=503, type="service_unavailable")
    return APIError(f"internal error: {e}", status=500, type="internal_server_error")
