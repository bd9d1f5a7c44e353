"""The FastAPI app of ``specengine serve``: routes, error handling, and the engine loop's
lifetime (started and stopped with the app).

Routes:
    OpenAI: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``openai_routes``),
        ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (``LLM.get_metrics()`` plus the
        server loop's counters, JSON).
    TRL ``vllm-serve``: ``/health/``, ``/get_world_size/``, ``/generate/``, ``/chat/``,
        ``/reset_prefix_cache/``, ``/close_communicator/``, ``/update_named_param/`` with the
        tensor in the body (``trl_routes``).
    RL control (``control_routes``): ``/sleep``, ``/wake_up``, ``/is_sleeping``,
        ``/update_weights_from_disk``, ``/get_weight_version``, a streamed weight session
        (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
        ``/abort_weight_update``), ``/reset_prefix_cache``, and SGLang's names
        (``/release_memory_occupation``, ``/resume_memory_occupation``, ``/flush_cache``).

Every error is answered with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:
400 for bad JSON, unknown fields, wrong types, invalid sampling values and too-long prompts,
404 for an unknown model or route, 503 for a generate request while the engine is asleep.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specengine.server import control_routes, openai_routes, trl_routes
from specengine.server.async_engine import AsyncEngine
from specengine.server.protocol import APIError, error_body, json_safe, validation_error_body
from specengine.server.state import ServerState

logger = logging.getLogger("specengine.server")

_STATUS_TYPES = {404: "NotFoundError", 405: "method_not_allowed", 413: "request_too_large"}


def build_app(llm, model_name: str | None = None) -> FastAPI:
    """The server app for ``llm``; its engine loop starts and stops with the app's lifespan
    (uvicorn, or ``fastapi.testclient.TestClient`` used as a context manager).

    Args:
        llm: a ``specengine.LLM``. From startup on, the app's engine thread owns ``llm.engine``:
            do not call ``llm.generate`` elsewhere while the app runs.
        model_name: the ``model`` clients send (default: ``llm.model_name``).
    """
    engine = AsyncEngine(llm)
    state = ServerState(llm, engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="specengine", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(status_code=400, content=validation_error_body(list(exc.errors())))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(status_code=exc.status, content=exc.body())

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = _STATUS_TYPES.get(exc.status_code, "invalid_request_error")
        return JSONResponse(status_code=exc.status_code,
                            content=error_body(f"{exc.detail}: {request.method} "
                                               f"{request.url.path}", kind))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(status_code=500, content=error_body(
            f"internal error: {exc!r}", "internal_server_error"))

    @app.get("/health")
    async def health():
        """200 ``{"status": "ok"}`` while the engine loop runs, else 503."""
        if not engine.is_running:
            return JSONResponse(status_code=503, content=error_body(
                "the engine loop is not running", "service_unavailable"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "specengine", "root": str(llm.model_name),
            "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        """``LLM.get_metrics()`` (read on the engine thread, between steps) and ``server``:
        the loop's counters (steps, most sequences in one step, requests finished / aborted /
        failed, seconds in ``Engine.step``)."""
        m = await engine.call(llm.get_metrics)
        return json_safe({**m, "server": dataclasses.asdict(engine.stats)})

    app.include_router(openai_routes.router)
    app.include_router(trl_routes.router)
    app.include_router(control_routes.router)
    return app
