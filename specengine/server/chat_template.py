"""Chat templates on the server: which render arguments a request may set
(``template_kwargs``), a render stopped after its time limit (``run_with_deadline``,
``TemplateTimeout``) and the 400 a failed render is answered with (``render_error``)."""

from __future__ import annotations

import sys
import time

from specengine.server.protocol import APIError

# Arguments of transformers' ``apply_chat_template`` that ``chat_template_kwargs`` must not
# set (they change what is rendered or returned, not what the template sees).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


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


def template_kwargs(kwargs: dict | None, template: str | None, trusted: bool,
                    param: str = "chat_template_kwargs") -> dict | None:
    """The keyword arguments of the chat-template render: ``kwargs`` checked, plus the
    request's own ``template`` when ``trusted`` (the server's
    ``trust_request_chat_template``).

    Raises:
        APIError: 400 for a request template (field or kwarg) when not ``trusted``, or a
            reserved ``apply_chat_template`` argument in ``kwargs`` (``tokenize``,
            ``return_tensors``, ...).
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
        if not trusted:
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


def render_error(e: BaseException, param: str, own: bool, limit: float) -> APIError:
    """The 400 for a chat-template render of ``param`` that raised ``e``: past its time
    ``limit`` (seconds; ``TemplateTimeout``), a malformed conversation (ValueError,
    TypeError), too deep a recursion, or any template error. ``own``: the request supplied
    the template (the error then names ``chat_template``)."""
    where = "chat_template" if own else param
    if isinstance(e, TemplateTimeout):
        return APIError(f"{param}: rendering the chat template took longer than "
                        f"{limit:g} s; stopped", param=where, code="chat_template_timeout")
    if isinstance(e, (ValueError, TypeError)):
        return APIError(f"{param}: {e}", param=param)
    if isinstance(e, RecursionError):
        return APIError(f"{param}: the chat template recursed too deeply", param=where)
    return APIError(f"{param}: the chat template failed: {e}", param=where)
