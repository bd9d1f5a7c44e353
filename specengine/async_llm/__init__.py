"""The engine loop shared by the HTTP server and the integrations: ``AsyncEngine`` (``loop``)
runs an ``LLM``'s engine in a thread of its own and serves requests from an asyncio event loop
(vLLM's ``AsyncLLM``); ``messages`` holds what it exchanges with callers, ``failed_steps`` how a
step that raised fails only the request that caused it.
"""

from specengine.async_llm.loop import AsyncEngine
from specengine.async_llm.messages import (
    EngineDeadError,
    EngineNotReadyError,
    EngineStepError,
    RequestAborted,
    RequestHandle,
    SampleDelta,
    ServerStats,
    Update,
)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineNotReadyError", "EngineStepError",
           "RequestAborted", "RequestHandle", "SampleDelta", "ServerStats", "Update"]
