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

Security (``ServerOptions``, the flags of ``specengine serve``; a pure ASGI guard in front of
every route, checks in this order):

1. ``Host`` allow-list (400 ``invalid_host``): by default, when bound to a loopback address,
   only ``localhost`` / ``127.0.0.1`` / ``[::1]`` (a DNS-rebinding page has its own name).
2. API key (401 ``invalid_api_key``, ``WWW-Authenticate: Bearer``): with ``api_key`` set,
   ``Authorization: Bearer <key>`` on every route but ``/health`` and ``/health/`` (compared
   with ``hmac.compare_digest``).
3. Control routes (``CONTROL_PATHS``: everything in ``control_routes`` and TRL's
   ``/update_named_param/``, ``/init_communicator/``, ``/close_communicator/``,
   ``/reset_prefix_cache/``): 404 unless ``enable_control_routes``; then a body must be
   ``application/json`` or ``application/octet-stream`` (415; an empty body needs none), and a
   request a browser marks as cross-site (``Sec-Fetch-Site: cross-site|same-site``, or an
   ``Origin`` whose host is not the server's) is a 403: no web page can drive them.
4. Body size (413): ``max_request_body_bytes`` (``max_weight_body_bytes`` for weight pushes),
   from ``Content-Length`` before reading, and counted while reading a chunked body.

Then each route checks its request (400 naming the field), admits it (429 when
``max_queued_requests`` engine requests are in flight) and bounds it in time
(``request_timeout``: 504).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specengine.async_llm import AsyncEngine
from specengine.server import control_routes, openai_routes, trl_routes
from specengine.server.protocol import APIError, error_body, json_safe, validation_error_body
from specengine.server.state import ServerOptions, ServerState

logger = logging.getLogger("specengine.server")

_STATUS_TYPES = {404: "NotFoundError", 405: "method_not_allowed", 413: "request_too_large"}

OPEN_PATHS = frozenset({"/health", "/health/"})  # served without the API key
TRL_CONTROL_PATHS = frozenset({"/update_named_param/", "/init_communicator/",
                               "/close_communicator/", "/reset_prefix_cache/"})
WEIGHT_PUSH_PATHS = frozenset({"/update_named_param/", "/update_weights"})
CONTROL_BODY_TYPES = ("application/json", "application/octet-stream")


def _route_paths(router) -> set[str]:
    return {r.path for r in router.routes if hasattr(r, "path")}


CONTROL_PATHS = frozenset(_route_paths(control_routes.router) | TRL_CONTROL_PATHS)
_CONTROL_KEYS = frozenset(p.rstrip("/") for p in CONTROL_PATHS)


def is_control_path(path: str) -> bool:
    """Whether ``path`` is a control route (with or without its trailing slash)."""
    return path.rstrip("/") in _CONTROL_KEYS


def host_name(value: str) -> str:
    """The host of a ``Host`` header or an origin's authority, lower case, without port or
    IPv6 brackets (``"[::1]:8000"`` -> ``"::1"``)."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v[1:]
    if v.count(":") == 1:
        return v.split(":", 1)[0]
    return v


class Guard:
    """The ASGI middleware in front of every route: host allow-list, API key, control
    routes (off, content types, cross-site), body size; see the module docstring.

    Args:
        app: the app to guard. options: the server's ``ServerOptions``.
    """

    def __init__(self, app: ASGIApp, options: ServerOptions):
        self.app = app
        self.options = options
        self.hosts = options.host_allow_list()
        self.key = options.api_key.encode() if options.api_key else None

    @staticmethod
    async def _refuse(send: Send, status: int, message: str, type: str,
                      code: str | None = None, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(error_body(message, type, None, code)).encode()
        raw = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        path, method = scope.get("path", ""), scope.get("method", "GET")
        host = host_name(headers.get("host", ""))
        if self.hosts is not None and host not in self.hosts:
            return await self._refuse(
                send, 400, "invalid Host header: this server answers only to "
                f"{sorted(self.hosts)} (--allowed-hosts)", "invalid_request_error",
                "invalid_host")
        if self.key is not None and path not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode("latin-1"), self.key):  # the header's raw bytes
                return await self._refuse(
                    send, 401, "Unauthorized: send 'Authorization: Bearer <api key>' (the "
                    "server's --api-key / SPECENGINE_API_KEY)", "invalid_request_error",
                    "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if is_control_path(path):
            if not self.options.enable_control_routes:
                return await self._refuse(
                    send, 404, f"{method} {path}: control routes are disabled on this server "
                    "(start it with --enable-control-routes)", "NotFoundError",
                    "control_routes_disabled")
            why = self._cross_site(headers)
            if why:
                return await self._refuse(send, 403, f"{method} {path}: {why}",
                                          "permission_error", "cross_site_request")
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            has_body = headers.get("content-length", "0").strip() not in ("", "0") or \
                "transfer-encoding" in headers
            if (ctype or has_body) and ctype not in CONTROL_BODY_TYPES:
                return await self._refuse(
                    send, 415, f"{method} {path}: a control route takes a JSON "
                    "(application/json) or application/octet-stream body, or none; got "
                    f"{ctype or 'a body without a Content-Type'}", "invalid_request_error",
                    "unsupported_media_type")
        limit = self.options.max_weight_body_bytes if path in WEIGHT_PUSH_PATHS else \
            self.options.max_request_body_bytes
        length = headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > limit
            except ValueError:
                return await self._refuse(send, 400, "invalid Content-Length header",
                                          "invalid_request_error")
            if too_big:
                return await self._refuse(
                    send, 413, f"the request body has {int(length)} bytes; at most {limit} "
                    "(--max-request-body-bytes, --max-weight-body-bytes for weight pushes)",
                    "request_too_large", "request_too_large")
        await self.app(scope, self._counting(receive, limit), send)

    @staticmethod
    def _cross_site(headers: dict[str, str]) -> str | None:
        """Why a request a browser made from another origin is refused (``Sec-Fetch-Site``
        cross-site or same-site, or an ``Origin`` whose host:port is not the ``Host``), or
        None (not from a browser, or from this server's own pages)."""
        site = headers.get("sec-fetch-site", "").lower()
        if site in ("cross-site", "same-site"):
            return f"refused: a browser sent it from another site (Sec-Fetch-Site: {site})"
        origin = headers.get("origin")
        if origin is not None:
            o = origin.strip().lower()
            authority = o.split("://", 1)[1].split("/", 1)[0] if "://" in o else None
            if authority != headers.get("host", "").strip().lower():
                return f"refused: a browser sent it from another origin ({origin})"
        return None

    @staticmethod
    def _counting(receive: Receive, limit: int) -> Receive:
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"the request body is over {limit} bytes "
                                        "(--max-request-body-bytes)")
            return message

        return wrapped


def build_app(llm, model_name: str | None = None, options: ServerOptions | None = None,
              **kwargs) -> FastAPI:
    """The server app for ``llm``; its engine loop starts and stops with the app's lifespan
    (uvicorn, or ``fastapi.testclient.TestClient`` used as a context manager).

    Args:
        llm: a ``specengine.LLM``. From startup on, the app's engine thread owns ``llm.engine``:
            do not call ``llm.generate`` elsewhere while the app runs.
        model_name: the ``model`` clients send (default: ``llm.model_name``).
        options: limits, authentication and control routes (``ServerOptions``; default: the
            safe defaults). kwargs: ``ServerOptions`` fields that override ``options``' (e.g.
            ``api_key="..."``, ``enable_control_routes=True``).

    Raises:
        TypeError: an unknown keyword; ValueError: an option out of range.
    """
    options = dataclasses.replace(options or ServerOptions(), **kwargs)
    engine = AsyncEngine(llm)
    state = ServerState(llm, engine, model_name, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            state.close()

    app = FastAPI(title="specengine", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(Guard, options=options)
    add_error_handlers(app)
    add_server_routes(app, state)
    app.include_router(openai_routes.router)
    app.include_router(trl_routes.router)
    app.include_router(control_routes.router)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error with OpenAI's body: request validation (400), ``APIError`` (its
    status and headers), HTTP errors (404, 405, 413, ...) and anything unhandled (500,
    logged)."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(status_code=400, content=validation_error_body(list(exc.errors())))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return JSONResponse(status_code=exc.status, content=exc.body(), headers=exc.headers)

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


def add_server_routes(app: FastAPI, state: ServerState) -> None:
    """``GET /health``, ``GET /v1/models`` and ``GET /metrics`` for ``state``'s model."""
    engine, llm = state.engine, state.llm

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
