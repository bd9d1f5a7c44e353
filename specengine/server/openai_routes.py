"""OpenAI-compatible generation routes: ``POST /v1/completions`` and ``POST
/v1/chat/completions``, plain JSON or streamed over SSE (``data: {...}`` chunks, then
``data: [DONE]``), with vLLM's extensions (``top_k``, ``min_p``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``return_token_ids``, ``return_tokens_as_token_ids``, ...)
that TRL's ``VLLMClient`` sends.

Each prompt (and each conversation) is one engine request with ``n`` samples; every request of
every HTTP call goes through the one engine loop, so concurrent calls are batched together.
Everything a request could be refused for is checked before anything is submitted (a 400 with
OpenAI's error body naming the field: sampling values, ``logprobs`` / ``top_logprobs`` against
``max_logprobs``, ``n``, stop strings and stop token ids, prompt count and lengths, the host
memory its outputs could take; see ``ServerState.check_params``); a full server answers 429.
Prompts are tokenized and chat templates rendered on worker threads (a template has
``chat_template_timeout`` seconds). A client that disconnects, or a request that runs past
``request_timeout`` (504, or an error event in a stream), has its requests aborted.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specengine.sampling.params import SamplingParams
from specengine.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    TokenText,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    completion_prompts,
    error_body,
    make_sampling_params,
    resolve_max_tokens,
)
from specengine.server.state import Prompt, ServerState, as_api_error

router = APIRouter()


def _sampling_kwargs(body: SamplingFields) -> dict:
    if body.logit_bias:
        raise APIError("logit_bias is not supported", param="logit_bias")
    return dict(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                min_p=body.min_p, seed=body.seed, stop=body.stop,
                stop_token_ids=body.stop_token_ids, min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty)


def _prepare(st: ServerState, prompt: Prompt, kwargs: dict, max_tokens: int | None, what: str,
             names: dict | None = None) -> SamplingParams:
    """Sampling params of one prompt, with the prompt and the server's limits checked (400
    on anything wrong)."""
    try:
        st.llm.engine.validate_prompt(prompt.token_ids, what)
    except ValueError as e:
        raise APIError(str(e), param=what.split("[")[0]) from None
    mt = resolve_max_tokens(max_tokens, len(prompt.token_ids), st.max_model_len,
                            param=(names or {}).get("max_tokens", "max_tokens"))
    sp = make_sampling_params({**kwargs, "max_tokens": mt}, names)
    st.check_params(sp, names)
    st.check_prompt(prompt, sp, what.split("[")[0])
    return sp


class GuardedStream(StreamingResponse):
    """A ``StreamingResponse`` that aborts its engine requests however it ends, also when
    the client left before the body started (the generator's own ``finally`` never runs
    then)."""

    def __init__(self, content, handles):
        super().__init__(content, media_type="text/event-stream")
        self.handles = handles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for h in self.handles:
                h.abort()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---- /v1/completions -------------------------------------------------------------------------
@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    """OpenAI ``POST /v1/completions``; see the module docstring."""
    st: ServerState = request.app.state.server
    st.check_model(body.model)
    if body.echo:
        raise APIError("echo is not supported", param="echo")
    if body.suffix is not None:
        raise APIError("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(f"best_of={body.best_of} is not supported (only best_of == n)",
                       param="best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= st.max_logprobs:
        raise APIError(f"logprobs={body.logprobs} must be in [0, {st.max_logprobs}] "
                       "(max_logprobs)", param="logprobs")
    raw = completion_prompts(body.prompt)
    st.check_prompt_count(len(raw), "prompt")
    kwargs = {**_sampling_kwargs(body), "logprobs": body.logprobs}
    prompts, params = [], []
    for i, p in enumerate(raw):
        what = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        prompt = await st.encode_text(p, what, body.add_special_tokens) if isinstance(p, str) \
            else Prompt(None, list(p))
        params.append(_prepare(st, prompt, kwargs, body.max_tokens, what))
        prompts.append(prompt)
    st.check_memory(prompts, params)
    handles = st.submit(prompts, params, body.stream)
    deadline = st.deadline()
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    name = TokenText(st.tokenizer, body.return_tokens_as_token_ids)
    head = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name}
    if body.stream:
        return GuardedStream(
            _stream_completion(st, body, handles, prompts, params, head, name, deadline),
            handles)
    outs = await st.collect(request, handles, deadline)
    choices, n_out = [], 0
    for i, out in enumerate(outs):
        for o in out.outputs:
            c = {"index": i * body.n + o.index, "text": o.text,
                 "logprobs": completion_logprobs(o.token_ids, o.logprobs, name)
                 if o.logprobs is not None else None,
                 "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
            if body.return_token_ids:
                c["prompt_token_ids"] = out.prompt_token_ids
                c["token_ids"] = o.token_ids
                c["weight_versions"] = o.weight_versions
            choices.append(c)
            n_out += len(o.token_ids)
    n_prompt = sum(len(p.token_ids) for p in prompts)
    return {**head, "choices": choices, "usage": _usage(n_prompt, n_out)}


class _Choice:
    """Streaming state of one choice: its tokens so far and the text already sent."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in params.stop_strings), default=1) - 1

    def text_delta(self, tokenizer, new_ids: list[int], final: str | None) -> str:
        """Text to send for ``new_ids``: the decoded text not sent yet, less a tail that a
        stop string or an incomplete UTF-8 character could still change; the rest of the
        final text (stop strings cut) once the sample finished."""
        self.ids += new_ids
        if final is not None:
            full = final
        elif tokenizer is None:
            return ""
        else:
            full = tokenizer.decode(self.ids,
                                    skip_special_tokens=self.params.skip_special_tokens)
            full = full.rstrip("\ufffd")
            if self.hold:
                full = full[:max(len(full) - self.hold, 0)]
        if len(full) <= len(self.sent):
            return ""
        delta = full[len(self.sent):]
        self.sent = full
        return delta


