"""Model hyper-parameters, read from a Hugging Face ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass, field

# HF ``architectures`` entry -> our model_type. All three share the Llama decoder layout;
# Qwen2 adds a q/k/v bias.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    """Decoder hyper-parameters (Llama / Mistral / Qwen2 family).

    Attributes:
        architecture: HF class name, e.g. ``"Qwen2ForCausalLM"``.
        model_type: ``"llama"``, ``"mistral"`` or ``"qwen2"``.
        head_dim: per-head size; ``hidden_size // num_attention_heads`` unless given.
        rope_theta: RoPE base (the ``theta`` of RoFormer, arXiv 2104.09864).
        rope_scaling: None, or the HF ``llama3`` dict (``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``).
        attention_bias: q/k/v projections have a bias (Qwen2; Llama with ``attention_bias``).
        o_proj_bias: the output projection has a bias (Llama with ``attention_bias`` only).
        eos_token_ids: every end-of-sequence id (HF allows an int or a list).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def eos_token_id(self) -> int | None:
        """The first eos id (None if the config has none)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a HF config dict (transformers 4.x ``rope_scaling`` or 5.x
        ``rope_parameters`` style).

        Raises:
            ValueError: unsupported architecture, activation, rope type, MLP bias, an active
                sliding window, or a missing/invalid size field; the message names it.
        """
        arch = _architecture(hf)
        model_type = SUPPORTED_ARCHITECTURES[arch]
        hidden, heads = _need(hf, "hidden_size"), _need(hf, "num_attention_heads")
        kv_heads = hf.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
        head_dim = hf.get("head_dim") or hidden // heads
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for RoPE")
        max_pos = hf.get("max_position_embeddings", 2048)
        _check_layers(hf, max_pos)
        rope_theta, rope_scaling = _rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch, model_type=model_type,
            vocab_size=_need(hf, "vocab_size"), hidden_size=hidden,
            intermediate_size=_need(hf, "intermediate_size"),
            num_hidden_layers=_need(hf, "num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
            rope_scaling=rope_scaling, max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias or model_type == "qwen2",
            o_proj_bias=bias and model_type == "llama",
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids,
        )


def _architecture(hf: dict) -> str:
    """The first supported entry of ``architectures``; ValueError when there is none."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architectures {archs!r} (model_type "
                         f"{hf.get('model_type')!r}); supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _need(hf: dict, key: str) -> int:
    """``hf[key]``, a positive int; ValueError otherwise."""
    v = hf.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"config field {key!r} must be a positive int, got {v!r}")
    return v


def _check_layers(hf: dict, max_pos: int) -> None:
    """ValueError for what the decoder layers do not implement: an activation other than
    SiLU, an MLP bias, sliding-window attention shorter than ``max_pos``."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    window = hf.get("sliding_window")
    if window is not None and hf.get("use_sliding_window", True) and window < max_pos:
        raise ValueError(f"sliding_window={window} < max_position_embeddings={max_pos}: "
                         "sliding-window attention is not supported")


def _rope(hf: dict) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_scaling`` (transformers 4.x) or
    ``rope_parameters`` (5.x); ValueError for an unsupported rope type or an incomplete
    ``llama3`` dict."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type != "llama3":
        return rope_theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope]
    if missing:
        raise ValueError(f"llama3 rope_scaling lacks {missing}")
    return rope_theta, {"rope_type": "llama3", **{k: rope[k] for k in keys}}
