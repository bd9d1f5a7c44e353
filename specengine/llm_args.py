"""The vLLM engine arguments RL frameworks pass to ``LLM(...)`` (verl, TRL, OpenRLHF build
``vllm.LLM`` with them), checked once: honoured where they mean something in a single-process
engine, accepted without effect where they only tune what specengine does not have (CUDA
graphs, custom all-reduce), and refused with a ValueError that says why where they ask for
something it cannot do (tensor parallelism, quantized kernels, worker extensions).

``parse_engine_args(kwargs)`` returns an ``EngineArgs``. ``LLM`` takes them keyword only:

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
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineArgs:
    """Checked engine arguments (defaults as vLLM's where they exist; each is described in the
    module docstring)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    enable_sleep_mode: bool = False
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    trust_remote_code: bool = False
    load_format: str = "auto"
    distributed_executor_backend: str | None = None
    max_logprobs: int = 20
    worker_extension_cls: str | None = None
    quantization: str | None = None
    model_impl: str = "auto"
    skip_tokenizer_init: bool = False
    kv_cache_dtype: str = "auto"
    enable_chunked_prefill: bool | None = None
    disable_log_stats: bool = True
    disable_custom_all_reduce: bool = False
    swap_space: float = 4
    cpu_offload_gb: float = 0
    enable_lora: bool = False
    max_seq_len_to_capture: int | None = None
    revision: str | None = None
    offload_dir: str | None = None


NAMES = tuple(f.name for f in dataclasses.fields(EngineArgs))
LOAD_FORMATS = ("auto", "safetensors", "dummy")
BACKENDS = (None, "uni", "external_launcher")
MODEL_IMPLS = ("auto", "vllm")


def _fail(name: str, value, why: str):
    raise ValueError(f"LLM({name}={value!r}): {why}")


def _int(name, value, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        _fail(name, value, f"must be an int >= {lo}")


def _bool(name, value) -> None:
    if not isinstance(value, bool):
        _fail(name, value, "must be True or False")


def _number(name, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        _fail(name, value, "must be a number >= 0")


def parse_engine_args(kwargs: dict) -> EngineArgs:
    """Check the vLLM-style keyword arguments given to ``LLM``.

    Raises:
        ValueError: an unknown keyword (the message lists the accepted ones), a value of the
            wrong type, or a setting this engine cannot honour (the message says why).
    """
    unknown = sorted(set(kwargs) - set(NAMES))
    if unknown:
        raise ValueError(f"LLM() got unknown keyword arguments {unknown}; accepted: the LLM "
                         f"parameters (model, dtype, max_model_len, kv_cache_memory_bytes, "
                         f"seed, block_size, max_num_seqs, max_num_batched_tokens, "
                         f"logprobs_mode, speculative_config, device, attention_backend) and "
                         f"{list(NAMES)}")
    a = EngineArgs(**kwargs)
    _check_sizes_and_flags(a)
    _check_features(a)
    _check_offload_and_revision(a)
    return a


def _check_sizes_and_flags(a: EngineArgs) -> None:
    """Parallel sizes (1 only), ``gpu_memory_utilization`` and the boolean flags."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        v = getattr(a, name)
        _int(name, v, 1)
        if v > 1:
            _fail(name, v, "specengine runs the whole model in one process on one device; "
                  "only 1 is supported (for data parallelism run one LLM per device)")
    u = a.gpu_memory_utilization
    if u is not None and (not isinstance(u, (int, float)) or isinstance(u, bool)
                          or not 0 < u <= 1):
        _fail("gpu_memory_utilization", u, "must be a fraction in (0, 1]")
    for name in ("enable_sleep_mode", "enable_prefix_caching", "enforce_eager",
                 "trust_remote_code", "skip_tokenizer_init", "disable_log_stats",
                 "disable_custom_all_reduce", "enable_lora"):
        _bool(name, getattr(a, name))
    if a.enable_chunked_prefill is not None:
        _bool("enable_chunked_prefill", a.enable_chunked_prefill)


def _check_features(a: EngineArgs) -> None:
    """What the engine cannot do: LoRA, other load formats, executors, worker extensions,
    quantization, model implementations or KV cache dtypes; and ``max_logprobs``."""
    if a.enable_lora:
        _fail("enable_lora", True, "LoRA adapters are not supported; merge the adapter and "
              "push the merged weights with update_weights")
    if a.load_format not in LOAD_FORMATS:
        _fail("load_format", a.load_format, f"use one of {list(LOAD_FORMATS)} (checkpoints "
              "are safetensors; GGUF files are converted by path)")
    if a.distributed_executor_backend not in BACKENDS:
        _fail("distributed_executor_backend", a.distributed_executor_backend,
              f"specengine runs in the calling process; use one of {list(BACKENDS)} (a Ray or "
              "multiprocessing executor is not available)")
    _int("max_logprobs", a.max_logprobs, -1)
    if a.worker_extension_cls not in (None, ""):
        _fail("worker_extension_cls", a.worker_extension_cls,
              "specengine has no worker processes to extend; sync weights with "
              "LLM.update_weights / begin_weight_update + load_weights + finish_weight_update")
    if a.quantization not in (None, "None"):
        _fail("quantization", a.quantization, "quantized kernels are not supported (GGUF "
              "checkpoints are dequantized at load); use None")
    if a.model_impl not in MODEL_IMPLS:
        _fail("model_impl", a.model_impl, f"use one of {list(MODEL_IMPLS)} (specengine's own "
              "decoder runs the model; transformers' model code is never run)")
    if a.kv_cache_dtype != "auto":
        _fail("kv_cache_dtype", a.kv_cache_dtype, "the KV cache is kept in the model dtype; "
              "use 'auto'")


def _check_offload_and_revision(a: EngineArgs) -> None:
    """``swap_space``, ``cpu_offload_gb`` (0 only), ``max_seq_len_to_capture``, ``revision``
    (None only) and ``offload_dir`` (an existing directory)."""
    _number("swap_space", a.swap_space)
    _number("cpu_offload_gb", a.cpu_offload_gb)
    if a.cpu_offload_gb:
        _fail("cpu_offload_gb", a.cpu_offload_gb, "weight offloading during generation is not "
              "supported; use 0 (sleep(level=1) offloads weights between rollouts)")
    if a.max_seq_len_to_capture is not None:
        _int("max_seq_len_to_capture", a.max_seq_len_to_capture, 1)
    if a.revision is not None:
        _fail("revision", a.revision, "models are local directories, GGUF files or pinned "
              "aliases; there is no revision to choose")
    if a.offload_dir is not None and not os.path.isdir(a.offload_dir):
        _fail("offload_dir", a.offload_dir, "not an existing directory")
