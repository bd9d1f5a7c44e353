"""RL control routes: what a trainer calls between rollouts (not generation).

They are served only with ``--enable-control-routes`` (``ServerOptions.enable_control_routes``;
404 otherwise), behind the API key when one is set, and accept only JSON or
``application/octet-stream`` bodies (415), or none (``app.py``'s guard).

Every route runs its ``LLM`` call on the engine thread (``AsyncEngine.call``); those that
change the weights or the memory run with ``exclusive=True``: once no request is in flight,
with requests that arrive meanwhile held back until it has run, so no request ever runs on two
sets of weights, or while the engine is asleep. A generate request that arrives while the
engine is asleep (or its weights were discarded and not loaded since) gets a 503
(``service_unavailable``, code ``engine_sleeping``), never garbage.

Memory (vLLM's dev routes, SGLang's names):
    ``POST /sleep``: ``{"level": 1|2}`` (default 1; vLLM's ``?level=`` query works too) ->
        ``LLM.sleep(level)``; ``{"success": true, "released_bytes": {weights, packed,
        kv_cache, total}}``.
    ``POST /wake_up``: ``{"tags": null | ["weights"] | ["kv_cache"] | ...}`` (vLLM's
        ``?tags=weights&tags=kv_cache`` works too) -> ``LLM.wake_up(tags)``;
        ``{"success": true, "is_sleeping": bool}``. ``GET /is_sleeping`` -> ``{"is_sleeping"}``.
    ``POST /release_memory_occupation`` (SGLang): ``{"tags": null | [...]}``. Tags null or with
        ``"weights"``: ``sleep(level=1)`` (the weights are kept restorable, unlike SGLang without
        a CPU backup: a release and resume without a push keeps serving the same model). Tags
        without ``"weights"`` (``["kv_cache"]``): the KV cache only, done as ``sleep(1)`` then
        ``wake_up(["weights"])`` (the weights make one round trip through the offload copy).
    ``POST /resume_memory_occupation`` (SGLang): ``{"tags": null | [...]}`` -> ``wake_up(tags)``.

Weights:
    ``POST /update_weights_from_disk`` (SGLang): ``{"model_path": dir or .safetensors file,
        "load_format": null|"auto"|"safetensors", "weight_version": int or digit string or
        null, "abort_all_requests": bool, "flush_cache": bool}`` -> ``begin_weight_update``,
        ``load_weights(model_path)``, ``finish_weight_update(weight_version)``; requests in
        flight finish first (or are aborted with ``abort_all_requests``, once the path is
        accepted). ``model_path`` must be below one of ``--allowed-weight-dirs`` (resolved,
        symlinks followed, every checkpoint file too; ``..`` refused): any path that is not
        (outside, missing, not a checkpoint) gets the same 400 (``WEIGHT_PATH_REFUSED``), so
        the answer never tells which paths exist. ``flush_cache`` is accepted and always true
        in effect (every weight change resets the prefix cache).
        -> ``{"success": true, "message", "num_paused_requests": 0, "weight_version",
        "num_tensors"}``.
    ``GET /get_weight_version`` (SGLang), ``GET /weight_info`` (vLLM) -> ``{"weight_version"}``.
    A streamed session over HTTP (vLLM's route names): ``POST /start_weight_update`` ->
        ``begin_weight_update``; ``POST /update_weights`` with one tensor encoded as
        ``/update_named_param/`` takes it (JSON ``{"name", "dtype", "shape", "data"}``, ``data``
        base64, or a raw ``application/octet-stream`` body with ``name``/``dtype``/``shape``
        query parameters) or a bucket ``{"named_tensors": [{"name", "dtype", "shape", "data"},
        ...]}`` -> ``load_weights(chunk)`` (the old weights keep serving);
        ``POST /finish_weight_update`` ``{"weight_version": ...}`` (optional) -> applies it
        once no request is in flight; ``POST /abort_weight_update`` -> drops it
        (``{"aborted": bool}``, 200 even with no session open).
    ``POST /reset_prefix_cache`` (vLLM) -> ``{"success": bool}``; ``GET|POST /flush_cache``
        (SGLang) -> ``{"success": bool, "message"}``.

Errors (a bad level or tag, a chunk with no session open, a bad checkpoint path, a name or
shape the model does not have) are 400s with the OpenAI-style body; a refused chunk aborts its
session (nothing of it is applied, as ``LLM.load_weights`` documents).
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath, PureWindowsPath

from fastapi import APIRouter, Request
from pydantic import ValidationError

from specengine.async_llm import EngineDeadError
from specengine.lifecycle.weights import WeightUpdateFailed
from specengine.server.protocol import APIError, Strict, validation_error_body
from specengine.server.state import ServerState
from specengine.server.tensor_payload import UpdateNamedParam, named_tensor, read_named_tensor

router = APIRouter()

WEIGHT_PATH_REFUSED = ("update_weights_from_disk: model_path refused: it must name a checkpoint "
                       "(a directory of .safetensors files, or one .safetensors file) below one "
                       "of the server's --allowed-weight-dirs")


# ---- request bodies --------------------------------------------------------------------------
class SleepRequest(Strict):
    level: int = 1


class TagsRequest(Strict):
    tags: list[str] | None = None


class UpdateFromDiskRequest(Strict):
    model_path: str
    load_format: str | None = None
    weight_version: int | str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class PauseRequest(Strict):
    mode: str = "keep"


class StartWeightUpdate(Strict):
    is_checkpoint_format: bool = True


class FinishWeightUpdate(Strict):
    weight_version: int | str | None = None


class WeightBucket(Strict):
    named_tensors: list[UpdateNamedParam]


async def _body(request: Request, model: type[Strict]):
    """``model`` from the JSON body; an empty body gives the defaults. Errors are 400s."""
    raw = await request.body()
    if not raw.strip():
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = validation_error_body(e.errors())["error"]
        raise APIError(err["message"], param=err["param"], code=err["code"]) from None


def _version(v: int | str | None, param: str = "weight_version") -> int | None:
    """A weight version as an int (SGLang sends strings: digits are accepted)."""
    if v is None or isinstance(v, int):
        return v
    if v.isascii() and v.isdigit():  # not "²" or "①": str.isdigit, but not int()'s digits
        try:
            return int(v)
        except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
            pass
    raise APIError(f"weight_version={v[:50]!r} must be an integer >= 0 (or a string of "
                   "digits)", param=param)


def weight_update_failed(e: WeightUpdateFailed) -> APIError:
    """The 500 for a weight update that failed while being applied (the old weights serve)."""
    return APIError(str(e), status=500, type="internal_server_error",
                    code="weight_update_failed")


async def _run(st: ServerState, fn, *args, exclusive: bool = True, param: str | None = None):
    """``fn(*args)`` on the engine thread; its errors as 400s (503 when the loop stopped, 500
    for a weight update that failed while being applied: ``WeightUpdateFailed``)."""
    try:
        return await st.engine.call(fn, *args, exclusive=exclusive)
    except EngineDeadError as e:
        raise APIError(str(e), status=503, type="service_unavailable") from None
    except WeightUpdateFailed as e:
        raise weight_update_failed(e) from None
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        raise APIError(str(e), param=param) from None


# ---- prefix cache ----------------------------------------------------------------------------
@router.post("/reset_prefix_cache")
async def reset_prefix_cache_route(request: Request):
    """vLLM's ``POST /reset_prefix_cache`` (TRL's ``VLLMClient.reset_prefix_cache``)."""
    return {"success": await request.app.state.server.reset_prefix_cache()}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    """SGLang's ``/flush_cache`` (slime retries a GET until it answers 200)."""
    ok = await request.app.state.server.reset_prefix_cache()
    return {"success": ok, "message": "Cache flushed." if ok else "Cache not flushed."}


