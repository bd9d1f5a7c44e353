"""``LLM``: the offline generation API, with vLLM's names so RL frameworks switch with few edits."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch
from tqdm.auto import tqdm

from specengine.config import EngineConfig, parse_dtype
from specengine.engine import Engine
from specengine.kv import kv_bytes_per_block
from specengine.models.registry import DEFAULT_MODEL
from specengine.outputs import RequestOutput
from specengine.sampling import SamplingParams
from specengine.speculative.config import SpeculativeConfig
from specengine.speculative.drafters import make_drafter
from specengine.speculative.drafters.eagle import EagleDrafter
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
        speculative_config: e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``; see
            ``specengine.speculative.config.SpeculativeConfig``. Outputs are unchanged by it: greedy
            output is identical, sampled output has the same distribution.
        enable_prefix_caching: reuse the KV of full blocks already computed for the same leading
            tokens (vLLM's automatic prefix caching; outputs are unchanged by it).

    Raises:
        ValueError: unknown alias or dtype, ``max_model_len`` above the model's limit, a KV
            budget smaller than one block. FileNotFoundError: a missing path.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str | torch.dtype = "bfloat16",
                 max_model_len: int | None = None, kv_cache_memory_bytes: int | None = None,
                 seed: int = 0, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None,
                 logprobs_mode: str = "raw_logprobs", speculative_config: dict | None = None,
                 device: str = "auto", attention_backend: str = "auto",
                 enable_prefix_caching: bool = True):
        from specengine.models.loader import load_model

        torch_dtype = parse_dtype(dtype)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        loaded = load_model(model, dtype=torch_dtype, device=device)
        self.model_name = model
        self.model_dir = loaded.model_dir
        self.tokenizer = loaded.tokenizer
        cfg = loaded.config
        limit = cfg.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        elif not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len} must be in [2, {limit}] "
                             f"(the model's max_position_embeddings)")
        per_block = kv_bytes_per_block(cfg, block_size, torch_dtype)
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
            enable_prefix_caching=bool(enable_prefix_caching))
        self.speculative_config = SpeculativeConfig.from_dict(speculative_config)
        drafter = make_drafter(self.speculative_config, loaded, num_blocks, block_size) \
            if self.speculative_config else None
        policy = make_policy(self.speculative_config, seed) if drafter else None
        self.engine = Engine(loaded.model, self.tokenizer, self.engine_config, seed=seed,
                             logprobs_mode=logprobs_mode, drafter=drafter, policy=policy,
                             attention_backend=attention_backend)
        if policy is not None:
            policy.warm_start(self.engine)
        self._wall_time = 0.0

    def get_tokenizer(self):
        """The transformers tokenizer of the model (None for a model without one)."""
        return self.tokenizer

    def get_metrics(self) -> dict:
        """Engine counters since start: requests, prompt/generated tokens, steps, prefill and
        decode time (seconds), preemptions, KV blocks (total and free), wall time in
        ``generate`` (seconds); with speculation, the policy's ``stats()`` (strategies run,
        steps, predicted and observed tokens/s, decision time); with an EAGLE drafter (also
        inside a ``Harvester``), ``drafter_version`` and ``tau_per_version`` (version -> tokens
        committed per verify step, see ``EagleDrafter.stats``); prefix caching:
        ``prefix_cache_hit_rate`` (hit / queried prompt tokens), ``prefix_cache_hit_tokens``,
        ``prefix_cache_queried_tokens``, ``prefix_cache_blocks`` (cached now; those nobody uses
        count in ``kv_blocks_free``, they are evicted on demand)."""
        d = self.engine.metrics.as_dict()
        d.update(kv_blocks_total=self.engine.blocks.num_blocks,
                 kv_blocks_free=self.engine.blocks.num_free, generate_time=self._wall_time)
        d.update(self.engine.blocks.prefix_cache_stats())
        drafter = self.engine.drafter
        if drafter is not None:
            d.update(self.engine.policy.stats())
        if isinstance(drafter, Harvester):
            drafter = drafter.inner
        if isinstance(drafter, EagleDrafter):
            d.update(drafter.stats())
        return d

    def update_weights(self, weights: Mapping[str, torch.Tensor]
                       | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Overwrite some or all of the target's weights in place, between ``generate`` calls:
        a trainer pushing a new policy (SGLang's ``update_weights_from_tensor``, vLLM's weight
        sync). Later steps use the new weights: the kernels' packed copies are rebuilt and the
        prefix cache is cleared.

        An EAGLE drafter shares the target's embedding, final norm and LM head tensors, so
        those follow automatically; its own layer does not (it is now stale: train it online,
        ``DrafterTrainer`` in ``speculative.training``). A ``draft_model`` drafter is a
        separate model and is not changed.

        Args:
            weights: ``(name, tensor)`` pairs or a dict, with Hugging Face parameter names (as
                a transformers model's ``named_parameters()`` / ``state_dict()`` and
                ``LlamaForCausalLM.load_weights`` have them), any subset (e.g. some layers).
                Tensors are cast to the engine's dtype and copied to its device.

        Returns:
            the names copied (``rotary_emb.inv_freq`` and a tied ``lm_head.weight`` are
            skipped, as in ``load_weights``).

        Raises:
            ValueError: an unknown name or a shape that differs, naming the parameter.
            TypeError: an entry that is not a tensor.
            RuntimeError: requests are in flight (a ``generate_iter`` not run to its end).
            Nothing is changed when any of these is raised: all entries are checked first.
        """
        if self.engine.has_unfinished():
            raise RuntimeError("update_weights: requests are in flight; finish or abort them "
                               "first (between generate calls)")
        if isinstance(weights, Mapping):
            weights = weights.items()
        names = self.engine.runner.model.update_weights(weights)
        self.reset_prefix_cache()  # cached KV was computed with the old weights
        return names

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's ``LLM.reset_prefix_cache``; RL trainers call
        it after a weight push, ``update_weights`` does it itself). Returns False, changing
        nothing, while requests are in flight (a ``generate_iter`` not run to its end); else
        True."""
        return self.engine.reset_prefix_cache()

    def _to_token_ids(self, prompt, i: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text but the model has no tokenizer")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
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

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for ``prompts``; results come back in input order.

        Args:
            prompts: a string, a list of token ids, a dict ``{"prompt_token_ids": [...]}`` or
                ``{"prompt": "..."}``, or a list of these.
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
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts
                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        tokenized = [self._to_token_ids(p, i) for i, p in enumerate(prompts)]
        for i, (_, ids) in enumerate(tokenized):
            self.engine.validate_prompt(ids, f"prompt {i}")
        return self._iter(tokenized, params, use_tqdm)

    def _iter(self, tokenized, params: list[SamplingParams], use_tqdm: bool):
        t0 = time.perf_counter()
        index = {}
        try:
            for i, ((text, tok), p) in enumerate(zip(tokenized, params)):
                index[self.engine.add_request(tok, p, prompt=text)] = i
            with tqdm(total=len(index), desc="generate", disable=not use_tqdm,
                      unit="req") as bar:
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        bar.update(1)
                        yield index[out.request_id], out
        finally:
            self.engine.abort_all()  # no-op after a normal finish; frees KV after an error
            self._wall_time += time.perf_counter() - t0
