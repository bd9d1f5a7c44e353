"""TRL's routes: those of ``trl vllm-serve`` (``trl/scripts/vllm_serve.py`` before it became a
wrapper of ``vllm serve``; trailing slashes, its exact JSON shapes) and the few native vLLM
routes that TRL's current ``VLLMClient`` calls besides ``/v1/*`` (``/get_world_size``,
``/server_info``).

- ``GET /health/`` -> ``{"status": "ok"}``; ``GET /get_world_size/`` -> ``{"world_size": 1}``
- ``POST /generate/``: ``prompts`` (strings or token-id lists), ``n``, ``repetition_penalty``,
  ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``max_tokens``, ``logprobs`` (int or null;
  0 = the sampled token's only), ``generation_kwargs`` (more ``SamplingParams`` fields, e.g.
  ``seed``) -> ``prompt_ids[P]``, ``completion_ids[P*n]``, ``logprobs[P*n][T][k]`` and
  ``logprob_token_ids[P*n][T][k]`` (sorted by rank); ``POST /chat/`` the same for
  conversations.
  Everything is checked before anything runs, as on the OpenAI routes (400 naming the field,
  ``generation_kwargs.<key>`` for a key given there): ``logprobs`` / ``prompt_logprobs`` <=
  ``max_logprobs``, ``n``, stop strings and ids, prompt count, lengths, output memory.
- ``POST /reset_prefix_cache/``, ``POST /close_communicator/`` (nothing to close).
- ``POST /update_named_param/``: TRL sends ``name``/``dtype``/``shape`` and then the tensor over
  NCCL, which is not available here, so the tensor travels in the request: JSON with ``data``
  (base64 of its bytes), or a raw ``application/octet-stream`` body with ``name``, ``dtype``
  and ``shape`` (``2,3``) as query parameters. Bytes are little-endian, C order. The update
  runs once no request is in flight (requests arriving meanwhile wait), then
  ``LLM.update_weights([(name, tensor)])``.

``/reset_prefix_cache/``, ``/close_communicator/``, ``/init_communicator/`` and
``/update_named_param/`` are control routes: served only with ``--enable-control-routes``
(``ServerOptions.enable_control_routes``), else 404.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from specengine.lifecycle.weights import WeightUpdateFailed
from specengine.server.protocol import (
    APIError,
    TRLChatRequest,
    TRLGenerateRequest,
    chat_messages,
    make_sampling_params,
    trl_logprobs,
)
from specengine.server.state import Prompt, ServerState
from specengine.server.tensor_payload import read_named_tensor

router = APIRouter()


@router.get("/health/")
async def health_slash():
    return {"status": "ok"}


@router.get("/get_world_size/")
@router.get("/get_world_size")
async def get_world_size():
    """One process serves the model: ``{"world_size": 1}``."""
    return {"world_size": 1}


@router.get("/server_info")
async def server_info(request: Request):
    """The part of vLLM's ``/server_info`` that TRL reads (``model_config.logprobs_mode``);
    ``weight_transfer_config`` is null: there is no NCCL weight transfer here."""
    st: ServerState = request.app.state.server
    return {"vllm_config": {
        "model_config": {"model": st.model_name, "max_model_len": st.max_model_len,
                         "logprobs_mode": st.llm.engine.logprobs_mode},
        "weight_transfer_config": None}}


def _trl_params(st: ServerState, body, prompts: list[Prompt]):
    if getattr(body, "structured_outputs_regex", None) is not None or \
            getattr(body, "guided_decoding_regex", None) is not None:
        raise APIError("structured outputs (regex) are not supported",
                       param="structured_outputs_regex")
    if "structured_outputs" in body.generation_kwargs:
        raise APIError("structured outputs are not supported",
                       param="generation_kwargs.structured_outputs")
    kwargs = {"n": body.n, "repetition_penalty": body.repetition_penalty,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "min_p": body.min_p, "max_tokens": body.max_tokens, "logprobs": body.logprobs,
              **body.generation_kwargs}
    names = {k: f"generation_kwargs.{k}" for k in body.generation_kwargs}
    params = make_sampling_params(kwargs, names)
    st.check_params(params, names)
    k = body.truncate_prompt_tokens
    if k is not None and k < 1:
        raise APIError(f"truncate_prompt_tokens={k} must be >= 1 or null",
                       param="truncate_prompt_tokens")
    for i, p in enumerate(prompts):
        if k is not None:
            p.token_ids = p.token_ids[-k:]
        st.check_prompt(p, params, f"prompts[{i}]" if hasattr(body, "prompts") else
                        f"messages[{i}]")
    st.check_memory(prompts, [params] * len(prompts), names)
    return params


async def _run(st: ServerState, request: Request, prompts: list[Prompt], params) -> dict:
    handles = st.submit(prompts, [params] * len(prompts), stream=False)
    outs = await st.collect(request, handles, st.deadline())
    samples = [o for out in outs for o in out.outputs]
    logprobs, ids = trl_logprobs(samples)
    return {"prompt_ids": [out.prompt_token_ids for out in outs],
            "completion_ids": [o.token_ids for o in samples],
            "logprobs": logprobs, "logprob_token_ids": ids}


@router.post("/generate/")
async def generate(body: TRLGenerateRequest, request: Request):
    """TRL's ``/generate/``; see the module docstring."""
    st: ServerState = request.app.state.server
    if body.images and any(x is not None for x in body.images):
        raise APIError("images are not supported", param="images")
    st.check_prompt_count(len(body.prompts), "prompts")
    prompts = [await st.encode_text(p, f"prompts[{i}]") if isinstance(p, str)
               else Prompt(None, p) for i, p in enumerate(body.prompts)]
    if not prompts:
        raise APIError("prompts is empty", param="prompts")
    return await _run(st, request, prompts, _trl_params(st, body, prompts))