# ---- memory ----------------------------------------------------------------------------------
@router.post("/sleep")
async def sleep(request: Request):
    """``LLM.sleep(level)``; see the module docstring."""
    st: ServerState = request.app.state.server
    q = request.query_params
    if "level" in q:
        try:
            body = SleepRequest(level=int(q["level"]))
        except ValueError:
            raise APIError(f"level={q['level']!r} must be 1 or 2", param="level") from None
    else:
        body = await _body(request, SleepRequest)
    released = await _run(st, st.llm.sleep, body.level, param="level")
    return {"success": True, "released_bytes": released}


@router.post("/wake_up")
async def wake_up(request: Request):
    """``LLM.wake_up(tags)``; see the module docstring."""
    st: ServerState = request.app.state.server
    tags = request.query_params.getlist("tags")
    body = TagsRequest(tags=tags) if tags else await _body(request, TagsRequest)
    await _run(st, st.llm.wake_up, body.tags, param="tags")
    return {"success": True, "is_sleeping": st.llm.is_sleeping()}


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    st: ServerState = request.app.state.server
    return {"is_sleeping": await st.engine.call(st.llm.is_sleeping)}


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request):
    """SGLang's release; see the module docstring for how tags map to ``sleep``."""
    st: ServerState = request.app.state.server
    body = await _body(request, TagsRequest)
    tags = body.tags
    if tags is not None:
        from specengine.lifecycle.memory import TAGS

        bad = [t for t in tags if t not in TAGS]
        if bad:
            raise APIError(f"release_memory_occupation: unknown tags {bad}; known tags: "
                           f"{list(TAGS)}", param="tags")

    def release():
        released = st.llm.sleep(1)
        if tags is not None and "weights" not in tags:
            st.llm.wake_up(["weights"])
        return released

    released = await _run(st, release, param="tags")
    return {"success": True, "message": "Memory released.", "released_bytes": released}


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request):
    """SGLang's resume: ``LLM.wake_up(tags)``."""
    st: ServerState = request.app.state.server
    body = await _body(request, TagsRequest)
    await _run(st, st.llm.wake_up, body.tags, param="tags")
    return {"success": True, "message": "Memory resumed."}


