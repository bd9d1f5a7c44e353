"""Convert a llama.cpp GGUF file into a Hugging Face model directory (float32 safetensors).

GGUF (llama.cpp's format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) stores
metadata key/values and (often quantized) tensors under llama.cpp names. We read it with the
``gguf`` package, dequantize every tensor to float32 (exact: the values users of the file get),
rename to HF names and undo llama.cpp's Q/K row permutation (llama arch only; llama.cpp's
converter interleaves the two RoPE halves of each head, HF keeps them as halves).
The result is written once as ``config.json``, ``generation_config.json``,
``model.safetensors`` and tokenizer files, so later loads are fast and transformers can read
the same directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

SUPPORTED_GGUF_ARCHS = {"llama": ("LlamaForCausalLM", "llama"),
                        "qwen2": ("Qwen2ForCausalLM", "qwen2")}

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` over ``path``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a readable GGUF file (bad magic, truncated, ...).
    """
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises many kinds of errors on bad files
        raise ValueError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_hf_config(reader) -> dict:
    """HF ``config.json`` dict built from the GGUF metadata of a llama or qwen2 model.

    Raises:
        ValueError: the architecture is not supported, a required key is missing, or the
            file asks for RoPE scaling.
    """
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHS)}")

    def need(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF metadata key {arch}.{key!r} is missing")
        return v

    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hf_arch, model_type = SUPPORTED_GGUF_ARCHS[arch]
    cfg = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(embd.shape[1]),  # GGUF shapes are innermost-first
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        # stored as float32: round back to the decimal the model was published with
        "rms_norm_eps": float(f'{need("attention.layer_norm_rms_epsilon"):.7g}'),
        "rope_theta": float(f'{_field(reader, f"{arch}.rope.freq_base", 10000.0):.7g}'),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["attention_bias"] = False
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        v = _field(reader, f"tokenizer.ggml.{name}")
        if v is not None:
            cfg[key] = int(v)
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: rows of each head go from interleaved RoPE pairs
    ``(x0, y0, x1, y1, ...)`` back to halves ``(x0, x1, ..., y0, y1, ...)``."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_state_dict(reader, config: dict) -> dict[str, torch.Tensor]:
    """All tensors of the GGUF file dequantized to float32, under HF names.

    Raises:
        ValueError: an unknown tensor name, or a quantization type ``gguf`` cannot dequantize.
    """
    from gguf.quants import dequantize

    # llama.cpp permutes Q/K rows for the llama arch only; rows per head group = heads.
    heads = {"attn_q.weight": config["num_attention_heads"],
             "attn_k.weight": config["num_key_value_heads"]}
    permute = config["model_type"] == "llama"
    out = {}
    for t in reader.tensors:
        rest = None
        if t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in GGUF_LAYER_NAMES:
                raise ValueError(f"unknown GGUF tensor {t.name!r}")
            name = f"model.layers.{idx}.{GGUF_LAYER_NAMES[rest]}"
        elif t.name in GGUF_GLOBAL_NAMES:
            name = GGUF_GLOBAL_NAMES[t.name]
        else:
            raise ValueError(f"unknown GGUF tensor {t.name!r}")
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name!r}: {e}") from e
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        if permute and rest in heads:
            w = _unpermute(w, heads[rest])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return out


def _save_tokenizer(gguf_path: Path, reader, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                 tokenizer: bool = True) -> Path:
    """Write ``gguf_path`` as a HF model directory at ``out_dir`` (skipped if it exists).

    The directory is built in a temporary sibling and renamed into place, so an interrupted
    conversion never leaves a half-written model behind.

    Args:
        gguf_path: llama or qwen2 GGUF file.
        out_dir: destination directory (parents are created).
        tokenizer: also save the tokenizer (via ``transformers``' GGUF tokenizer support) and
            the chat template from the GGUF metadata, if the file has a tokenizer.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        FileNotFoundError, ValueError: as ``open_gguf``, ``gguf_hf_config``, ``gguf_state_dict``.
    """
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    reader = open_gguf(gguf_path)
    config = gguf_hf_config(reader)
    state = gguf_state_dict(reader, config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del state
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer and "tokenizer.ggml.model" in reader.fields:
            _save_tokenizer(gguf_path, reader, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # lost a race: fine if it is complete
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
