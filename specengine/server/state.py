"""What every route needs: the served ``LLM``, its ``AsyncEngine``, the model's name, the
server's options (``ServerOptions``, in ``options``), and request preparation (tokenize, render
chat templates off the event loop (``chat_template``), validate (``limits``), admit, submit,
wait) shared by the OpenAI and TRL routes."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

from starlette.requests import Request

from specengine.async_llm import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    RequestAborted,
)
from specengine.engine.outputs import RequestOutput
from specengine.kv.block_manager import cdiv
from specengine.sampling.params import SamplingParams
from specengine.server.chat_template import (
    TemplateTimeout,
    render_error,
    run_with_deadline,
    template_kwargs,
)
from specengine.server.limits import check_sampling_limits, memory_error, request_memory_bytes
from specengine.server.options import ServerOptions
from specengine.server.protocol import APIError

DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks whether its client is gone


@dataclass
class Prompt:
    """One prompt ready to submit: its text (None for token ids) and token ids."""

    text: str | None
    token_ids: list[int]


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
        self.vocab_size = llm.engine.model.config.vocab_size
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
        """``chat_template.template_kwargs`` with this server's
        ``trust_request_chat_template``. Raises APIError (400) as it does."""
        return template_kwargs(kwargs, template, self.options.trust_request_chat_template,
                               param)

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
        except (TemplateTimeout, Exception) as e:  # a template error is the request's fault
            raise render_error(e, param, own, limit) from None
        return Prompt(text, ids)

    # ---- checks ---------------------------------------------------------------------------
    def check_prompt_count(self, count: int, param: str) -> None:
        """Raise a 400 when a request carries more than ``max_prompts_per_request`` prompts."""
        cap = self.options.max_prompts_per_request
        if count > cap:
            raise APIError(f"{param}: {count} prompts in one request; at most {cap} "
                           "(--max-prompts-per-request)", param=param)

    def check_params(self, p: SamplingParams, names: dict[str, str] | None = None) -> None:
        """Raise a 400 for anything in ``p`` past this server's limits
        (``limits.check_sampling_limits``: ``n``, logprobs, stop strings and ids, seed, flags);
        ``names`` maps a ``SamplingParams`` field to the request's (``logprobs`` ->
        ``top_logprobs``)."""
        check_sampling_limits(p, self.options, self.max_n, self.max_logprobs,
                              self.vocab_size, names)

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
        if need > cfg.num_kv_blocks:
            raise APIError(f"{param}: {total} tokens need {need} KV blocks but the server's "
                           f"pool has {cfg.num_kv_blocks}; send a shorter prompt or a "
                           "smaller max_tokens", param=param)

    request_memory_bytes = staticmethod(request_memory_bytes)

    def check_memory(self, prompts: list[Prompt], params: list[SamplingParams],
                     names: dict[str, str] | None = None) -> None:
        """Raise a 400 when ``request_memory_bytes`` is above ``max_request_memory_bytes``:
        naming ``logprobs`` when the request would fit without them, else ``n``."""
        err = memory_error(prompts, params, self.options.max_request_memory_bytes, names)
        if err is not None:
            raise err

    # ---- running --------------------------------------------------------------------------
    async def reset_prefix_cache(self) -> bool:
        """``LLM.reset_prefix_cache()`` on the engine thread once no request is in flight;
        True when the LLM has no prefix cache to reset."""
        fn = getattr(self.llm, "reset_prefix_cache", None)
        if fn is None:
            return True
        return bool(await self.engine.call(fn, exclusive=True))

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
