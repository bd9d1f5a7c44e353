"""``LLM``: the offline generation API, with vLLM's names so RL frameworks switch with few edits."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping

import torch

from specengine.engine.outputs import RequestOutput, ScoreOutput
from specengine.engine.sequence import PartialSample
from specengine.generation import run_requests
from specengine.lifecycle.memory import MemoryManager
from specengine.lifecycle.migration import KVChunk, MigratedSequence, Migrator, SequenceInfo
from specengine.lifecycle.weights import WeightUpdater
from specengine.llm_args import parse_engine_args
from specengine.llm_metrics import llm_metrics
from specengine.llm_setup import build_engine, engine_config, load_target, resolve_device
from specengine.models.registry import DEFAULT_MODEL
from specengine.prompts import (
    chat_prompts,
    check_logprobs,
    encode_chat,
    partial_of,
    prepare_prompts,
    to_token_ids,
)
from specengine.replay.trace import RolloutTrace
from specengine.sampling.params import SamplingParams, per_prompt
from specengine.scoring import score_completions
from specengine.speculative.config import SpeculativeConfig
from specengine.tracing import start_recording, stop_recording


class LLM:
    """A model plus an engine, for batched offline generation.

    Args:
        model: a known alias (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``,
            ``qwen2.5-coder-1.5b-instruct``), a Hugging Face directory, or a ``.gguf`` file.
        dtype: ``"bfloat16"`` or ``"float32"`` (weights, activations and KV cache); vLLM's
            ``"auto"`` (the checkpoint's float16/bfloat16), ``"half"``, ``"float"`` too.
        max_model_len: longest prompt + output in tokens (default: the model's
            ``max_position_embeddings``).
        kv_cache_memory_bytes: bytes for the paged KV cache (default 1 GiB).
        seed: seeds requests that carry no seed of their own.
        block_size: tokens per KV block. max_num_seqs: most sequences decoded in one step.
        max_num_batched_tokens: most tokens in one forward (default ``max(4096, max_model_len)``).
        logprobs_mode: ``"raw_logprobs"`` (before temperature and filtering, vLLM's default) or
            ``"processed_logprobs"`` (of the distribution sampled from).
        device: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``.
        attention_backend: ``"auto"``, ``"cpu"`` (C++), ``"cuda"``, ``"triton"`` or ``"torch"``.
        head_dtype: ``"float32"``: logits of a bfloat16 model from a float32 copy of the LM
            head over float32 hidden states (vLLM's ``head_dtype``); None / ``"auto"``: the
            model dtype.
        prefix_cache_policy: after a weight update, ``"reset"`` (forget the prefix cache,
            the default) or ``"keep_versioned"`` (keep it; a cached block is found only by
            requests of the weight version that computed it).
        speculative_config: e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``
            (``speculative.config.SpeculativeConfig``). Outputs are unchanged by it: greedy
            output is identical, sampled output has the same distribution.
        engine_args: vLLM's engine arguments (what verl, TRL and OpenRLHF pass), keyword
            only: honoured, accepted with nothing to do, or refused, each as
            ``specengine.llm_args`` documents.

    Raises:
        ValueError: unknown alias or dtype, ``max_model_len`` above the model's limit, a KV
            budget smaller than one block, an engine argument refused.
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
        args = self.engine_args = parse_engine_args(engine_args)
        self.enable_prefix_caching = args.enable_prefix_caching
        device = resolve_device(device)
        loaded, torch_dtype = load_target(model, dtype, device, head_dtype, args)
        self.head_dtype = loaded.model.head_dtype or torch_dtype
        self.model_name = model
        self.model_dir = loaded.model_dir
        self.tokenizer = None if args.skip_tokenizer_init else loaded.tokenizer
        self.engine_config = engine_config(
            loaded.config, args, torch_dtype, device, max_model_len, kv_cache_memory_bytes,
            block_size, max_num_seqs, max_num_batched_tokens, prefix_cache_policy)
        self.speculative_config = SpeculativeConfig.from_dict(speculative_config)
        self.engine = build_engine(loaded, self.tokenizer, self.engine_config,
                                   self.speculative_config, seed, logprobs_mode,
                                   attention_backend)
        self._wall_time = 0.0
        self.memory = MemoryManager(self.engine, args.offload_dir)
        self.engine.ready_check = self.memory.check_ready
        self.weights = WeightUpdater(self.engine, self.memory)
        self.migration = Migrator(self.engine)

    def get_tokenizer(self):
        """The transformers tokenizer of the model (None for a model without one)."""
        return self.tokenizer

    def get_metrics(self) -> dict:
        """Engine counters since start (requests, tokens, steps, times, KV blocks, weight
        version and updates, sleep level, prefix cache, migration, kernel threads) and, with
        speculation, the policy's, the drafter's and each draft source's statistics: every
        key is listed in ``specengine.llm_metrics.llm_metrics``."""
        return llm_metrics(self.engine, self.weights, self.memory, self._wall_time)

    # ---- rollout traces (specengine.replay.trace) -----------------------------------------------
    def start_trace(self) -> None:
        """Start recording a rollout trace: per step the sequences decoded, tokens in the
        forward, draft nodes, accepted and committed tokens, the strategy and the step's
        seconds (``specengine.replay.trace``). Raises RuntimeError: one is being recorded."""
        self._trace_preemptions = start_recording(self.engine, self.model_name)

    def stop_trace(self) -> RolloutTrace:
        """Stop recording; returns the ``RolloutTrace`` (``save(path)`` writes it). Raises
        RuntimeError: no trace is being recorded."""
        return stop_recording(self.engine, self._trace_preemptions)

    # ---- weight sync (specengine.lifecycle.weights: the checks, all-or-nothing apply) ----------
    @property
    def weight_version(self) -> int:
        """Version of the target's weights: 0 as loaded, +1 per applied update (or the version
        given to ``finish_weight_update``); stamped on every ``RequestOutput``."""
        return self.engine.weight_version

    def update_weights(self, weights: Mapping[str, torch.Tensor]
                       | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Overwrite some or all of the target's weights (HF names, fused ``qkv_proj`` /
        ``gate_up_proj`` too; any floating dtype and device; unchanged until the call returns)
        in one call between ``generate`` calls (``WeightUpdater.update``; SGLang's
        ``update_weights_from_tensor``). An EAGLE drafter's own layer goes stale
        (``DrafterTrainer``). Returns the names applied. Raises ValueError / TypeError (a
        tensor refused) or RuntimeError (requests in flight, a session open): nothing changed.
        """
        return self.weights.update(weights)

    def begin_weight_update(self) -> None:
        """Open a streamed update: ``load_weights(chunk)`` ..., then ``finish_weight_update()``
        (applies all at once) or ``abort_weight_update()``; the old weights serve until then.
        Raises RuntimeError: a session is open already."""
        self.weights.begin()

    def load_weights(self, weights) -> list[str]:
        """Stage one chunk (a ``(name, tensor)`` pair, a dict or pairs; copied now,
        ``WeightUpdater.load``) into the open session, or a checkpoint path (safetensors,
        ``load_checkpoint``; applied at once with no session open). Returns the names staged.
        Raises RuntimeError (a chunk with no session), ValueError / TypeError (the session is
        aborted, nothing of it applied), FileNotFoundError (no checkpoint there)."""
        if isinstance(weights, (str, os.PathLike)):
            return self.weights.load_checkpoint(weights)
        return self.weights.load(weights)

    def finish_weight_update(self, weight_version: int | None = None) -> list[str]:
        """Apply the open session at once (``WeightUpdater.finish``: packed copies rebuilt once,
        prefix cache reset, ``weight_version`` set or + 1). Returns the names applied.
        Raises RuntimeError: no session, or requests in flight (it stays open); ValueError:
        ``weight_version`` not an int >= 0."""
        return self.weights.finish(weight_version)

    def abort_weight_update(self) -> bool:
        """Drop the open session; nothing is applied. Returns whether one was open."""
        return self.weights.abort()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's ``LLM.reset_prefix_cache``), also with requests
        in flight: their later blocks are never found by requests admitted after it. Returns
        True."""
        return self.engine.reset_prefix_cache()

    # ---- memory lifecycle (specengine.lifecycle.memory) ----------------------------------------
    def sleep(self, level: int = 1) -> dict[str, int]:
        """Give memory back between rollouts (``MemoryManager.sleep``): release the KV caches
        and move the target's weights out until ``wake_up`` (level 1) or discard them (level
        2: load new weights before generating). Returns bytes released (``weights``,
        ``packed``, ``kv_cache``, ``total``). Raises ValueError (``level`` not 1 or 2),
        RuntimeError (requests in flight)."""
        return self.memory.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released: ``tags`` None (all) or some of ``"weights"``,
        ``"kv_cache"``, ``"cuda_graph"`` (``MemoryManager.wake_up``; idempotent; after level 2,
        weights are re-allocated only). Raises ValueError: an unknown tag."""
        self.memory.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while the KV cache or the target's weights are released."""
        return self.memory.is_sleeping

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for ``prompts``; results come back in input order.

        Args:
            prompts: a string, a list of token ids, a dict ``{"prompt_token_ids": [...]}`` or
                ``{"prompt": "..."}``, or a list of these. A dict may carry ``"partial"``, a
                sample cut short to continue (``continuation_prompts``; ``prompts.partial_of``).
            sampling_params: one for all prompts, or one per prompt (default
                ``SamplingParams()``). use_tqdm: show a progress bar.

        Raises:
            ValueError: a bad prompt (empty, too long, wrong type) or a params list of the
                wrong length; nothing is generated then.
        """
        done = dict(self.generate_iter(prompts, sampling_params, use_tqdm))
        return [done[i] for i in range(len(done))]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to ``messages``, one conversation (a list of ``{"role",
        "content"}`` dicts) or a list of them, through the tokenizer's chat template. Raises
        ValueError: no tokenizer or chat template, a malformed conversation."""
        prompts = chat_prompts(self.tokenizer, self.model_name, messages,
                               add_generation_prompt, chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, conv: list[dict], what: str = "conversation",
                    add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """Apply the chat template to one conversation; returns (text, token ids). Raises
        ValueError naming ``what`` if ``conv`` is not a non-empty list of role/content dicts."""
        return encode_chat(self.tokenizer, conv, what, add_generation_prompt,
                           chat_template_kwargs)

    def generate_iter(self, prompts, sampling_params: SamplingParams | list[SamplingParams]
                      | None = None, use_tqdm: bool = True):
        """Like ``generate``, but yields ``(prompt_index, RequestOutput)`` as each request
        finishes (so a batch job can save results as it goes). Validation happens first."""
        prompts, params = per_prompt(prompts, sampling_params)
        self.memory.check_ready()
        if self.engine.paused:
            raise RuntimeError(f"generation is paused ({self.engine.paused!r}): call "
                               "resume_generation() first")
        tokenized, partials = prepare_prompts(self.engine, prompts, params, self.tokenizer,
                                              self.engine_args.max_logprobs)
        return self._iter(tokenized, params, use_tqdm, partials)

    def score(self, prompts, completions: list[list[int]],
              sampling_params: SamplingParams | list[SamplingParams] | None = None,
              logprobs: int | None = None, use_tqdm: bool = False) -> list[ScoreOutput]:
        """Teacher-forced logprobs of ``completions`` (token ids, one list per prompt; prompts
        as ``generate`` takes them), the trainer's replay of a rollout: equal bit for bit to
        the logprobs ``generate`` returned with batch invariance on (``specengine.scoring``).
        ``sampling_params``: those the completions were sampled with (``n``, ``seed``,
        ``max_tokens``, ``logprobs`` unused); ``logprobs``: also the top-k entries per token.
        Returns one ``ScoreOutput`` per prompt, in order.

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
        return score_completions(self.engine, self.tokenizer, self.engine_args.max_logprobs,
                                 prompts, completions, params, logprobs, use_tqdm)

    # ---- step by step, and samples moving between engines (specengine.lifecycle.migration) ------
    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one prompt (any form ``generate`` takes) for ``step``; returns its request id
        (``request_id``, or a fresh one). Step it to its end before calling ``generate``
        (which steps, and at its end aborts, every unfinished request). Raises ValueError: a
        bad prompt or params, a ``request_id`` in use; RuntimeError: the engine is asleep."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.memory.check_ready()
        check_logprobs(params, self.engine_args.max_logprobs, "prompt")
        text, ids = to_token_ids(prompt, 0, self.tokenizer)
        return self.engine.add_request(ids, params, prompt=text, request_id=request_id,
                                       partial=partial_of(prompt, 0))

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
        """Stop an unfinished request (its KV blocks go back); returns what it made so far
        (``finish_reason="abort"``; ``Engine.abort_request``), or None if unknown or done."""
        return self.engine.abort_request(request_id)

    def pause_generation(self, mode: str = "keep") -> dict:
        """Stop generating until ``resume_generation`` (``Engine.pause``; vLLM's and SGLang's
        modes): ``"abort"`` (partial outputs under ``"aborted"``), ``"keep"`` (running samples
        stay, also across a weight update) or ``"retract"`` (their KV released, re-prefilled
        on resume). Returns its report; ValueError for an unknown mode."""
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
        """Migration stage one: a copy of sample ``index``'s full KV blocks; it keeps decoding
        here (``Migrator.export_prefix``). Raises ValueError: no such running sample."""
        return self.migration.export_prefix(request_id, index)

    def export_sequence(self, request_id: str, index: int, with_kv: bool = True
                        ) -> MigratedSequence:
        """Migration stage two: the sample leaves with its state and the K/V since stage one
        (``with_kv=False``: tokens only, re-prefilled there; ``Migrator.export_sequence``).
        Raises ValueError: no such unfinished sample."""
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
              partials: list[PartialSample | None]):
        t0 = time.perf_counter()
        try:
            yield from run_requests(self.engine, tokenized, params, use_tqdm, partials)
        finally:
            self._wall_time += time.perf_counter() - t0
