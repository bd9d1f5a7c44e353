"""``RolloutSettings``: what ``SpecEngineRollout`` (``integrations/verl.py``) reads from verl's
rollout ``config`` and ``model_config``: the ``LLM`` it builds, the adapter's own settings
(``sleep_level``, bucket size, ``free_cache_engine``) and the sampling defaults of a request
(``sampling_params``). The keys are listed in ``integrations/verl.py``'s module docstring.
"""

from __future__ import annotations

from collections.abc import Mapping

_DEFAULTS = {"prompt_length": 512, "response_length": 512, "dtype": "bfloat16",
             "max_num_seqs": 1024, "seed": 0, "logprobs_mode": "processed_logprobs",
             "free_cache_engine": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
             "repetition_penalty": 1.0, "ignore_eos": False, "full_determinism": False}
_ENGINE_ARGS = {  # verl config key -> LLM keyword
    "enable_prefix_caching": "enable_prefix_caching",
    "gpu_memory_utilization": "gpu_memory_utilization", "load_format": "load_format",
    "enable_sleep_mode": "enable_sleep_mode", "enforce_eager": "enforce_eager",
    "skip_tokenizer_init": "skip_tokenizer_init",
    "tensor_model_parallel_size": "tensor_parallel_size",
    "data_parallel_size": "data_parallel_size",
    "pipeline_model_parallel_size": "pipeline_parallel_size",
    "max_num_batched_tokens": "max_num_batched_tokens"}


def cfg_get(obj, path: str, default=None):
    """``obj.a.b`` for ``path="a.b"`` over dataclasses, attribute objects, dicts and OmegaConf
    configs; ``default`` where a key is missing or None."""
    for key in path.split("."):
        if obj is None:
            return default
        obj = obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)
    return default if obj is None else obj


class RolloutSettings:
    """verl's configs, read once.

    Args:
        config: verl's rollout config (``RolloutConfig``, ``DictConfig`` or dict).
        model_config: verl's model config (``local_path`` / ``path``, ``trust_remote_code``).
        replica_rank: this replica's rank (the request seed under ``full_determinism``).

    Attributes:
        sleep_level: level of ``release()`` / ``sleep()`` (1 or 2).
        extra: ``engine_kwargs.specengine`` without ``sleep_level``: more ``LLM`` arguments.
        prompt_length, response_length: verl's lengths (tokens).
        free_cache_engine: False makes ``resume`` / ``release`` / ``sleep`` no-ops.
        bucket_bytes: ``update_weights`` bucket size in bytes.

    Raises:
        ValueError: ``sleep_level`` not 1 or 2; MTP rollout asked for.
    """

    def __init__(self, config, model_config=None, replica_rank: int = 0):
        self.config, self.model_config, self.replica_rank = config, model_config, replica_rank
        self.extra = dict(cfg_get(config, "engine_kwargs.specengine", {}) or {})
        self.sleep_level = self.extra.pop("sleep_level", 2)
        if self.sleep_level not in (1, 2):
            raise ValueError(f"engine_kwargs.specengine.sleep_level={self.sleep_level!r} must "
                             "be 1 or 2")
        if cfg_get(config, "mtp.enable", False) and cfg_get(config, "mtp.enable_rollout", False):
            raise ValueError("mtp.enable_rollout: MTP drafters are not supported by specengine;"
                             " set engine_kwargs.specengine.speculative_config (ngram, "
                             "draft_model, eagle) instead")
        self.prompt_length = self.get("prompt_length")
        self.response_length = self.get("response_length")
        self.free_cache_engine = bool(self.get("free_cache_engine"))
        self.bucket_bytes = int(cfg_get(
            config, "checkpoint_engine.update_weights_bucket_megabytes", 2048)) << 20

    def get(self, key: str):
        """The rollout config's ``key``, or verl's default for it."""
        return cfg_get(self.config, key, _DEFAULTS.get(key))

    def build_llm(self):
        """The ``LLM`` the configs describe.

        Raises:
            ValueError: no model path; an ``LLM`` argument refused (e.g.
                ``tensor_model_parallel_size`` > 1).
        """
        from specengine import LLM

        path = cfg_get(self.model_config, "local_path") or cfg_get(self.model_config, "path")
        if path is None:
            raise ValueError("model_config has no local_path or path (and no llm= was given)")
        c = self.get
        kwargs = {k2: cfg_get(self.config, k) for k, k2 in _ENGINE_ARGS.items()
                  if cfg_get(self.config, k) is not None}
        if cfg_get(self.model_config, "trust_remote_code") is not None:
            kwargs["trust_remote_code"] = cfg_get(self.model_config, "trust_remote_code")
        max_len = cfg_get(self.config, "max_model_len") or (self.prompt_length
                                                             + self.response_length)
        return LLM(str(path), dtype=c("dtype"), max_model_len=max_len,
                   max_num_seqs=c("max_num_seqs"), seed=c("seed"),
                   logprobs_mode=c("logprobs_mode"), **kwargs, **self.extra)

    def sampling_params(self, n_prompt: int, sp: dict, max_model_len: int):
        """verl's request dict ``sp`` (consumed) -> ``(SamplingParams, logprobs wanted)``, as
        verl's vLLM server builds them: ``max_tokens`` / ``max_new_tokens`` (default
        ``min(response_length, prompt_length + response_length - n_prompt)``) clamped to
        ``[1, max_model_len - n_prompt]``, ``logprobs: bool`` -> the sampled token's only.

        Raises:
            ValueError: no room for one token after the prompt; a bad sampling value.
        """
        from specengine.server.protocol import APIError, make_sampling_params

        room = max_model_len - n_prompt
        if room < 1:
            raise ValueError(f"the prompt has {n_prompt} tokens: no room to generate within "
                             f"max_model_len={max_model_len}")
        max_tokens = sp.pop("max_tokens", None)
        alt = sp.pop("max_new_tokens", None)
        if max_tokens is None:
            max_tokens = alt
        if max_tokens is None:
            max_tokens = min(self.response_length,
                             self.prompt_length + self.response_length - n_prompt)
        want = bool(sp.pop("logprobs", False))
        for key in ("temperature", "top_p", "top_k", "repetition_penalty", "ignore_eos"):
            sp.setdefault(key, self.get(key))
        if self.get("full_determinism"):
            sp.setdefault("seed", self.replica_rank + self.get("seed"))
        sp["max_tokens"] = max(1, min(int(max_tokens), room))
        sp["logprobs"] = 0 if want else None
        try:
            return make_sampling_params(sp), want
        except APIError as e:
            raise ValueError(f"sampling_params: {e}") from None