async def merged_updates(handles, st: ServerState | None = None,
                         deadline: float | None = None) -> AsyncIterator[tuple[int, object]]:
    """``(k, update)`` from several handles as they come; aborts all of them when the
    consumer stops early (client disconnect), one of them fails (its error is raised) or
    ``deadline`` (``loop.time()``) passes (``st.timeout_error()`` is raised)."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k, h):
        try:
            async for u in h:
                q.put_nowait((k, u, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((k, None, e))
        q.put_nowait((k, None, None))

    tasks = [asyncio.ensure_future(pump(k, h)) for k, h in enumerate(handles)]
    loop = asyncio.get_running_loop()
    try:
        left = len(handles)
        while left:
            if deadline is None:
                k, u, e = await q.get()
            else:
                try:
                    k, u, e = await asyncio.wait_for(q.get(), max(deadline - loop.time(), 0))
                except TimeoutError:
                    raise st.timeout_error() from None
            if e is not None:
                raise e
            if u is None:
                left -= 1
                continue
            yield k, u
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            h.abort()


async def _stream_completion(st, body: CompletionRequest, handles, prompts, params, head,
                             name: TokenText, deadline: float | None = None):
    n = body.n
    choices = {i * n + j: _Choice(params[i]) for i in range(len(prompts)) for j in range(n)}
    started: set[int] = set()
    n_out = 0
    updates = merged_updates(handles, st, deadline)
    try:
        async for k, update in updates:
            for d in update.deltas:
                ci = k * n + d.index
                ch = choices[ci]
                offset = len(ch.sent)
                text = ch.text_delta(st.tokenizer, d.token_ids, d.text)
                n_out += len(d.token_ids)
                c = {"index": ci, "text": text,
                     "logprobs": completion_logprobs(d.token_ids, d.logprobs, name, offset)
                     if d.logprobs is not None else None,
                     "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
                if body.return_token_ids:
                    c["token_ids"] = d.token_ids
                    if ci not in started:
                        c["prompt_token_ids"] = prompts[k].token_ids
                started.add(ci)
                yield _sse({**head, "choices": [c]})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**head, "choices": [],
                        "usage": _usage(sum(len(p.token_ids) for p in prompts), n_out)})
    except Exception as e:  # noqa: BLE001 - reported in the stream
        err = as_api_error(e)
        yield _sse(error_body(err.message, err.type, err.param, err.code))
    finally:  # also when the client went away mid-stream: free the requests' KV now
        for h in handles:
            h.abort()
        await updates.aclose()
    yield "data: [DONE]\n\n"


# ---- /v1/chat/completions --------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    """OpenAI ``POST /v1/chat/completions``; see the module docstring."""
    st: ServerState = request.app.state.server
    st.check_model(body.model)
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= st.max_logprobs:
        raise APIError(f"top_logprobs={body.top_logprobs} must be in [0, {st.max_logprobs}] "
                       "(max_logprobs)", param="top_logprobs")
    if body.top_logprobs and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.response_format not in (None, {"type": "text"}):
        raise APIError("response_format: only {'type': 'text'} is supported",
                       param="response_format")
    if body.tools:
        raise APIError("tools are not supported", param="tools")
    if body.tool_choice not in (None, "none"):
        raise APIError("tool_choice: only 'none' is supported", param="tool_choice")
    messages = chat_messages(body.messages)
    template_kwargs = st.template_kwargs(body.chat_template_kwargs, body.chat_template)
    prompt = await st.encode_chat(messages, "messages", body.add_generation_prompt,
                                  template_kwargs)
    top = body.top_logprobs or 0
    kwargs = {**_sampling_kwargs(body), "logprobs": top if body.logprobs else None}
    max_tokens, names = body.max_tokens, {"logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        max_tokens, names["max_tokens"] = body.max_completion_tokens, "max_completion_tokens"
    params = _prepare(st, prompt, kwargs, max_tokens, "messages", names)
    st.check_memory([prompt], [params], names)
    (handle,) = st.submit([prompt], [params], body.stream)
    deadline = st.deadline()
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    name = TokenText(st.tokenizer, body.return_tokens_as_token_ids)
    if body.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": st.model_name}
        return GuardedStream(_stream_chat(st, body, handle, prompt, params, head, name, top,
                                          deadline), [handle])
    (out,) = await st.collect(request, [handle], deadline)
    choices = []
    for o in out.outputs:
        c = {"index": o.index, "message": {"role": "assistant", "content": o.text},
             "logprobs": chat_logprobs(o.token_ids, o.logprobs, name, top)
             if o.logprobs is not None else None,
             "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
        if body.return_token_ids:
            c["token_ids"] = o.token_ids
            c["weight_versions"] = o.weight_versions
        choices.append(c)
    resp = {"id": rid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": choices,
            "usage": _usage(len(prompt.token_ids), sum(len(o.token_ids) for o in out.outputs))}
    if body.return_token_ids:
        resp["prompt_token_ids"] = prompt.token_ids
    return resp


async def _stream_chat(st, body: ChatCompletionRequest, handle, prompt: Prompt, params, head,
                       name: TokenText, top: int, deadline: float | None = None):
    choices = [_Choice(params) for _ in range(body.n)]
    n_out = 0
    updates = merged_updates([handle], st, deadline)
    try:
        for i in range(body.n):
            first = {"index": i, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}
            chunk = {**head, "choices": [first]}
            if body.return_token_ids and i == 0:
                chunk["prompt_token_ids"] = prompt.token_ids
            yield _sse(chunk)
        async for _, update in updates:
            for d in update.deltas:
                ch = choices[d.index]
                text = ch.text_delta(st.tokenizer, d.token_ids, d.text)
                n_out += len(d.token_ids)
                c = {"index": d.index, "delta": {"content": text} if text else {},
                     "logprobs": chat_logprobs(d.token_ids, d.logprobs, name, top)
                     if d.logprobs is not None else None,
                     "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
                if body.return_token_ids:
                    c["token_ids"] = d.token_ids
                yield _sse({**head, "choices": [c]})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(len(prompt.token_ids), n_out)})
    except Exception as e:  # noqa: BLE001 - reported in the stream
        err = as_api_error(e)
        yield _sse(error_body(err.message, err.type, err.param, err.code))
    finally:  # also when the client went away mid-stream: free the request's KV now
        handle.abort()
        await updates.aclose()
    yield "data: [DONE]\n\n"
