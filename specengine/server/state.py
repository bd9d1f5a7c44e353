"""What every route needs: the served ``LLM``, its ``AsyncEngine``, the model's name, and
request preparation (tokenize, validate, submit, wait) shared by the OpenAI and TRL routes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import Request

from specengine.kv.block_manager import cdiv
from specengine.outputs import RequestOutput
from specengine.sampling import SamplingParams
from specengine.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    RequestAborted,
)
from specengine.server.protocol import APIError

DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks whether its client is gone


@dataclass
class Prompt:
    """One prompt ready to submit: its text (None for token ids) and token ids."""

    text: str | None
    token_ids: list[int]


class ServerState:
    """The served model and its engine loop (``app.state.server``).

    Args:
        llm: the ``specengine.LLM`` to serve.
        engine: its ``AsyncEngine`` (started by the app's lifespan).
        model_name: the name clients pass as ``model`` (default: ``llm.model_name``).
    """

    def __init__(self, llm, engine: AsyncEngine, model_name: str | None = None):
        self.llm = llm
        self.engine = engine
        self.model_name = model_name or str(llm.model_name)
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = llm.engine_config.max_model_len

    def check_model(self, model: str | None) -> None:
        """Raise a 404 ``APIError`` unless ``model`` is None or names the served model."""
        if model is not None and model not in (self.model_name, str(self.llm.model_name)):
            raise APIError(f"The model `{model}` does not exist.", param="model", status=404,
                           type="NotFoundError", code="model_not_found")

    # ---- prompts --------------------------------------------------------------------------
    def encode_text(self, text: str, param: str, add_special_tokens: bool = True) -> Prompt:
        if self.tokenizer is None:
            raise APIError(f"{param}: the model has no tokenizer; send token ids", param=param)
        return Prompt(text, self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def encode_chat(self, messages: list[dict], param: str, add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> Prompt:
        """Render a conversation with the model's chat template (``LLM.encode_chat``)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(f"model {self.model_name!r} has no chat template", param=param)
        try:
            text, ids = self.llm.encode_chat(messages, param, add_generation_prompt,
                                             chat_template_kwargs)
        except (ValueError, TypeError) as e:
            raise APIError(f"{param}: {e}", param=param) from None
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise APIError(f"{param}: the chat template failed: {e}", param=param) from None
        return Prompt(text, ids)

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

    def submit(self, prompts: list[Prompt], params: list[SamplingParams], stream: bool):
        """Submit prompts (already checked) to the engine loop; returns their handles.

        Raises:
            APIError: 503 while the engine is asleep or its loop has stopped.
        """
        self.check_ready()
        try:
            return [self.engine.submit(p.token_ids, sp, p.text, stream)
                    for p, sp in zip(prompts, params)]
        except EngineDeadError as e:
            raise APIError(str(e), status=503, type="service_unavailable") from None

    async def collect(self, request: Request, handles) -> list[RequestOutput]:
        """Wait for every handle's ``RequestOutput``. If one fails, or the client disconnects,
        the others are aborted (their KV freed) and the error is raised.

        Raises:
            APIError: 400 for a request the engine refused, 499 for a client that went away,
                503 when the engine loop stopped or the engine is asleep, 500 for an engine
                failure.
        """
        tasks = [asyncio.ensure_future(h.result()) for h in handles]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S,
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
        return APIError(str(e))
    if isinstance(e, EngineNotReadyError):
        return APIError(str(e), status=503, type="service_unavailable", code="engine_sleeping")
    if isinstance(e, RequestAborted):
        return APIError(str(e), status=499, type="client_closed_request")
    if isinstance(e, EngineDeadError):
        return APIError(str(e), status=503, type="service_unavailable")
    return APIError(f"internal error: {e}", status=500, type="internal_server_error")
