"""specengine as verl's rollout engine: ``SpecEngineRollout`` has the contract of verl's
``BaseRollout`` (the trainer side: ``resume(tags)``, ``update_weights(weights)``,
``release()``) and of its rollout server actor (``generate(prompt_ids, sampling_params,
request_id) -> TokenOutput``, ``wake_up``, ``sleep``, ``clear_kv_cache``,
``abort_all_requests``, ``resume_generation``, ...), in one object over one in-process
``LLM`` (verl 0.9.1: ``verl/workers/rollout/base.py``, ``replica.py``,
``vllm_rollout/vllm_rollout.py``, ``vllm_rollout/vllm_async_server.py``).

Concurrent ``generate`` calls are batched together: they go through the HTTP server's engine
loop (``specengine.async_llm.AsyncEngine``: one thread owns the engine and admits
whatever arrived before each step), and so do weight updates and sleep / wake, which run once
no request is in flight (no request ever mixes two sets of weights or runs asleep).

When verl imports (``verl.workers.rollout.base`` and ``.replica``; they need ray, tensordict,
omegaconf, hydra-core), ``SpecEngineRollout`` subclasses verl's ``BaseRollout`` and
``TokenOutput`` is verl's pydantic class; otherwise ``TokenOutput`` is a dataclass with the
same fields and the rollout class stands alone. ``register()`` puts
``("specengine", "async")`` into verl's rollout registry, so
``verl.workers.rollout.base.get_rollout_class("specengine")`` returns ``SpecEngineRollout``.
Not provided: a ``RolloutReplica`` (verl's Ray actor plumbing that launches server actors).

What is read from verl's rollout ``config`` (a ``RolloutConfig``, an OmegaConf ``DictConfig``
or a plain dict; missing keys take verl's defaults; ``verl_config.RolloutSettings`` reads them):

- engine: ``dtype``, ``max_model_len`` (default ``prompt_length + response_length``),
  ``max_num_seqs``, ``max_num_batched_tokens``, ``seed``, ``logprobs_mode`` (default
  ``processed_logprobs``), ``enable_prefix_caching``, ``gpu_memory_utilization``,
  ``load_format`` (verl's default ``dummy``: random weights until the first
  ``update_weights``), ``enable_sleep_mode``, ``enforce_eager``, ``skip_tokenizer_init``,
  ``tensor_model_parallel_size`` / ``data_parallel_size`` / ``pipeline_model_parallel_size``
  (must be 1: one process; ``LLM`` refuses more with a clear error);
- ``engine_kwargs.specengine``: more ``LLM`` keyword arguments, e.g. ``speculative_config``
  (``{"method": "ngram"}``, ``{"method": "eagle", ...}``), ``kv_cache_memory_bytes``,
  ``device``, ``attention_backend``, ``offload_dir``; and ``sleep_level`` (this adapter's:
  the level of ``release()`` / ``sleep()``, default 2 as verl's hybrid mode; 1 keeps the
  weights restorable without a push);
- ``mtp.enable`` with ``mtp.enable_rollout``: refused (no MTP drafter here; use
  ``speculative_config``);
- sampling defaults for keys a request leaves out: ``temperature``, ``top_p``, ``top_k``,
  ``repetition_penalty``, ``ignore_eos``; ``full_determinism`` with ``seed`` (a request seed
  of ``replica_rank + seed``); ``prompt_length`` / ``response_length`` (the default
  ``max_tokens``, as verl's server);
- ``free_cache_engine`` (False: ``resume`` / ``release`` / ``sleep`` do nothing, as verl's);
  ``checkpoint_engine.update_weights_bucket_megabytes`` (the bucket size of
  ``update_weights``).

From ``model_config`` (verl's ``HFModelConfig`` or a dict): ``local_path`` or ``path`` (the HF
directory), ``trust_remote_code``. ``device_mesh`` is kept and not used (one process).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from specengine.async_llm import AsyncEngine, RequestAborted
from specengine.integrations.verl_config import RolloutSettings

REGISTRY_VALUE = "specengine.integrations.verl.SpecEngineRollout"


def _verl_classes():
    try:
        from verl.workers.rollout.base import BaseRollout
        from verl.workers.rollout.replica import TokenOutput as VerlTokenOutput
    except Exception:  # noqa: BLE001 - not installed, or missing its own deps (ray, ...)
        return None, None
    return BaseRollout, VerlTokenOutput


_VerlBaseRollout, _VerlTokenOutput = _verl_classes()
VERL_AVAILABLE = _VerlBaseRollout is not None  # verl's real classes are in use


@dataclass
class _LocalTokenOutput:
    """What one ``generate`` returns (verl's ``TokenOutput`` fields).

    Attributes:
        token_ids: response token ids (an EOS or stop token that ended it included).
        log_probs: the sampled token's log-probability per response token (``logprobs_mode``
            of the engine), or None when the request did not ask for logprobs.
        routed_experts: always None (no MoE routing replay).
        stop_reason: ``"completed"`` (EOS, stop token or length) or ``"aborted"``.
        num_preempted: None (not counted per request).
        extra_fields: ``global_steps``, ``weight_version``; with speculation
            ``spec_num_draft_tokens``, ``spec_num_accepted_tokens``, ``spec_num_verify_steps``.
    """

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


TokenOutput = _VerlTokenOutput if VERL_AVAILABLE else _LocalTokenOutput


def register(name: str = "specengine") -> None:
    """Add ``(name, "async")`` -> ``SpecEngineRollout`` to verl's rollout registry
    (``verl.workers.rollout.base._ROLLOUT_REGISTRY``; verl stores import paths).

    Raises:
        ImportError: verl (or a dependency it imports: ray, tensordict, ...) is missing.
    """
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY

    _ROLLOUT_REGISTRY[(name, "async")] = REGISTRY_VALUE


async def _aiter(weights):
    """A sync or async iterable of ``(name, tensor)`` as an async iterator."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


