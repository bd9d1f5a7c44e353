"""``LLM``: the offline generation API, with vLLM's names so RL frameworks switch with few edits."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping

import torch
from tqdm.auto import tqdm

from specengine.engine.config import EngineConfig, parse_dtype
from specengine.engine.engine import Engine
from specengine.engine.outputs import RequestOutput, ScoreOutput
from specengine.engine.sequence import PartialSample, ScoreSpec
from specengine.kv import kv_bytes_per_block
from specengine.lifecycle.memory import MemoryManager
from specengine.lifecycle.migration import KVChunk, MigratedSequence, Migrator, SequenceInfo
from specengine.lifecycle.weights import WeightUpdater
from specengine.llm_args import parse_engine_args
from specengine.models.registry import DEFAULT_MODEL
from specengine.ops.extension import ext
from specengine.replay.trace import RolloutTrace, TraceRecorder
from specengine.sampling.params import SamplingParams, per_prompt
from specengine.speculative.config import SpeculativeConfig
from specengine.speculative.drafters import make_drafter
from specengine.speculative.drafters.merged import share_calibration
from specengine.speculative.policy import make_policy
from specengine.speculative.training.harvest import Harvester

DEFAULT_KV_BYTES = 1 << 30


class LLM:
    """A model plus an engine, for batched offline generation.

    Args:
        model: a known alias (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``,
            ``qwen2.5-coder-1.5b-instruct``), a Hugging Face directory, or a ``.gguf`` file.
        dtype: ``"bfloat16"`` or ``"float32"`` (weights, activations and KV cache).
        max_model_len: longest prompt + output in tokens (default: the model's
            ``max_position_embeddings``).
        kv_cache_memory_bytes: bytes for the paged KV cache (default 1 GiB).
        seed: seeds requests that carry no seed of their own.
        block_size: tokens per KV block.
        max_num_seqs: most sequences decoded in one step.
        max_num_batched_tokens: most tokens in one forward (default ``max(4096, max_model_len)``).
        logprobs_mode: ``"raw_logprobs"`` (before temperature and filtering, vLLM's default) or
            ``"processed_logprobs"`` (of the distribution sampled from).
        device: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``.
        attention_backend: ``"auto"``, ``"cpu"`` (C++), ``"cuda"``, ``"triton"`` or ``"torch"``.
        head_dtype: ``"float32"``: logits of a bfloat16 model from a float32 copy of the LM
            head over float32 hidden states (vLLM's ``head_dtype``; closer to a trainer that
            computes its logits in float32); None / ``"auto"``: the model dtype.
        prefix_cache_policy: after a weight update, ``"reset"`` (forget the prefix cache,
            the default) or ``"keep_versioned"`` (keep it; each cached block is found only by
            requests of the weight version that computed it).
        speculative_config: e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``; see
            ``specengine.speculative.config.SpeculativeConfig``. Outputs are unchanged by it: greedy
            output is identical, sampled output has the same distribution.

    vLLM engine arguments (what verl, TRL and OpenRLHF pass; checked by
    ``specengine.llm_args``), keyword only:

    - honoured: ``enable_prefix_caching`` (default True: reuse the KV of full blocks already
      computed for the same leading tokens, vLLM's automatic prefix caching; outputs are
      unchanged by it),
      ``load_format`` (``"auto"``/``"safetensors"``: the checkpoint; ``"dummy"``: random
      weights, for a trainer that pushes real ones before rollouts), ``max_logprobs``
      (default 20: ``SamplingParams.logprobs`` above it is refused; -1: no limit),
      ``skip_tokenizer_init`` (no tokenizer: prompts must be token ids, ``text`` stays
      empty), ``gpu_memory_utilization`` (on CUDA, without ``kv_cache_memory_bytes``: the KV
      cache takes what is left of that fraction of the device's memory; on CPU it is checked
      and ignored), ``offload_dir`` (specengine: the directory of the temporary file a CPU
      engine's weights go to during ``sleep(level=1)``; default the system temp directory).
    - accepted, nothing to do here: ``enable_sleep_mode`` (``sleep``/``wake_up`` always
      work: nothing is reserved up front), ``enforce_eager`` (always eager: no CUDA graphs),
      ``trust_remote_code`` (no model code from checkpoints is ever run; known architectures
      only), ``distributed_executor_backend`` None/``"uni"``/``"external_launcher"`` (all
      mean: this process), ``model_impl`` ``"auto"``/``"vllm"`` (specengine's own decoder),
      ``tensor_parallel_size``/``pipeline_parallel_size``/``data_parallel_size`` = 1,
      ``quantization`` None, ``kv_cache_dtype`` ``"auto"`` (the model dtype),
      ``enable_chunked_prefill`` (prefills are never split: a prompt longer than
      ``max_num_batched_tokens`` runs alone in its step), ``disable_log_stats``,
      ``disable_custom_all_reduce``, ``swap_space`` (preemption recomputes; no swap),
      ``max_seq_len_to_capture``, ``cpu_offload_gb`` = 0, ``enable_lora`` False,
      ``revision`` None, ``worker_extension_cls`` None.
    - refused (ValueError saying why): parallel sizes > 1, a Ray or multiprocessing executor,
      a quantization method, a worker extension, LoRA, ``cpu_offload_gb`` > 0, a revision,
      ``model_impl="transformers"``, another ``kv_cache_dtype`` or ``load_format``; an
      unknown keyword (the message lists the accepted ones).

    ``dtype`` also takes vLLM's ``"auto"`` (the checkpoint's float16/bfloat16, bfloat16 for a
    float32 checkpoint), ``"half"`` and ``"float"``.

    Raises:
        ValueError: unknown alias or dtype, ``max_model_len`` above the model's limit, a KV
            budget smaller than one block, an engine argument refused as above.
            FileNotFoundError: a missing path.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str | torch.dtype = "bfloat16",
                 max_model_len: int | None = None, kv_cache_memory_bytes: int | None = None,
                 seed: int = 0, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None,
                 logprobs_mode: str = "raw_logprobs", speculative_config: dict | None = None,
                 device: str = "auto", attention_backend: str = "auto",
                 head_dtype: str | torch.dtype | None = None,
                 prefix_cache_policy: str = "reset", **engine_args):
        from specengine.models.loader import load_model

        args = self.engine_args = parse_engine_args(engine_args)
        self.enable_prefix_caching = args.enable_prefix_caching
        torch_dtype = parse_dtype(_vllm_dtype(dtype, model))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        head = _head_dtype(head_dtype, torch_dtype)
        loaded = load_model(model, dtype=torch_dtype, device=device,
                            dummy=args.load_format == "dummy")
        loaded.model.head_dtype = head
        self.head_dtype = head or torch_dtype
        self.model_name = model
        self.model_dir = loaded.model_dir
        self.tokenizer = None if args.skip_tokenizer_init else loaded.tokenizer
        cfg = loaded.config
        limit = cfg.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        elif not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len} must be in [2, {limit}] "
                             f"(the model's max_position_embeddings)")
        per_block = kv_bytes_per_block(cfg, block_size, torch_dtype)
        if (kv_cache_memory_bytes is None and args.gpu_memory_utilization is not None
                and torch.device(device).type == "cuda"):
            free, total = torch.cuda.mem_get_info(torch.device(device))
            kv_cache_memory_bytes = int(args.gpu_memory_utilization * total) - (total - free)
        kv_bytes = DEFAULT_KV_BYTES if kv_cache_memory_bytes is None else kv_cache_memory_bytes
        num_blocks = kv_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={kv_bytes} holds no KV block "
                             f"({per_block} bytes each)")
        if kv_cache_memory_bytes is None:  # no need for more than max_num_seqs full sequences
            num_blocks = min(num_blocks, max_num_seqs * -(-max_model_len // block_size))
        self.engine_config = EngineConfig(
            max_model_len=max_model_len, block_size=block_size, num_kv_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(4096, max_model_len),
            enable_prefix_caching=bool(args.enable_prefix_caching),
            prefix_cache_policy=prefix_cache_policy)
        self.speculative_config = SpeculativeConfig.from_dict(speculative_config)
        drafter = make_drafter(self.speculative_config, loaded, num_blocks, block_size) \
            if self.speculative_config else None
        policy = make_policy(self.speculative_config, seed) if drafter else None
        share_calibration(drafter, policy)  # a merged drafter fills its budget with them
        eos = None  # default: the model's and the tokenizer's
        if self.tokenizer is None and getattr(loaded.tokenizer, "eos_token_id", None) is not None:
            eos = {*cfg.eos_token_ids, loaded.tokenizer.eos_token_id}  # skip_tokenizer_init
        self.engine = Engine(loaded.model, self.tokenizer, self.engine_config, seed=seed,
                             logprobs_mode=logprobs_mode, eos_token_ids=eos, drafter=drafter,
                             policy=policy, attention_backend=attention_backend)
        if policy is not None:
            policy.warm_start(self.engine)
        self._wall_time = 0.0
        self.memory = MemoryManager(self.engine, args.offload_dir)
        self.engine.ready_check = self.memory.check_ready
        self.weights = WeightUpdater(self.engine, self.memory)
        self.migration = Migrator(self.engine)

    def get_tokenizer(self):
        """The transformers tokenizer of the model (None for a model without one)."""
        return self.tokenizer

    def get_metrics(self) -> dict:
        """Engine counters since start: requests, prompt/generated tokens, steps, prefill and
        decode time (seconds), preemptions, KV blocks (total and free), wall time in
        ``generate`` (seconds); with speculation, the policy's ``stats()`` (strategies run,
        steps, predicted and observed tokens/s, decision time; with ``auto`` also
        ``policy_budget``, how draft nodes were spread over sequences, and
        ``policy_remaining``, the remembered output lengths) and ``tau_per_weight_version``
        (target weight version -> tokens committed per verify step while it served: drift
        after a weight update shows here); with an EAGLE drafter (also inside a
        ``Harvester`` or merged with others), ``drafter_version`` and ``tau_per_version``
        (drafter version -> tokens committed per verify step, see ``EagleDrafter.stats``); with
        several drafters merged, ``merged_nodes_proposed`` / ``merged_nodes_kept`` per source
        (``MergedDrafter.stats``); with speculation, ``source_stats``: per draft source, nodes
        verified and accepted, overall and per depth (``sources.SourceStats``), and where the
        policy calibrates per source (``auto``, or any policy with a merged drafter) its
        ``calibration`` map (acceptance probability per confidence bin, also in
        ``policy_calibration_per_source``); with the suffix drafter, ``rollout_memory_bytes`` /
        ``_groups`` / ``_tokens`` / ... and the index update and lookup seconds
        (``suffix_update_seconds``, ``suffix_lookup_seconds``, totals and per step; see
        ``SuffixDrafter.stats``). Always: ``weight_version``,
        ``weight_updates``, ``weight_update_time`` / ``last_weight_update_time`` (seconds
        applying updates) and ``sleep_level`` (0 awake, else the deepest level slept); prefix
        caching: ``prefix_cache_hit_rate`` (hit / queried prompt tokens),
        ``prefix_cache_hit_tokens``, ``prefix_cache_queried_tokens``,
        ``prefix_cache_rerun_tokens`` (hit tokens run again for their logits),
        ``prefix_cache_blocks`` (cached now; those nobody uses count in ``kv_blocks_free``,
        evicted on demand); migration (``specengine.lifecycle.migration.Migrator``):
        ``migration_stage1_seconds`` / ``_bytes``, ``migration_stage2_seconds`` / ``_bytes``,
        ``migration_import_seconds`` / ``_bytes``, ``migrated_out`` / ``migrated_in`` (with
        K/V), ``reprefilled_out`` / ``reprefilled_in`` (as tokens); threads
        (``specengine.ops.threads.ThreadTuner.stats``): ``kernel_threads`` (forward-size bucket ->
        the kernels' thread count chosen), ``kernel_threads_max``, ``thread_probes``,
        ``thread_switches``, ``adaptive_threads``, and ``kernel_pool``, the process's kernel
        pool counters (jobs, helper_chunks, waits and sleeps of the caller for a helper's
        chunk, wait_ns, late_helpers; see ``csrc/pool.h``)."""
        d = self.engine.metrics.as_dict()
        d.update(kv_blocks_total=self.engine.blocks.num_blocks,
                 kv_blocks_free=self.engine.blocks.num_free, generate_time=self._wall_time,
                 sleep_level=self.memory.level, **self.weights.stats())
        d.update(self.engine.threads.stats())
        if hasattr(ext(), "pool_stats"):  # (an extension built before it has none)
            d["kernel_pool"] = ext().pool_stats()
        d.update(self.engine.blocks.prefix_cache_stats())
        drafter = self.engine.drafter
        if drafter is not None:
            d.update(self.engine.policy.stats())
            d["tau_per_weight_version"] = self.weights.tau_per_weight_version()
        if isinstance(drafter, Harvester):
            drafter = drafter.inner
        if drafter is not None:  # EAGLE: versions; suffix: rollout memory and its costs
            d.update(drafter.stats())
        for src, cal in d.get("policy_calibration_per_source", {}).items():
            if src in d.get("source_stats", {}):
                d["source_stats"][src]["calibration"] = cal
        return d

    # ---- rollout traces (specengine.replay.trace) -----------------------------------------------
    def start_trace(self) -> None:
        """Start recording a rollout trace: per step the sequences decoded, tokens in the
        forward, draft nodes per sequence and source, accepted and committed tokens, the
        strategy and the step's seconds (``specengine.replay.trace``). Off by default; costs one
        attribute check per step when off.

        Raises:
            RuntimeError: a trace is already being recorded.
        """
        if self.engine.trace is not None:
            raise RuntimeError("a rollout trace is already being recorded; stop_trace() first")
        drafter = self.engine.drafter
        if isinstance(drafter, Harvester):
            drafter = drafter.inner
        cfg = self.engine_config
        meta = {"model": self.model_name, "dtype": str(self.engine.runner.dtype).split(".")[-1],
                "device": str(self.engine.runner.device),
                "drafter": drafter.name if drafter is not None else None,
                "policy": self.engine.policy.name if drafter is not None else None,
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens}
        self.engine.trace = TraceRecorder(meta, meta["drafter"], self.engine.policy.decision_time)
        self._trace_preemptions = self.engine.scheduler.num_preemptions

    def stop_trace(self) -> RolloutTrace:
        """Stop recording; returns the ``RolloutTrace`` (``save(path)`` writes it).

        Raises:
            RuntimeError: no trace is being recorded.
        """
        rec = self.engine.trace
        if rec is None:
            raise RuntimeError("no rollout trace is being recorded; call start_trace() first")
        self.engine.trace = None
        return rec.finish(self.engine.scheduler.num_preemptions - self._trace_preemptions)

    # ---- weight sync (specengine.lifecycle.weights) ---------------------------------------------
    @property
    def weight_version(self) -> int:
        """Version of the target's weights: 0 as loaded, +1 per applied update (or the version
        given to ``finish_weight_update``); stamped on every ``RequestOutput``."""
        return self.engine.weight_version

    def update_weights(self, weights: Mapping[str, torch.Tensor]
                       | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Overwrite some or all of the target's weights in one call, between ``generate``
        calls: ``begin_weight_update`` + ``load_weights(weights)`` + ``finish_weight_update``
        (a trainer pushing a new policy: SGLang's ``update_weights_from_tensor``, TRL's
        colocated push). Later steps use the new weights: the kernels' packed copies are
        rebuilt once, the prefix cache is reset, ``weight_version`` goes up by one.

        An EAGLE drafter shares the target's embedding, final norm and LM head tensors, so
        those follow automatically; its own layer does not (it is now stale: train it online,
        ``DrafterTrainer`` in ``speculative.training``). A ``draft_model`` drafter is a
        separate model and is not changed.

        Args:
            weights: ``(name, tensor)`` pairs or a dict, with Hugging Face parameter names (as
                a transformers model's ``named_parameters()`` / ``state_dict()`` have them;
                fused ``qkv_proj`` / ``gate_up_proj`` names too), any subset (e.g. some layers),
                any floating dtype (cast to the engine's) and device. The tensors are read
                while the call runs and not copied first: they must not change until it
                returns (a generator must not yield one reused buffer).

        Returns:
            the names applied (fused names as their q/k/v, gate/up parts; ``rotary_emb.inv_freq``
            and a tied ``lm_head.weight`` are skipped, as in ``load_weights``).

        Raises:
            ValueError: an unknown name, a shape that differs, NaN/inf values (naming the
                tensor). TypeError: an entry that is not a floating-point tensor.
            RuntimeError: requests are in flight (a ``generate_iter`` not run to its end), or a
                weight update session is open.
            Nothing is changed when any of these is raised: all entries are checked first.
        """
        return self.weights.update(weights)

    def begin_weight_update(self) -> None:
        """Open a streamed weight update: ``load_weights(chunk)`` any number of times, then
        ``finish_weight_update()`` (applies everything at once) or ``abort_weight_update()``.
        The old weights keep serving until ``finish``.

        Raises:
            RuntimeError: a session is open already.
        """
        self.weights.begin()

    def load_weights(self, weights) -> list[str]:
        """Stage one chunk of a streamed update, or load a checkpoint.

        Args:
            weights: a ``(name, tensor)`` pair, a dict (a bucket) or an iterable of pairs, HF
                names (fused ``qkv_proj``/``gate_up_proj`` accepted), any floating dtype: staged
                into the open session (copied now, so buffers may be reused at once). Or a
                path (str / ``os.PathLike``) of a checkpoint: a HF directory of safetensors
                files or one ``.safetensors`` file; staged into the open session, or, with no
                session open, applied at once as one update.

        Returns:
            the names staged (or applied, for a checkpoint with no session open).

        Raises:
            RuntimeError: a chunk with no session open.
            ValueError: an unknown name, a shape that differs, NaN/inf values, a corrupt file;
                TypeError: not a floating-point tensor, not a chunk. Either way the session is
                aborted: nothing of it is applied, the old weights keep serving, and the next
                ``load_weights(chunk)`` needs a new ``begin_weight_update()``.
            FileNotFoundError: a checkpoint path that does not exist or has no safetensors.
        """
        if isinstance(weights, (str, os.PathLike)):
            return self.weights.load_checkpoint(weights)
        return self.weights.load(weights)

    def finish_weight_update(self, weight_version: int | None = None) -> list[str]:
        """Apply the open session's chunks at once: the kernels' packed copies are rebuilt
        once, ``reset_prefix_cache()`` is called and ``weight_version`` becomes
        ``weight_version`` (if given) or goes up by one. Returns the names applied.

        Raises:
            RuntimeError: no session is open, or requests are in flight (the session then
                stays open). ValueError: ``weight_version`` not an int >= 0.
        """
        return self.weights.finish(weight_version)

    def abort_weight_update(self) -> bool:
        """Drop the open session; nothing is applied. Returns whether one was open."""
        return self.weights.abort()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's ``LLM.reset_prefix_cache``; RL trainers call
        it after a weight push; weight updates follow ``prefix_cache_policy``). Also while
        requests are in flight: running samples keep their blocks, and what they cache later
        is never found by requests admitted after the reset. Returns True."""
        return self.engine.reset_prefix_cache()

    # ---- memory lifecycle (specengine.lifecycle.memory) -----------------------------------------
    def sleep(self, level: int = 1) -> dict[str, int]:
        """Give memory back between rollouts (colocated trainer). Level 1: release the KV
        caches and move the target's weights out (CPU: to a temporary file; CUDA: to pinned
        host memory), restored by ``wake_up``. Level 2: release the KV caches and discard the
        target's weights; new weights (``update_weights``, ``load_weights`` or a session) must
        be loaded before generating. A drafter's own weights stay (an EAGLE layer survives
        level 2). Generating while asleep raises RuntimeError.

        Returns:
            bytes released: ``weights``, ``packed`` (kernel copies), ``kv_cache``, ``total``.

        Raises:
            ValueError: ``level`` not 1 or 2. RuntimeError: requests are in flight.
        """
        return self.memory.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released: ``tags`` None (all) or a list of ``"weights"``,
        ``"kv_cache"``, ``"cuda_graph"`` (accepted, nothing to do). Idempotent. After a
        level-2 sleep, waking ``"weights"`` re-allocates them only: load new weights next.

        Raises:
            ValueError: an unknown tag (the message lists the known ones).
        """
        self.memory.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while the KV cache or the target's weights are released."""
        return self.memory.is_sleeping

    def _to_token_ids(self, prompt, i: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text but the model has no tokenizer")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "partial"}
            if unknown:
                raise ValueError(f"prompt {i}: unknown keys {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return self._to_token_ids(prompt["prompt"], i)
            raise ValueError(f"prompt {i}: a dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt {i} has type {type(prompt).__name__}; expected str, list of "
                         "token ids or a dict with 'prompt' / 'prompt_token_ids'")

    @staticmethod
    def _partial_of(prompt, i: int) -> PartialSample | None:
        """A dict prompt's ``"partial"`` (a ``PartialSample`` or a dict of its fields)."""
        part = prompt.get("partial") if isinstance(prompt, dict) else None
        if part is None or isinstance(part, PartialSample):
            return part
        if not isinstance(part, dict) or not isinstance(part.get("token_ids"), (list, tuple)) \
                or set(part) - {"token_ids", "index", "weight_versions"}:
            raise ValueError(f"prompt {i}: 'partial' must be a dict with 'token_ids' (list) and "
                             "optionally 'index' and 'weight_versions'")
        return PartialSample(list(part["token_ids"]), part.get("index", 0),
                             part.get("weight_versions"))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for ``prompts``; results come back in input order.

        Args:
            prompts: a string, a list of token ids, a dict ``{"prompt_token_ids": [...]}`` or
                ``{"prompt": "..."}``, or a list of these. A dict may carry ``"partial"``: a
                sample cut short to continue (``{"token_ids", "index", "weight_versions"}``,
                see ``continuation_prompts``): one sample, equal with the same seed and
                weights to the sample never interrupted (``Engine.add_request``).
            sampling_params: one for all prompts, or one per prompt (default
                ``SamplingParams()``).
            use_tqdm: show a progress bar.

        Raises:
            ValueError: a bad prompt (empty, too long, wrong type) or a params list of the
                wrong length; nothing is generated then.
        """
        done = dict(self.generate_iter(prompts, sampling_params, use_tqdm))
        return [done[i] for i in range(len(done))]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to conversations using the tokenizer's chat template.

        Args:
            messages: one conversation (list of ``{"role", "content"}`` dicts) or a list of them.

        Raises:
            ValueError: no tokenizer or no chat template; a malformed conversation.
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name!r} has no chat template")
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = []
        for i, conv in enumerate(messages):
            text, ids = self.encode_chat(conv, f"conversation {i}", add_generation_prompt,
                                         chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, conv: list[dict], what: str = "conversation",
                    add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """Apply the chat template to one conversation; returns (text, token ids).

        Raises:
            ValueError: naming ``what``, if ``conv`` is not a non-empty list of role/content dicts.
        """
        if not isinstance(conv, list) or not conv or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in conv):
            raise ValueError(f"{what} must be a non-empty list of "
                             "{'role': str, 'content': str} dicts")
        text = self.tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}))
        return text, self.tokenizer(text, add_special_tokens=False).input_ids

    def generate_iter(self, prompts, sampling_params: SamplingParams | list[SamplingParams]
                      | None = None, use_tqdm: bool = True):
        """Like ``generate``, but yields ``(prompt_index, RequestOutput)`` as each request
        finishes (so a batch job can save results as it goes). Validation happens first."""
        prompts, params = per_prompt(prompts, sampling_params)
        self.memory.check_ready()
        if self.engine.paused:
            raise RuntimeError(f"generation is paused ({self.engine.paused!r}): call "
                               "resume_generation() first")
        for i, p in enumerate(params):
            self._check_logprobs(p, f"prompt {i}")
        tokenized = [self._to_token_ids(p, i) for i, p in enumerate(prompts)]
        partials = [self._partial_of(p, i) for i, p in enumerate(prompts)]
        for i, ((_, ids), part, p) in enumerate(zip(tokenized, partials, params)):
            self.engine.validate_prompt(ids, f"prompt {i}")
            if part is not None:
                self.engine.check_partial(part, ids, p, f"prompt {i}")
        return self._iter(tokenized, params, use_tqdm, partials)

    def _check_logprobs(self, p: SamplingParams, what: str) -> None:
        cap = self.engine_args.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if cap >= 0 and k is not None and k > cap:
                raise ValueError(f"{what}: {name}={k} is above max_logprobs={cap} (raise it "
                                 "with LLM(max_logprobs=...))")

    def score(self, prompts, completions: list[list[int]],
              sampling_params: SamplingParams | list[SamplingParams] | None = None,
              logprobs: int | None = None, use_tqdm: bool = False) -> list[ScoreOutput]:
        """Teacher-forced logprobs of given completions: the trainer's replay of a rollout.

        For each prompt and completion (token ids, as ``CompletionOutput.token_ids``), one
        prefill of the prompt and all completion tokens but the last gives the logits before
        every completion token; each goes through generation's own pipeline (``min_tokens``
        mask, penalties, temperature / top-k / top-p / min-p with ``sampling_params``: the
        params the completion was sampled with). With batch invariance on (the default,
        ``kernels.set_batch_invariant``), the values equal bit for bit the logprobs
        ``generate`` returned for those tokens, with or without speculation, whatever the
        batch (``SamplingParams.prompt_logprobs`` is the same computation over the prompt).

        Args:
            prompts: as ``generate`` takes them (text, token ids or dicts), one per completion.
            completions: one list of token ids per prompt.
            sampling_params: the params the completions were sampled with (one for all or
                one per prompt; default ``SamplingParams()``); ``n``, ``seed``,
                ``max_tokens`` and ``logprobs`` are not used.
            logprobs: also return, per token, the top-``logprobs`` entries (the engine's
                ``logprobs_mode``), as ``CompletionOutput.logprobs``.

        Returns:
            One ``ScoreOutput`` per prompt, in order.

        Raises:
            ValueError: lengths that differ, a bad prompt or token id, a sequence of
                ``max_model_len`` tokens or more, ``logprobs`` above ``max_logprobs``;
                nothing is run then.
        """
        prompts, params = per_prompt(prompts, sampling_params)
        if self.engine.paused:
            raise RuntimeError("generation is paused: call resume_generation() first")
        if len(completions) != len(prompts):
            raise ValueError(f"got {len(completions)} completions for {len(prompts)} prompts")
        self.memory.check_ready()
        self._check_logprobs(SamplingParams(logprobs=logprobs), "score")
        tokenized = [self._to_token_ids(p, i) for i, p in enumerate(prompts)]
        specs = []
        for i, ((_, ids), comp, p) in enumerate(zip(tokenized, completions, params)):
            if not isinstance(comp, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in comp):
                raise ValueError(f"completions[{i}] must be a list of token ids")
            self.engine.validate_prompt(ids + list(comp)[:-1], f"prompt {i} + completion")
            specs.append(ScoreSpec(len(ids), list(comp), p, logprobs))
        greedy = SamplingParams(temperature=0, max_tokens=1)
        index = {}
        try:
            for i, ((_, ids), spec) in enumerate(zip(tokenized, specs)):
                if spec.completion:
                    rid = self.engine.add_request(ids + spec.completion[:-1], greedy,
                                                  score=spec)
                    index[rid] = i
            with tqdm(total=len(index), desc="score", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished():
                    bar.update(len(self.engine.step()))
        finally:
            self.engine.abort_all()
        return [ScoreOutput(ids, s.completion, s.raw or [], s.processed or [],
                            s.entries if logprobs is not None else None)
                for (_, ids), s in zip(tokenized, specs)]

    # ---- step by step, and samples moving between engines (specengine.lifecycle.migration) ------
    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one prompt (any form ``generate`` takes) without running it; ``step``
        advances it. Returns its request id (``request_id``, or a fresh one). Step such
        requests to their end before calling ``generate``, which steps (and at its end aborts)
        every unfinished request of the engine.

        Raises:
            ValueError: a bad prompt or params (as ``generate``), a ``request_id`` in use.
            RuntimeError: the engine is asleep.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.memory.check_ready()
        self._check_logprobs(params, "prompt")
        text, ids = self._to_token_ids(prompt, 0)
        return self.engine.add_request(ids, params, prompt=text, request_id=request_id,
                                       partial=self._partial_of(prompt, 0))

    def step(self) -> list[RequestOutput]:
        """One engine step (nothing when no request is unfinished); returns the requests that
        finished. A request split across engines by migration comes back in parts, one per
        engine, each with the samples that finished there (``migration.merge_outputs``)."""
        if not self.engine.has_unfinished():
            return []
        t0 = time.perf_counter()
        outs = self.engine.step()
        self._wall_time += time.perf_counter() - t0
        self.migration.observe(outs)
        return outs

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work (or finished requests to return)."""
        return self.engine.has_unfinished()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop an unfinished request (its KV blocks go back). Returns what it made so far
        (``Engine.abort_request``: samples cut short have ``finish_reason="abort"`` and their
        tokens, logprobs and weight versions until now), or None if unknown or finished."""
        return self.engine.abort_request(request_id)

    def pause_generation(self, mode: str = "keep") -> dict:
        """Stop generating until ``resume_generation`` (vLLM's and SGLang's pause modes):
        ``"abort"`` (partial outputs returned under ``"aborted"``), ``"keep"`` (running
        samples stay; weights may be updated meanwhile and they continue with the new
        version) or ``"retract"`` (their KV is released; they are re-prefilled on resume).
        ``step`` returns nothing while paused, and ``generate`` refuses to run. Returns the
        report of ``Engine.pause`` (``mode``, ``requests``, ``running``, ``retracted``,
        ``aborted``). Raises ValueError for an unknown mode."""
        return self.engine.pause(mode)

    def resume_generation(self) -> None:
        """Generate again after ``pause_generation`` (no-op when not paused)."""
        self.engine.resume()

    def is_paused(self) -> bool:
        """Whether ``pause_generation`` is in force."""
        return self.engine.paused is not None

    def running_sequences(self) -> list[SequenceInfo]:
        """Every unfinished sample with its predicted remaining work
        (``Migrator.running_sequences``)."""
        return self.migration.running_sequences()

    def export_prefix(self, request_id: str, index: int) -> KVChunk:
        """Migration stage one: a copy of sample ``index`` of ``request_id``'s full KV blocks;
        it keeps decoding here (``Migrator.export_prefix``). Raises ValueError: no such
        running sample."""
        return self.migration.export_prefix(request_id, index)

    def export_sequence(self, request_id: str, index: int, with_kv: bool = True
                        ) -> MigratedSequence:
        """Migration stage two: the sample leaves this engine with its state and the K/V
        written since stage one (``with_kv=False``: tokens only, re-prefilled at the
        destination); its blocks are released (``Migrator.export_sequence``). Raises
        ValueError: no such unfinished sample."""
        return self.migration.export_sequence(request_id, index, with_kv)

    def import_sequence(self, state: MigratedSequence, prefix: KVChunk | None = None) -> str:
        """Continue an exported sample here; ``"kv"`` or ``"reprefill"`` says how
        (``Migrator.import_sequence``). Raises ValueError (incompatible payload) or
        RuntimeError (no room)."""
        self.memory.check_ready()
        return self.migration.import_sequence(state, prefix)

    def prefill_seconds(self, num_tokens: int) -> float:
        """Predicted seconds of a prefill of ``num_tokens`` tokens on this engine (for
        ``MigrationCost.choose``)."""
        return self.migration.prefill_seconds(num_tokens)

    def _iter(self, tokenized, params: list[SamplingParams], use_tqdm: bool,
              partials: list[PartialSample | None] | None = None):
        t0 = time.perf_counter()
        index = {}
        partials = partials or [None] * len(tokenized)
        try:
            for i, ((text, tok), p, part) in enumerate(zip(tokenized, params, partials)):
                index[self.engine.add_request(tok, p, prompt=text, partial=part)] = i
            with tqdm(total=len(index), desc="generate", disable=not use_tqdm,
                      unit="req") as bar:
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        bar.update(1)
                        yield index[out.request_id], out
        finally:
            self.engine.abort_all()  # no-op after a normal finish; frees KV after an error
            self._wall_time += time.perf_counter() - t0


def _head_dtype(head_dtype, model_dtype: torch.dtype) -> torch.dtype | None:
    """``LLM``'s ``head_dtype`` -> torch.float32, or None for the model dtype.

    Raises ValueError for anything but None, ``"auto"``, float32 or the model dtype."""
    if head_dtype is None or head_dtype == "auto":
        return None
    names = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}
    dt = names.get(head_dtype) if isinstance(head_dtype, str) else head_dtype
    if dt == model_dtype:
        return None
    if dt != torch.float32:
        raise ValueError(f"head_dtype={head_dtype!r}: use 'float32' or 'auto' (the model "
                         f"dtype, {str(model_dtype)[6:]})")
    return torch.float32


def _vllm_dtype(dtype, model) -> str | torch.dtype:
    """vLLM's dtype names: ``"auto"`` -> the checkpoint's float16/bfloat16 (``torch_dtype`` in
    its config.json; bfloat16 for float32 or unknown), ``"half"`` -> float16, ``"float"`` ->
    float32; anything else unchanged (``parse_dtype`` checks it)."""
    if dtype == "auto":
        from specengine.models.loader import resolve_model

        hf = json.loads((resolve_model(model) / "config.json").read_text())
        return "float16" if hf.get("torch_dtype", hf.get("dtype")) == "float16" else "bfloat16"
    return {"half": "float16", "float": "float32"}.get(dtype, dtype) if isinstance(dtype, str) \
        else dtype
