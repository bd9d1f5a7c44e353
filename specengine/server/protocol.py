"""Request models, validation and response formatting of the HTTP server.

Request bodies are pydantic models with ``extra="forbid"`` and strict types: an unknown field or
a value of the wrong type is a 400 naming the field. Before a body's fields are read, every
string in it (keys too) must be valid UTF-8 (no lone surrogate such as ``"\\ud800"``) and every
number finite (Python's JSON parser accepts ``NaN`` / ``Infinity``): a 400 naming the field
(``check_json``). Value ranges are checked by ``SamplingParams`` itself (its error names the
parameter) and the server's limits by ``ServerState.check_params``. Errors have OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specengine.engine.sequence import Logprob
from specengine.sampling.params import SamplingParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs (the server uses its LLM's max_logprobs)
LOGPROB_FLOOR = -9999.0  # -inf log-probabilities are sent as this (JSON has no infinity)


class APIError(Exception):
    """An error answered with an OpenAI-style body.

    Args:
        message: what is wrong, naming the input. param: the request field at fault.
        status: HTTP status (400 by default). type / code: OpenAI's error type and code.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.code = code
        self.headers = headers  # extra response headers (``Retry-After`` on a 429)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's error object)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error_body(errors: list[dict]) -> dict:
    """An OpenAI-style body for pydantic / FastAPI request validation errors (bad JSON,
    unknown fields, wrong types, missing fields): the first error, with its field as param."""
    e = errors[0] if errors else {"type": "unknown", "loc": (), "msg": "invalid request"}
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    kind = e.get("type", "")
    if kind == "json_invalid":
        ctx = e.get("ctx", {}).get("error", "")
        msg = f"the request body is not valid JSON ({ctx})" if ctx else \
            "the request body is not valid JSON"
        param = None
    elif kind == "extra_forbidden":
        msg = f"unknown field {param!r}"
    elif kind == "missing":
        msg = f"field {param!r} is required" if param else "the request body is missing"
    elif kind == "model_attributes_type" or (kind.endswith("_type") and not loc):
        msg = "the request body must be a JSON object"
    else:
        msg = f"{param}: {e.get('msg', 'invalid value')}" if param else e.get("msg", "invalid")
    return error_body(msg, param=param, code=kind or None)


def _path(param: str, key) -> str:
    if isinstance(key, int):
        return f"{param}[{key}]"
    return f"{param}.{key}" if param else str(key)


def check_json(obj, param: str = "") -> None:
    """Raise a 400 ``APIError`` naming the field (``messages[0].content``) when ``obj`` (a
    parsed JSON value) holds a string, or an object key, that is not valid UTF-8 (a lone
    surrogate: JSON's ``"\\ud800"``), or a number that is not finite (``NaN``, ``Infinity``:
    not JSON, but Python's parser takes them). Iterative: any nesting depth the JSON parser
    accepted is walked without recursion."""
    stack = [(obj, param)]
    while stack:
        x, where = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(f"{where or 'the request body'}: the string is not valid UTF-8 "
                               f"(a lone surrogate at character {e.start})",
                               param=where or None, code="invalid_utf8") from None
        elif isinstance(x, float):
            if not math.isfinite(x):
                raise APIError(f"{where or 'the request body'}: {x} is not a finite number",
                               param=where or None, code="not_finite")
        elif isinstance(x, dict):
            for k, v in x.items():
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        raise APIError(f"{where or 'the request body'}: an object key is not "
                                       "valid UTF-8 (a lone surrogate)", param=where or None,
                                       code="invalid_utf8") from None
                stack.append((v, _path(where, k)))
        elif isinstance(x, (list, tuple)):
            stack.extend((v, _path(where, i)) for i, v in enumerate(x))


class Strict(BaseModel):
    """Base of request bodies: unknown fields and wrong types are errors; strings must be
    valid UTF-8 and numbers finite anywhere in the body (``check_json``, a 400 naming the
    field, raised before any field is read)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data):
        check_json(data)
        return data


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(Strict):
    """Sampling fields shared by the OpenAI routes (OpenAI's, plus vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids
    or a list of token-id lists (one choice group of ``n`` per prompt)."""

    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    messages: Any
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict | None = None
    store: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # refused unless --trust-request-chat-template


class TRLSampling(Strict):
    """The sampling fields TRL's ``vllm-serve`` requests share (their defaults as TRL's)."""

    n: int = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    logprobs: int | None = 0
    truncate_prompt_tokens: int | None = None
    structured_outputs_regex: str | None = None
    generation_kwargs: dict = Field(default_factory=dict)


class TRLGenerateRequest(TRLSampling):
    """``POST /generate/`` of TRL's ``vllm-serve`` (its ``GenerateRequest``; ``images``,
    ``truncate_prompt_tokens``, ``structured_outputs_regex`` and ``guided_decoding_regex`` are
    fields some TRL versions send)."""

    prompts: list[str] | list[list[int]]
    images: list | None = None
    guided_decoding_regex: str | None = None


class TRLChatRequest(TRLSampling):
    """``POST /chat/`` of TRL's ``vllm-serve`` (its ``ChatRequest``)."""

    messages: list[list[dict]]
    chat_template_kwargs: dict = Field(default_factory=dict)
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    tools: list | None = None


# ---- sampling parameters --------------------------------------------------------------------
_SP_ERROR = re.compile(r"SamplingParams\.(\w+)=")