@router.post("/chat/")
async def chat(body: TRLChatRequest, request: Request):
    """TRL's ``/chat/``: like ``/generate/`` with conversations (the chat template applied)."""
    st: ServerState = request.app.state.server
    if body.tools:
        raise APIError("tools are not supported", param="tools")
    if not body.messages:
        raise APIError("messages is empty", param="messages")
    st.check_prompt_count(len(body.messages), "messages")
    kwargs = st.template_kwargs(body.chat_template_kwargs, body.chat_template)
    prompts = [await st.encode_chat(chat_messages(conv, f"messages[{i}]"), f"messages[{i}]",
                                    chat_template_kwargs=kwargs)
               for i, conv in enumerate(body.messages)]
    return await _run(st, request, prompts, _trl_params(st, body, prompts))


@router.post("/reset_prefix_cache/")
async def reset_prefix_cache_slash(request: Request):
    """TRL's ``/reset_prefix_cache/``: resets it (when the engine has one) once no request is
    in flight."""
    ok = await request.app.state.server.reset_prefix_cache()
    return {"message": f"Request received, resetting prefix cache status: {ok}"}


@router.post("/close_communicator/")
async def close_communicator():
    """No NCCL communicator is ever opened here: nothing to close."""
    return {"message": "Request received, closing communicator"}


@router.post("/init_communicator/")
async def init_communicator():
    """NCCL weight transfer is not available: a 501 that says how to send weights instead."""
    return JSONResponse(status_code=501, content=APIError(
        "init_communicator: NCCL weight transfer is not available in specengine; send each "
        "tensor in the body of POST /update_named_param/ (JSON 'data' in base64, or a raw "
        "application/octet-stream body)", type="not_implemented").body())


@router.post("/update_named_param/")
async def update_named_param(request: Request):
    """TRL's ``/update_named_param/`` with the tensor in the body; see the module docstring.
    Returns ``{"message", "names"}`` (the parameters copied) once the weights are in place."""
    st: ServerState = request.app.state.server
    name, tensor = await read_named_tensor(request)
    try:
        names = await st.engine.call(st.llm.update_weights, [(name, tensor)], exclusive=True)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param="name") from None
    except WeightUpdateFailed as e:  # the old weights were restored
        raise APIError(str(e), status=500, type="internal_server_error",
                       code="weight_update_failed") from None
    return {"message": "Request received, updating named parameter", "names": names}
