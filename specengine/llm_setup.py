"""What ``LLM(...)`` builds from its arguments: the dtypes (vLLM's names, ``head_dtype``), the
device, the engine config with the KV cache's size in blocks (``engine_config``), and the
``Engine`` with its drafter and speculation policy (``build_engine``)."""

from __future__ import annotations

import json

import torch

from specengine.engine.config import EngineConfig, parse_dtype
from specengine.engine.engine import Engine
from specengine.kv import kv_bytes_per_block
from specengine.llm_args import EngineArgs
from specengine.ops.heap import tune_malloc
from specengine.speculative.config import SpeculativeConfig
from specengine.speculative.drafters import make_drafter
from specengine.speculative.policy import make_policy

DEFAULT_KV_BYTES = 1 << 30  # the KV cache's bytes when neither a size nor a fraction is given


def vllm_dtype(dtype, model) -> str | torch.dtype:
    """vLLM's dtype names: ``"auto"`` -> the checkpoint's float16/bfloat16 (``torch_dtype`` in
    its config.json; bfloat16 for float32 or unknown), ``"half"`` -> float16, ``"float"`` ->
    float32; anything else unchanged (``parse_dtype`` checks it)."""
    if dtype == "auto":
        from specengine.models.loader import resolve_model

        hf = json.loads((resolve_model(model) / "config.json").read_text())
        return "float16" if hf.get("torch_dtype", hf.get("dtype")) == "float16" else "bfloat16"
    return {"half": "float16", "float": "float32"}.get(dtype, dtype) if isinstance(dtype, str) \
        else dtype


def head_dtype_of(head_dtype, model_dtype: torch.dtype) -> torch.dtype | None:
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


def load_target(model: str, dtype, device: str, head_dtype, args: EngineArgs):
    """Load the target (``models.loader.load_model``) in ``dtype`` (vLLM's names too:
    ``vllm_dtype``) on ``device``, random weights with ``load_format="dummy"``, its LM head
    in ``head_dtype`` (``head_dtype_of``). Returns ``(LoadedModel, torch dtype)``.

    Raises:
        ValueError: an unknown alias or dtype, a bad ``head_dtype``. FileNotFoundError: a
            missing path.
    """
    from specengine.models.loader import load_model

    torch_dtype = parse_dtype(vllm_dtype(dtype, model))
    head = head_dtype_of(head_dtype, torch_dtype)
    loaded = load_model(model, dtype=torch_dtype, device=device,
                        dummy=args.load_format == "dummy")
    loaded.model.head_dtype = head
    return loaded, torch_dtype


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when available, else ``"cpu"``; anything else unchanged."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def kv_block_count(model_config, block_size: int, dtype: torch.dtype, device: str,
                   kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None,
                   max_num_seqs: int, max_model_len: int) -> int:
    """KV blocks of ``block_size`` tokens the cache gets: ``kv_cache_memory_bytes``; else on
    CUDA with ``gpu_memory_utilization`` what is left of that fraction of the device's
    memory; else ``DEFAULT_KV_BYTES``, but no more than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens need.

    Raises:
        ValueError: a budget smaller than one block (the message gives its bytes).
    """
    per_block = kv_bytes_per_block(model_config, block_size, dtype)
    if (kv_cache_memory_bytes is None and gpu_memory_utilization is not None
            and torch.device(device).type == "cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        kv_cache_memory_bytes = int(gpu_memory_utilization * total) - (total - free)
    kv_bytes = DEFAULT_KV_BYTES if kv_cache_memory_bytes is None else kv_cache_memory_bytes
    num_blocks = kv_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={kv_bytes} holds no KV block "
                         f"({per_block} bytes each)")
    if kv_cache_memory_bytes is None:  # no need for more than max_num_seqs full sequences
        num_blocks = min(num_blocks, max_num_seqs * -(-max_model_len // block_size))
    return num_blocks


def engine_config(model_config, args: EngineArgs, dtype: torch.dtype, device: str,
                  max_model_len: int | None, kv_cache_memory_bytes: int | None,
                  block_size: int, max_num_seqs: int, max_num_batched_tokens: int | None,
                  prefix_cache_policy: str) -> EngineConfig:
    """The ``EngineConfig`` of ``LLM``'s arguments (``max_model_len`` None: the model's
    ``max_position_embeddings``; ``max_num_batched_tokens`` None: ``max(4096,
    max_model_len)``; the KV blocks from ``kv_block_count``).

    Raises:
        ValueError: ``max_model_len`` outside [2, the model's limit]; a KV budget smaller
            than one block.
    """
    limit = model_config.max_position_embeddings
    if max_model_len is None:
        max_model_len = limit
    elif not 1 < max_model_len <= limit:
        raise ValueError(f"max_model_len={max_model_len} must be in [2, {limit}] "
                         f"(the model's max_position_embeddings)")
    num_blocks = kv_block_count(model_config, block_size, dtype, device, kv_cache_memory_bytes,
                                args.gpu_memory_utilization, max_num_seqs, max_model_len)
    return EngineConfig(
        max_model_len=max_model_len, block_size=block_size, num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max(4096, max_model_len),
        enable_prefix_caching=bool(args.enable_prefix_caching),
        prefix_cache_policy=prefix_cache_policy)


def build_engine(loaded, tokenizer, config: EngineConfig, spec: SpeculativeConfig | None,
                 seed: int, logprobs_mode: str, attention_backend: str) -> Engine:
    """The ``Engine`` of a loaded model (``models.loader.LoadedModel``), with the drafter and
    policy ``spec`` asks for (none when ``spec`` is empty); the policy is warm-started.
    ``tokenizer`` None (``skip_tokenizer_init``): the loaded tokenizer's EOS still ends
    samples."""
    if next(loaded.model.parameters()).device.type == "cpu":
        tune_malloc()  # large per-step buffers reused, not page-faulted in each step
    drafter = make_drafter(spec, loaded, config.num_kv_blocks, config.block_size) \
        if spec else None
    policy = make_policy(spec, seed, drafter) if drafter else None
    eos = None  # default: the model's and the tokenizer's
    if tokenizer is None and getattr(loaded.tokenizer, "eos_token_id", None) is not None:
        eos = {*loaded.config.eos_token_ids, loaded.tokenizer.eos_token_id}
    engine = Engine(loaded.model, tokenizer, config, seed=seed, logprobs_mode=logprobs_mode,
                    eos_token_ids=eos, drafter=drafter, policy=policy,
                    attention_backend=attention_backend)
    if policy is not None:
        policy.warm_start(engine)
    return engine