# ---- weights ---------------------------------------------------------------------------------
def _below(path: Path, dirs: list[Path]) -> bool:
    return any(path == d or d in path.parents for d in dirs)


def checked_weight_path(model_path: str, allowed_dirs: list[str]) -> Path:
    """``model_path`` resolved (symlinks followed) when it is a checkpoint below one of
    ``allowed_dirs`` (also resolved): a directory whose safetensors files (an index's too)
    all resolve below one of them, or one ``.safetensors`` file.

    Raises:
        APIError: 400 ``WEIGHT_PATH_REFUSED`` (param ``model_path``), the same whatever the
            reason: no allowed directories, a ``..`` component or a NUL, outside them, missing,
            not a checkpoint, a file that resolves outside.
    """
    from specengine.models.loader import safetensors_files

    refused = APIError(WEIGHT_PATH_REFUSED, param="model_path", code="weight_path_refused")
    if not allowed_dirs or not model_path or "\0" in model_path:
        raise refused
    if ".." in PurePosixPath(model_path).parts or ".." in PureWindowsPath(model_path).parts:
        raise refused
    try:
        dirs = [Path(os.path.realpath(d)) for d in allowed_dirs]
        p = Path(os.path.realpath(model_path))
        if not _below(p, dirs):
            raise refused
        if p.is_dir():
            files = [Path(os.path.realpath(f)) for f in safetensors_files(p)]
            if not files or not all(_below(f, dirs) and f.is_file() for f in files):
                raise refused
        elif not (p.is_file() and p.suffix == ".safetensors"):
            raise refused
    except (OSError, ValueError, KeyError, TypeError):  # a bad index, a too-long path, ...
        raise refused from None
    return p


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    """SGLang's ``/update_weights_from_disk``; see the module docstring."""
    st: ServerState = request.app.state.server
    body = await _body(request, UpdateFromDiskRequest)
    if body.load_format not in (None, "auto", "safetensors"):
        raise APIError(f"load_format={body.load_format!r} is not supported (only auto / "
                       "safetensors: a directory of .safetensors files)", param="load_format")
    version = _version(body.weight_version)
    path = checked_weight_path(body.model_path, st.options.allowed_weight_dirs)
    if body.abort_all_requests:  # only once the path is accepted
        await st.engine.abort_all()
    llm = st.llm

    def update():
        llm.begin_weight_update()
        try:
            llm.load_weights(str(path))
        except FileNotFoundError:  # removed since it was checked: the same refusal
            llm.abort_weight_update()
            raise APIError(WEIGHT_PATH_REFUSED, param="model_path",
                           code="weight_path_refused") from None
        except BaseException:
            llm.abort_weight_update()
            raise
        names = llm.finish_weight_update(version)
        return names, llm.weight_version

    names, version = await _run(st, update, param="model_path")
    return {"success": True, "message": f"Succeeded to update model weights from "
            f"{body.model_path}.", "num_paused_requests": 0,
            "weight_version": version, "num_tensors": len(names)}


# ---- pause / resume -----------------------------------------------------------------------
PAUSE_ALIASES = {"abort": "abort", "keep": "keep", "retract": "retract", "in_place": "keep"}


