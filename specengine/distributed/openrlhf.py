"""``OpenRLHFRolloutActor``: the pool's actor with the method names of OpenRLHF's vLLM rollout
actor (``openrlhf/trainer/ray/vllm_engine.py::RolloutRayActor``; ``../shared/rl-frameworks.md``
section 2), so OpenRLHF's trainer drives a specengine engine with its own calls.

Run it as a threaded Ray actor (``remote_actor``): OpenRLHF sends one ``generate`` call per sample
and many at once; the calls' requests join one engine and are decoded in the same steps (one
caller thread at a time runs the engine's steps for everyone, the others wait for their output).

Weight sync (OpenRLHF's NCCL path, over gloo here): ``init_process_group`` joins the trainer's
broadcast group as rank ``rank_offset`` (one engine = one rank); each ``update_weight(name, dtype,
shape)`` receives one tensor from rank 0 and stages it into a weight-update session; the session
is applied (once, ``LLM.finish_weight_update``) before the next ``generate`` runs, after the
requests in flight drained, or by ``sleep``.

Differences from vLLM: ``pause_generation`` holds new requests back while requests in flight run
to their end with the weights they started with (specengine never changes weights inside a
request; vLLM's mode "keep" continues them with the new weights). ``update_weight_cuda_ipc`` is
refused (no CUDA IPC). ``use_ray=True`` (a Ray collective group) is refused: the group is torch
gloo.
"""

from __future__ import annotations

import dataclasses
import threading

import ray
import torch

from specengine.distributed.collective import WeightGroup
from specengine.distributed.worker import RolloutWorker
from specengine.engine.outputs import RequestOutput
from specengine.sampling.params import SamplingParams

_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]


def to_sampling_params(params, prompt_len: int, max_model_len: int) -> SamplingParams:
    """A specengine ``SamplingParams`` from ours, a dict, or any object with vLLM's attribute
    names (vLLM's ``SamplingParams``); ``max_tokens=None`` (vLLM: up to the context) becomes
    ``max_model_len - prompt_len``.

    Raises:
        ValueError: a value out of range (from ``SamplingParams``).
    """
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        kw = dict(params)
    else:
        kw = {k: getattr(params, k) for k in _FIELDS if hasattr(params, k)}
    if kw.get("max_tokens", 16) is None:
        kw["max_tokens"] = max_model_len - prompt_len
    return SamplingParams(**kw)


