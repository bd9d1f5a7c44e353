"""Which model a drafter belongs to: the target identity a drafter records and the rule that
matches it against a loaded target, whatever path the target was loaded from (alias, HF
directory, GGUF file) and whatever dtype.

A target identity (``target_identity``) holds:

- ``tokenizer_sha256``: sha256 of the tokenizer's ``token -> id`` map;
- ``config_sha256``: sha256 of the architecture fields of the config (``ARCH_FIELDS``; floats
  rounded to 6 significant digits so a GGUF float32 ``1e-5`` equals the JSON ``1e-5``);
- ``weight_sketch``: for a few fixed weight slices (``SKETCH_SLICES``: 64 evenly spaced
  embedding rows, and 16 rows of the middle layer's ``o_proj`` and ``down_proj``), a
  32-number random projection of the mean-centred slice (a Johnson-Lindenstrauss sketch: the
  cosine of two sketches estimates the cosine of the two slices);
- ``name``, ``hidden_size``, ``vocab_size``: for messages and quick checks.

Matching rule (``match_target``): same tokenizer hash, same config hash, and every sketch's
cosine with the target's >= ``SKETCH_COSINE`` (0.95). A target loaded with placeholder weights
(``load_format="dummy"``: the trainer pushes the real ones later) has no sketch and matches on
tokenizer and config alone; so does a drafter that recorded none. A drafter that recorded no
config hash (made before identities were fingerprinted) matches by the target's name only.

Why 0.95: rounding to bfloat16 lowers a sketch cosine by ~1e-6 and 4-bit block quantization
(Q4_1, measured on random weights) by ~0.002-0.003, so every load of one model matches with a
wide margin (2-bit quantizations, not tested, may come closer). For independent weights a
sketch is a random direction in 32 dimensions: P(cosine >= 0.95) ~ (1 - 0.95^2)^15.5 ~ 1e-16
per slice, ~1e-47 for all three, so unrelated models with the same architecture and tokenizer
(e.g. differently seeded random models) do not match.

False positives: a fine-tune of the same base model (same tokenizer and shapes, weights a
small step away) also matches, by design: an RL policy is such a fine-tune, and the base
model's drafter still proposes useful tokens for it (so the base SmolLM2-135M would likely find
the instruct model's drafter; with placeholder weights, any model of the same tokenizer and
config does). Speculation stays exact whichever drafter is used; only the acceptance rate
depends on the match.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
               "attention_bias", "o_proj_bias")
SKETCH_DIM = 32
SKETCH_SEED = 20250101
SKETCH_COSINE = 0.95
SKETCH_SLICES = ("embed", "mid.o_proj", "mid.down_proj")


def tokenizer_hash(tokenizer) -> str | None:
    """sha256 of the tokenizer's ``token -> id`` map (None without a tokenizer)."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _round(v):
    if isinstance(v, float):
        return float(f"{v:.6g}")
    if isinstance(v, dict):
        return {k: _round(x) for k, x in sorted(v.items())}
    return v


def config_hash(config) -> str:
    """sha256 of the architecture fields (``ARCH_FIELDS``) of a ``ModelConfig``."""
    fields = {k: _round(getattr(config, k, None)) for k in ARCH_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _slices(model) -> dict[str, torch.Tensor]:
    emb = model.embed_tokens
    rows = torch.linspace(0, emb.shape[0] - 1, 64).round().long()
    mid = model.layers[len(model.layers) // 2]
    return {"embed": emb[rows], "mid.o_proj": mid.o_proj[:16], "mid.down_proj": mid.down_proj[:16]}


def weight_sketch(model) -> dict[str, list[float]]:
    """Per slice in ``SKETCH_SLICES``, ``SKETCH_DIM`` floats: a fixed random +-1 projection of
    the slice (float32, mean removed, unit norm) of a ``LlamaForCausalLM``."""
    out = {}
    with torch.no_grad():
        for i, (name, w) in enumerate(_slices(model).items()):
            x = w.detach().float().reshape(-1).cpu()  # a few rows; the same sketch on any device
            x = x - x.mean()
            g = torch.Generator().manual_seed(SKETCH_SEED + i)
            proj = torch.randint(0, 2, (x.numel(), SKETCH_DIM), generator=g).float() * 2 - 1
            s = x @ proj
            s = s / s.norm().clamp_min(1e-30)
            out[name] = [float(f"{v:.5g}") for v in s.tolist()]
    return out


def target_identity(target) -> dict:
    """What a drafter records about its target (a ``LoadedModel``); see the module docstring."""
    return {"name": Path(target.model_dir).name, "hidden_size": target.config.hidden_size,
            "vocab_size": target.config.vocab_size,
            "tokenizer_sha256": tokenizer_hash(target.tokenizer),
            "config_sha256": config_hash(target.config),
            "weight_sketch": None if getattr(target, "dummy", False) else
            weight_sketch(target.model)}


def sketch_cosine(a: list[float], b: list[float]) -> float:
    """Cosine of two sketches (0.0 if either is zero or their lengths differ)."""
    if len(a) != len(b) or not a:
        return 0.0
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return sum(x * y for x, y in zip(a, b)) / (na * nb) if na and nb else 0.0


def match_target(recorded: dict, current: dict) -> str | None:
    """None when ``current`` (a ``target_identity``) is the model ``recorded`` describes;
    otherwise why not, in a few words (the rule is in the module docstring)."""
    if recorded.get("config_sha256") is None:
        return None if recorded.get("name") == current["name"] else \
            f"made for {recorded.get('name')!r} (no fingerprint recorded)"
    for key in ("hidden_size", "vocab_size"):
        if recorded.get(key) != current[key]:
            return f"{key} {current[key]} != {recorded.get(key)}"
    a, b = recorded.get("tokenizer_sha256"), current["tokenizer_sha256"]
    if a != b:
        return f"tokenizer differs (vocab sha256 {str(b)[:12]} != {str(a)[:12]})"
    if recorded.get("config_sha256") != current["config_sha256"]:
        return "architecture config differs"
    if not recorded.get("weight_sketch") or not current.get("weight_sketch"):
        return None  # placeholder weights (or none recorded): tokenizer and config decide
    for name, want in recorded["weight_sketch"].items():
        cos = sketch_cosine(want, current["weight_sketch"].get(name, []))
        if cos < SKETCH_COSINE:
            return f"weights differ ({name} sketch cosine {cos:.3f} < {SKETCH_COSINE})"
    return None