async def _pause(request: Request) -> dict:
    st: ServerState = request.app.state.server
    q = request.query_params
    body = PauseRequest(mode=q["mode"]) if "mode" in q else await _body(request, PauseRequest)
    mode = PAUSE_ALIASES.get(body.mode)
    if mode is None:
        raise APIError(f"mode={body.mode!r}: use one of {sorted(PAUSE_ALIASES)}", param="mode")
    try:
        report = await st.engine.pause(mode)
    except EngineDeadError as e:
        raise APIError(str(e), status=503, type="service_unavailable") from None
    return {"success": True, **report}


@router.post("/pause")
async def pause(request: Request):
    """vLLM's ``POST /pause?mode=keep|abort|retract`` (TRL's async GRPO ``VLLMClient.pause``;
    a JSON ``{"mode"}`` works too): ``LLM.pause_generation``. ``abort``: requests in flight
    end now with their partial output (``finish_reason: "abort"``); ``keep``: they stay, and
    a weight update applies at once (they continue on the new version); ``retract``: their
    KV is dropped and recomputed on resume. New requests wait. -> ``{"success", "mode",
    "requests", "running", "retracted", "aborted"}``."""
    return await _pause(request)


@router.post("/pause_generation")
async def pause_generation(request: Request):
    """SGLang's ``/pause_generation`` (``{"mode": "abort" | "in_place" | "retract"}``;
    ``in_place`` is ``keep``); as ``/pause``."""
    return await _pause(request)


@router.post("/resume")
@router.post("/continue_generation")
async def resume(request: Request):
    """vLLM's ``/resume`` and SGLang's ``/continue_generation``: generate again."""
    st: ServerState = request.app.state.server
    await _run(st, st.llm.resume_generation, exclusive=False)
    return {"success": True}


@router.get("/is_paused")
async def is_paused(request: Request):
    """``{"is_paused": bool}``."""
    st: ServerState = request.app.state.server
    return {"is_paused": await st.engine.call(st.llm.is_paused)}


@router.get("/get_weight_version")
@router.get("/weight_info")
async def get_weight_version(request: Request):
    """The version of the weights serving now: 0 as loaded, +1 per applied update."""
    st: ServerState = request.app.state.server
    return {"weight_version": await st.engine.call(lambda: st.llm.weight_version)}


@router.post("/start_weight_update")
async def start_weight_update(request: Request):
    """Open a streamed weight update session (``LLM.begin_weight_update``)."""
    st: ServerState = request.app.state.server
    body = await _body(request, StartWeightUpdate)
    if not body.is_checkpoint_format:
        raise APIError("only checkpoint-format (Hugging Face named) tensors are accepted",
                       param="is_checkpoint_format")
    await _run(st, st.llm.begin_weight_update, exclusive=False)
    return {"message": "Weight update started"}


@router.post("/update_weights")
async def update_weights(request: Request):
    """Stage one tensor or a bucket into the open session (``LLM.load_weights(chunk)``); the
    old weights keep serving meanwhile. Returns ``{"message", "names"}`` (names staged)."""
    st: ServerState = request.app.state.server
    chunk = None
    if not request.headers.get("content-type", "").startswith("application/octet-stream"):
        raw = await request.body()
        try:
            parsed = json.loads(raw) if raw.strip() else None
        except (ValueError, RecursionError):  # bad or too deeply nested JSON
            parsed = None  # read_named_tensor reports the bad JSON
        if isinstance(parsed, dict) and "named_tensors" in parsed:
            bucket = await _body(request, WeightBucket)
            chunk = [(e.name, named_tensor(e)) for e in bucket.named_tensors]
    if chunk is None:
        chunk = [await read_named_tensor(request)]
    names = await _run(st, st.llm.load_weights, chunk, exclusive=False, param="name")
    return {"message": "Weights updated", "names": names}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request):
    """Apply the open session once no request is in flight (``LLM.finish_weight_update``)."""
    st: ServerState = request.app.state.server
    body = await _body(request, FinishWeightUpdate)
    version, llm = _version(body.weight_version), st.llm

    def finish():
        return llm.finish_weight_update(version), llm.weight_version

    names, version = await _run(st, finish, param="weight_version")
    return {"message": "Weight update finished", "weight_version": version,
            "num_tensors": len(names)}


@router.post("/abort_weight_update")
async def abort_weight_update(request: Request):
    """Drop the open session: nothing of it is applied, the old weights keep serving."""
    st: ServerState = request.app.state.server
    aborted = await _run(st, st.llm.abort_weight_update, exclusive=False)
    return {"message": "Weight update aborted" if aborted else "No weight update was open",
            "aborted": aborted}
