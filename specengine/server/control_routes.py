"""RL control routes: what a trainer calls between rollouts (not generation).

Here now: ``POST /reset_prefix_cache`` (vLLM's route; ``{"success": bool}``).

The place for the rest of issue 14's control routes, once ``LLM`` has the methods they wrap:
``POST /sleep`` (``LLM.sleep(level)``), ``POST /wake_up`` (``LLM.wake_up(tags)``),
``POST /update_weights_from_disk`` (``LLM.load_weights(path)``) and ``GET /get_weight_version``.
Each should run through ``ServerState.engine.call(fn, ..., exclusive=True)`` so it happens
with no request in flight, like ``reset_prefix_cache`` below.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from specengine.server.state import ServerState

router = APIRouter()


async def reset_prefix_cache(st: ServerState) -> bool:
    """``LLM.reset_prefix_cache()`` once no request is in flight; True when the engine has no
    prefix cache (nothing to reset)."""
    fn = getattr(st.llm, "reset_prefix_cache", None)
    if fn is None:
        return True
    return bool(await st.engine.call(fn, exclusive=True))


@router.post("/reset_prefix_cache")
async def reset_prefix_cache_route(request: Request):
    """vLLM's ``POST /reset_prefix_cache`` (TRL's ``VLLMClient.reset_prefix_cache``)."""
    return {"success": await reset_prefix_cache(request.app.state.server)}