class OpenRLHFRolloutActor(RolloutWorker):
    """A ``RolloutWorker`` answering OpenRLHF's ``RolloutRayActor`` calls.

    Args: as ``RolloutWorker``.
    """

    def __init__(self, llm_kwargs: dict, num_threads: int | None = None):
        super().__init__(llm_kwargs, num_threads)
        self._cv = threading.Condition(self.lock)
        self._done: dict[str, RequestOutput | BaseException] = {}
        self._stepping = False
        self._paused = False
        self._num_waiting = 0
        self._session = False
        self._group: WeightGroup | None = None

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], sampling_params,
                 multi_modal_data=None) -> RequestOutput:
        """Generate one request; returns its final ``RequestOutput`` (``.outputs[0].token_ids``,
        ``.text``, ``.finish_reason``, ``.logprobs[i][token].logprob``).

        Raises:
            ValueError: multi-modal data, a bad prompt or params, logprobs above
                ``max_logprobs``. RuntimeError: the engine is asleep, or a step failed.
        """
        if multi_modal_data is not None:
            raise ValueError("multi_modal_data: specengine serves text models only")
        ids = [int(t) for t in prompt_token_ids]
        llm, engine = self.llm, self.llm.engine
        params = to_sampling_params(sampling_params, len(ids), llm.engine_config.max_model_len)
        cap = llm.engine_args.max_logprobs
        if cap >= 0 and params.logprobs is not None and params.logprobs > cap:
            raise ValueError(f"logprobs={params.logprobs} is above max_logprobs={cap}")
        with self._cv:
            self._num_waiting += 1
            try:
                self._cv.wait_for(lambda: not self._paused and not (
                    self._session and engine.has_unfinished()))
            finally:
                self._num_waiting -= 1
            self._finish_session()
            rid = engine.add_request(ids, params)
        while True:
            with self._cv:
                if rid in self._done:
                    out = self._done.pop(rid)
                    if isinstance(out, BaseException):
                        raise RuntimeError(f"request {rid} failed: {out}") from out
                    return out
                if self._stepping:
                    self._cv.wait()
                    continue
                self._stepping = True
            try:
                self._step_until(rid)
            finally:
                with self._cv:
                    self._stepping = False
                    self._cv.notify_all()

    def _step_until(self, rid: str) -> None:
        """Run engine steps (lock held per step, released between) until ``rid`` finished."""
        engine = self.llm.engine
        while True:
            with self._cv:
                if rid in self._done:
                    return
                try:
                    outs = engine.step()
                except BaseException as e:  # every request in flight fails with it
                    for r in list(engine.requests):
                        self._done[r] = e
                    engine.abort_all()
                    raise
                for out in outs:
                    self._done[out.request_id] = out
                self._cv.notify_all()

    def pause_generation(self) -> None:
        """Hold new ``generate`` calls until ``resume_generation`` (requests in flight finish)."""
        with self._cv:
            self._paused = True

    def resume_generation(self) -> None:
        """Let held ``generate`` calls run."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def get_num_unfinished_requests(self) -> int:
        """Requests in the engine plus ``generate`` calls held back (paused or waiting for a
        weight update to apply)."""
        with self._cv:
            return len(self.llm.engine.requests) + self._num_waiting

    # ---- weight sync ------------------------------------------------------------------------
    def init_process_group(self, master_address: str, master_port: int, rank_offset: int,
                           world_size: int, group_name: str, backend: str = "gloo",
                           use_ray: bool = False) -> None:
        """Join the trainer's weight-broadcast group as rank ``rank_offset`` (rank 0: the
        trainer). Blocks until all ``world_size`` members joined.

        Raises:
            ValueError: ``use_ray=True``, a backend other than gloo.
        """
        if use_ray:
            raise ValueError("use_ray=True: a Ray collective group is not supported; use the "
                             "torch gloo group (use_ray=False)")
        self._group = WeightGroup(master_address, master_port, rank_offset, world_size,
                                  group_name, backend)

    def update_weight(self, name: str, dtype: torch.dtype, shape, empty_cache: bool = False
                      ) -> None:
        """Receive parameter ``name`` (``dtype``, ``shape``) broadcast by rank 0 and stage it
        (HF name; cast to the engine's dtype). Applied before the next ``generate``.

        Raises:
            RuntimeError: no ``init_process_group`` yet. ValueError: an unknown name or a shape
                that differs (the session is then dropped, the old weights keep serving).
        """
        del empty_cache  # nothing cached on CPU
        if self._group is None:
            raise RuntimeError("update_weight: call init_process_group first")
        w = self._group.broadcast(torch.empty(tuple(shape), dtype=dtype), src=0)
        with self._cv:
            if not self._session:
                self.llm.begin_weight_update()
                self._session = True
            try:
                self.llm.load_weights([(name, w)])
            except (ValueError, TypeError):
                self._session = False
                raise

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles, empty_cache=False):
        """Refused: CUDA IPC handles cannot reach this engine; use ``update_weight``.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("update_weight_cuda_ipc: no CUDA IPC here; sync with "
                           "init_process_group + update_weight")

    def _finish_session(self) -> None:
        if self._session:
            self._session = False
            self.llm.finish_weight_update()

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Apply staged weights, then ``LLM.sleep(level)``."""
        with self._cv:
            self._finish_session()
            return self.llm.sleep(level)


def remote_actor(llm_kwargs: dict, num_cpus: float = 1, num_gpus: float = 0,
                 max_concurrency: int = 64, **options):
    """Start an ``OpenRLHFRolloutActor`` on Ray (threaded: ``max_concurrency`` calls at once,
    so concurrent ``generate`` calls share the engine's steps); torch threads = ``num_cpus``.
    Returns the actor handle."""
    cls = ray.remote(OpenRLHFRolloutActor).options(
        num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=max_concurrency, **options)
    return cls.remote(llm_kwargs, max(1, int(num_cpus)))