class SpecEngineRollout(_VerlBaseRollout or object):
    """verl's rollout contract over one in-process ``specengine.LLM``.

    Args:
        config: verl's rollout config (see the module docstring for the keys read).
        model_config: verl's model config (``local_path`` / ``path``); unused with ``llm``.
        device_mesh: kept as ``self.device_mesh``; unused (one process).
        llm: an ``LLM`` to serve instead of building one from the configs; from now on the
            rollout's engine thread owns it (do not call its methods directly; use ``call``).
        replica_rank: this replica's rank (the request seed under ``full_determinism``).

    Raises:
        ValueError: no model path and no ``llm``; MTP rollout asked for; an ``LLM`` argument
            refused (e.g. ``tensor_model_parallel_size`` > 1).
    """

    def __init__(self, config, model_config=None, device_mesh=None, *args, llm=None,
                 replica_rank: int = 0, **kwargs):
        self.config, self.model_config, self.device_mesh = config, model_config, device_mesh
        self.replica_rank = replica_rank
        self.settings = st = RolloutSettings(config, model_config, replica_rank)
        self.sleep_level, self.free_cache_engine = st.sleep_level, st.free_cache_engine
        self.prompt_length, self.response_length = st.prompt_length, st.response_length
        self.bucket_bytes = st.bucket_bytes
        if llm is None:
            llm = st.build_llm()
        elif st.extra:
            raise ValueError(f"engine_kwargs.specengine {sorted(st.extra)} cannot apply to the "
                             "LLM given as llm=")
        self.llm = llm
        self.max_model_len = llm.engine_config.max_model_len
        self.engine = AsyncEngine(llm)
        self.engine.start()
        self.global_steps: int | None = None
        self._handles: dict[str, Any] = {}  # verl request id -> RequestHandle
        self._paused = False
        self._rejecting = False
        self._gate: asyncio.Event | None = None

    # ---- engine-thread calls --------------------------------------------------------------
    async def call(self, fn, *args, exclusive: bool = False):
        """Run ``fn(*args)`` on the engine thread (``exclusive``: once no request is in
        flight); the way to reach ``self.llm`` while the rollout runs."""
        return await self.engine.call(fn, *args, exclusive=exclusive)

    def shutdown(self) -> None:
        """Stop the engine thread; requests in flight fail."""
        self.engine.shutdown()

    # ---- BaseRollout: trainer side --------------------------------------------------------
    async def resume(self, tags: list[str]) -> None:
        """Wake ``tags`` (``"weights"`` and/or ``"kv_cache"``) after ``release()``; nothing
        when ``free_cache_engine`` is off. Raises ValueError for an unknown tag."""
        if self.free_cache_engine:
            await self.call(self.llm.wake_up, list(tags), exclusive=True)

    async def release(self) -> dict[str, int] | None:
        """Reset the prefix cache, then ``sleep(sleep_level)`` (level 2 discards the weights:
        an ``update_weights`` must follow before generating). Returns the bytes released
        (``LLM.sleep``), None when ``free_cache_engine`` is off."""
        if not self.free_cache_engine:
            return None

        def release():
            self.llm.reset_prefix_cache()
            return self.llm.sleep(self.sleep_level)

        return await self.call(release, exclusive=True)

    async def update_weights(self, weights, global_steps: int | None = None,
                             wire_format: str = "named_tensors", peft_config=None,
                             base_sync_done: bool = False, **kwargs) -> list[str]:
        """Load full Hugging Face-named tensors from a sync or async generator of
        ``(name, tensor)``: streamed through ``begin_weight_update`` / ``load_weights(bucket)``
        (buckets of ``update_weights_bucket_megabytes``; any float dtype and device, cast and
        copied on load) / ``finish_weight_update`` (applied at once, once no request is in
        flight; the prefix cache is reset and the weight version goes up by one). A tensor
        must stay unchanged until its bucket is loaded (a fresh tensor per yield, as verl's
        ``get_per_tensor_param`` gives). On any error the session is aborted: the old weights
        keep serving. Returns the names applied.

        Raises:
            NotImplementedError: ``wire_format`` other than ``"named_tensors"``, or LoRA
                adapter weights (``peft_config`` with ``base_sync_done``).
            ValueError / TypeError: a name, shape or value refused (see ``LLM.load_weights``).
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"update_weights: wire_format={wire_format!r} is not "
                                      "supported (only 'named_tensors': full tensors)")
        if peft_config is not None and base_sync_done:
            raise NotImplementedError("update_weights: LoRA adapter weights are not supported "
                                      "(merge the adapter and send full tensors)")
        llm = self.llm
        await self.call(llm.begin_weight_update)
        try:
            bucket, size = [], 0
            async for name, tensor in _aiter(weights):
                bucket.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if size >= self.bucket_bytes:
                    await self.call(llm.load_weights, bucket)
                    bucket, size = [], 0
            if bucket:
                await self.call(llm.load_weights, bucket)
            names = await self.call(llm.finish_weight_update, exclusive=True)
        except BaseException:
            if self.engine.is_running:
                await self.call(llm.abort_weight_update)
            raise
        if global_steps is not None:
            self.global_steps = global_steps
        return names

    # ---- server side ----------------------------------------------------------------------
    def _token_output(self, **kw):
        extra = {"global_steps": self.global_steps, **kw.pop("extra_fields", {})}
        return TokenOutput(routed_experts=None, num_preempted=None, extra_fields=extra, **kw)

    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str,
                       image_data=None, video_data=None, audio_data=None,
                       mm_processor_kwargs=None, priority: int = 0, kv_transfer_params=None,
                       **ignored):
        """One sample for ``prompt_ids`` (verl sends ``n`` copies as separate requests); batched
        with every other request in flight. While generation is paused
        (``abort_all_requests``) the request waits for ``resume_generation`` (or comes back
        aborted with ``reject_request``).

        Args:
            prompt_ids: prompt token ids.
            sampling_params: verl's dict: ``temperature``, ``top_p``, ``top_k``,
                ``repetition_penalty``, ``logprobs`` (bool), ``max_tokens`` /
                ``max_new_tokens``, and any other ``SamplingParams`` field (``seed``, ``stop``,
                ``min_p``, ...). Not modified.
            request_id: verl's id (for ``abort_request``).

        Returns:
            ``TokenOutput``: ``token_ids``, ``log_probs`` (one per token, when asked),
            ``stop_reason`` ``"completed"`` / ``"aborted"`` (an aborted request keeps the tokens
            generated before the abort), ``extra_fields`` (see ``TokenOutput``).

        Raises:
            ValueError: multimodal data, an empty / too long prompt, a bad sampling value.
            RuntimeError: the engine is asleep (``release`` / ``sleep`` without a wake-up).
        """
        if any(x is not None for x in (image_data, video_data, audio_data)):
            raise ValueError("generate: multimodal data is not supported (text models only)")
        params, want = self.settings.sampling_params(len(prompt_ids), dict(sampling_params),
                                                     self.max_model_len)
        while self._paused:
            if self._rejecting:
                return self._token_output(token_ids=[], log_probs=None, stop_reason="aborted")
            if self._gate is None:
                self._gate = asyncio.Event()
            await self._gate.wait()
        ids, lps, out = await self._stream(request_id, list(prompt_ids), params)
        if out is None:  # aborted: what was generated before the abort
            return self._token_output(token_ids=ids, log_probs=lps if want else None,
                                      stop_reason="aborted")
        return self._finished(out, want)

    async def _stream(self, request_id: str, prompt_ids: list[int], params):
        """Submit one request and follow it: ``(token ids, sampled logprobs, final
        RequestOutput or None when aborted)``."""
        handle = self.engine.submit(prompt_ids, params, stream=True)
        self._handles[request_id] = handle
        ids, lps, out = [], [], None
        try:
            async for update in handle:
                for d in update.deltas:
                    ids += d.token_ids
                    if d.logprobs is not None:
                        lps += [lp[t].logprob for t, lp in zip(d.token_ids, d.logprobs)]
                if update.output is not None:
                    out = update.output
        except RequestAborted:
            pass
        finally:
            self._handles.pop(request_id, None)
        return ids, lps, out

    def _finished(self, out, want: bool):
        """The ``TokenOutput`` of a finished request (``want``: with logprobs)."""
        o = out.outputs[0]
        reason = {"stop": "completed", "length": "completed", "abort": "aborted"}.get(
            o.finish_reason, o.finish_reason)
        extra = {"weight_version": out.weight_version}
        if self.llm.engine.drafter is not None:
            m = out.metrics
            extra.update(spec_num_draft_tokens=m.get("drafted_tokens", 0),
                         spec_num_accepted_tokens=m.get("accepted_tokens", 0),
                         spec_num_verify_steps=m.get("spec_steps", 0))
        return self._token_output(token_ids=list(o.token_ids),
                                  log_probs=o.sampled_logprobs if want else None,
                                  stop_reason=reason, extra_fields=extra)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (default ``["kv_cache", "weights"]``), then reset the prefix cache."""
        def wake():
            self.llm.wake_up(list(tags) if tags else ["kv_cache", "weights"])
            self.llm.reset_prefix_cache()

        await self.call(wake, exclusive=True)

    async def sleep(self) -> dict[str, int] | None:
        """``sleep(sleep_level)`` (nothing when ``free_cache_engine`` is off)."""
        if self.free_cache_engine:
            return await self.call(self.llm.sleep, self.sleep_level, exclusive=True)
        return None

    async def clear_kv_cache(self) -> bool:
        """Reset the prefix cache (verl calls it after every weight update)."""
        return await self.call(self.llm.reset_prefix_cache, exclusive=True)

    async def release_kv_cache(self) -> None:
        """Free the KV cache for a weight sync (verl: sleep, then wake the weights)."""
        if self.free_cache_engine:
            def release():
                self.llm.sleep(self.sleep_level)
                self.llm.wake_up(["weights"])

            await self.call(release, exclusive=True)

    async def resume_kv_cache(self) -> None:
        """Bring the KV cache back after ``release_kv_cache``."""
        if self.free_cache_engine:
            await self.call(self.llm.wake_up, ["kv_cache"], exclusive=True)

    async def abort_all_requests(self, reset_prefix_cache: bool = True,
                                 reject_request: bool = False) -> dict[str, Any]:
        """Pause generation and abort every request in flight (each ``generate`` returns
        ``stop_reason="aborted"`` with its tokens so far). New requests wait for
        ``resume_generation`` (with ``reject_request``: come back aborted at once).
        Returns ``{"aborted_count", "request_ids"}`` (verl's ids)."""
        self._paused, self._rejecting = True, reject_request
        if self._gate is None:
            self._gate = asyncio.Event()
        rids = list(self._handles)
        await self.engine.abort_all()
        if reset_prefix_cache:
            await self.call(self.llm.reset_prefix_cache, exclusive=True)
        return {"aborted_count": len(rids), "request_ids": rids}

    async def resume_generation(self) -> None:
        """Admit requests again after ``abort_all_requests``."""
        self._paused = self._rejecting = False
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True
                            ) -> dict[str, Any]:
        """Abort one request by verl's id: ``{"aborted": bool, "request_id"}``."""
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.abort()
        if reset_prefix_cache and handle is not None:
            await self.call(self.llm.reset_prefix_cache, exclusive=True)
        return {"aborted": handle is not None, "request_id": request_id}

    async def set_global_steps(self, global_steps: int) -> None:
        """The trainer step of the weights (reported as ``extra_fields["global_steps"]``)."""
        self.global_steps = global_steps

    def generate_sequences(self, prompts):
        """Sync batch generation (retired in verl with the SPMD mode): not supported."""
        raise NotImplementedError("SpecEngineRollout serves the async generate() interface")