def sampling_fields() -> set[str]:
    """The keyword arguments ``SamplingParams`` accepts (read at call time: it gains some)."""
    return {f.name for f in dataclasses.fields(SamplingParams) if f.init}


def make_sampling_params(kwargs: dict, param_names: dict[str, str] | None = None
                         ) -> SamplingParams:
    """``SamplingParams(**kwargs)`` with its errors as 400s naming the request field.

    ``None`` values are dropped (the default applies). ``param_names`` maps a
    ``SamplingParams`` field to the request's name for it (e.g. ``logprobs`` ->
    ``top_logprobs``).

    Raises:
        APIError: an unknown key or a value SamplingParams refuses.
    """
    known = sampling_fields()
    names = param_names or {}
    args = {}
    for k, v in kwargs.items():
        if v is None:
            continue
        if k not in known:
            raise APIError(f"unknown sampling parameter {k!r}; known: {sorted(known)}",
                           param=names.get(k, k))
        args[k] = v
    try:
        return SamplingParams(**args)
    except (ValueError, TypeError) as e:
        m = _SP_ERROR.search(str(e))
        field = m.group(1) if m else None
        raise APIError(str(e), param=names.get(field, field)) from None


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       param: str = "max_tokens") -> int:
    """The ``max_tokens`` to generate: ``requested``, or what the context has left when None.

    Raises:
        APIError: prompt plus ``requested`` tokens exceed ``max_model_len`` (vLLM's message).
    """
    room = max_model_len - prompt_len
    if requested is None:
        return max(room, 1)
    if isinstance(requested, int) and requested >= 1 and prompt_len + requested > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Please reduce the length of the prompt or "
            "completion.", param=param)
    return requested


# ---- prompts ---------------------------------------------------------------------------------
def _is_token_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompts(prompt) -> list[str | list[int]]:
    """The prompts of a completions request: a string, a list of strings, a list of token ids
    or a list of token-id lists.

    Raises:
        APIError: anything else (an empty list, mixed types), naming ``prompt``.
    """
    if isinstance(prompt, str):
        return [prompt]
    if _is_token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_list(p) for p in prompt):
            return list(prompt)
    raise APIError("prompt must be a string, a list of strings, a non-empty list of token ids "
                   "or a list of non-empty token-id lists", param="prompt")


def chat_messages(messages, param: str = "messages") -> list[dict]:
    """Normalize a conversation to ``[{"role": str, "content": str}]`` (text content parts
    are joined).

    Raises:
        APIError: not a non-empty list of messages with a string role and text content.
    """
    if not isinstance(messages, list) or not messages:
        raise APIError(f"{param} must be a non-empty list of messages", param=param)
    out = []
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"{where} must be an object with a string 'role'", param=where)
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise APIError(f"{where}.content[{j}]: only text parts "
                                   "({'type': 'text', 'text': str}) are supported",
                                   param=f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise APIError(f"{where}.content must be a string or a list of text parts",
                           param=f"{where}.content")
        out.append({"role": m["role"], "content": content})
    return out


# ---- logprobs --------------------------------------------------------------------------------
def finite(x: float) -> float:
    """``x`` with -inf as ``LOGPROB_FLOOR`` (JSON cannot carry infinities)."""
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """A token's logprob entries, most likely first (by rank, then logprob)."""
    return sorted(entry.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))


class TokenText:
    """How tokens are named in logprobs: ``"token_id:N"`` or their decoded text."""

    def __init__(self, tokenizer, as_ids: bool):
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def __call__(self, token: int, lp: Logprob | None = None) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]],
                        name: TokenText, offset: int = 0) -> dict:
    """OpenAI completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the
    sampled token and the top ones, as vLLM returns them) and ``text_offset`` (from
    ``offset``)."""
    tokens, values, tops, offsets = [], [], [], []
    for t, e in zip(token_ids, entries):
        s = name(t, e.get(t))
        tokens.append(s)
        values.append(finite(e[t].logprob))
        tops.append({name(k, v): finite(v.logprob) for k, v in ranked(e)})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], name: TokenText,
                  top: int) -> dict:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` with
    the ``top`` most likely tokens in ``top_logprobs``."""
    content = []
    for t, e in zip(token_ids, entries):
        s = name(t, e.get(t))
        best = []
        for k, v in ranked(e)[:top]:
            ks = name(k, v)
            best.append({"token": ks, "logprob": finite(v.logprob),
                         "bytes": list(ks.encode("utf-8"))})
        content.append({"token": s, "logprob": finite(e[t].logprob),
                        "bytes": list(s.encode("utf-8")), "top_logprobs": best})
    return {"content": content}


def trl_logprobs(outputs) -> tuple[list | None, list | None]:
    """TRL's ``extract_logprobs``: per sample, per token, the logprob entries sorted by rank
    (``logprobs`` and ``logprob_token_ids``, shape ``[samples][tokens][k]``), or (None, None)
    when a sample has no logprobs."""
    all_lps, all_ids = [], []
    for o in outputs:
        if o.logprobs is None:
            return None, None
        lps, ids = [], []
        for e in o.logprobs:
            items = ranked(e)
            ids.append([k for k, _ in items])
            lps.append([None if math.isnan(v.logprob) else finite(v.logprob) for _, v in items])
        all_lps.append(lps)
        all_ids.append(ids)
    return all_lps, all_ids


def json_safe(x):
    """``x`` with non-finite floats replaced by None, recursively (for ``/metrics``)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
