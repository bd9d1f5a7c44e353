"""Checks of incoming weights (``weights.WeightUpdater`` runs them on every chunk): HF names
(fused ``qkv_proj`` / ``gate_up_proj`` names split into their parts), shapes, a floating-point
dtype and finite values; accepted tensors are staged in the engine's dtype on its device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

import torch

# Fused HF suffix (per layer) -> the unfused suffixes it holds, stacked along dim 0, with a
# function of the config giving each part's rows.
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.{}_proj.weight", ("q", "k", "v")),
    "self_attn.qkv_proj.bias": ("self_attn.{}_proj.bias", ("q", "k", "v")),
    "mlp.gate_up_proj.weight": ("mlp.{}_proj.weight", ("gate", "up")),
}
def _part_rows(config, part: str) -> int:
    c = config
    return {"q": c.num_attention_heads * c.head_dim, "k": c.num_key_value_heads * c.head_dim,
            "v": c.num_key_value_heads * c.head_dim, "gate": c.intermediate_size,
            "up": c.intermediate_size}[part]


@contextlib.contextmanager
def one_torch_thread():
    """Run the block with one torch thread. A sync is hundreds of small memory-bound ops
    (checks, copies, repacks): after each parallel op torch's OpenMP workers meet at a
    barrier, and on a busy machine that wait dominates (measured on 2 busy cores: the default
    model's sync took 2.6 s of CPU with 2 threads, 0.27 s with 1)."""
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


def check_finite(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise ValueError naming ``name`` when ``tensor`` has a NaN or inf value, or, when
    ``dtype``'s range is much narrower than the tensor's (float16), a value beyond it (it
    would become inf when cast). One pass (a sum) in the common case. (Casting float32 to
    bfloat16 overflows only within 0.4% of float32's largest value: not checked.)

    Raises:
        ValueError: the message names the tensor and counts the bad values.
    """
    t = tensor.detach()
    if t.numel() == 0:
        return
    if not torch.isfinite(t.sum()):  # one fast pass; NaN/inf anywhere makes the sum so
        bad = int((~torch.isfinite(t)).sum())
        if bad:  # (else the sum overflowed: finite values)
            raise ValueError(f"weight {name!r} has {bad} NaN/inf values (of {t.numel()}); "
                             "refused")
    limit = torch.finfo(dtype).max
    if limit < torch.finfo(t.dtype).max / 2:  # a narrower range (float16): overflow on cast
        lo, hi = (float(x) for x in torch.aminmax(t))
        if lo < -limit or hi > limit:
            raise ValueError(f"weight {name!r} has values in [{lo:.4g}, {hi:.4g}], beyond "
                             f"{dtype}'s range (they would become inf); refused")


def _pairs(chunk) -> Iterable[tuple[str, torch.Tensor]]:
    """A chunk as ``(name, tensor)`` pairs: one pair, a Mapping, or an iterable of pairs."""
    if isinstance(chunk, Mapping):
        return chunk.items()
    if isinstance(chunk, tuple) and len(chunk) == 2 and isinstance(chunk[0], str):
        return [chunk]
    if isinstance(chunk, (str, bytes, torch.Tensor)) or not isinstance(chunk, Iterable):
        raise TypeError(f"weights must be a (name, tensor) pair, a dict or an iterable of "
                        f"(name, tensor) pairs (or, for load_weights, a checkpoint path), "
                        f"got {type(chunk).__name__}")
    return chunk


class WeightChecker:
    """Checks ``(name, tensor)`` pairs against one target model.

    Args:
        model: the target ``LlamaForCausalLM``: its config, dtype, device and the shapes of
            its HF-named tensors (``hf_parameters``).
    """

    def __init__(self, model):
        self.model = model
        self.dtype = model.dtype
        self.device = next(model.parameters()).device
        self.shapes = {n: tuple(t.shape) for n, t in model.hf_parameters().items()}

    def entries(self, name, tensor) -> list[tuple[str, torch.Tensor]]:
        """Checked ``(name, tensor)`` entries for one input pair (a fused name gives several;
        a skipped name none). Raises ValueError / TypeError naming the input."""
        c = self.model.config
        if not isinstance(name, str):
            raise TypeError(f"weight names must be str, got {type(name).__name__} ({name!r})")
        if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and c.tie_word_embeddings):
            return []
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        if not tensor.is_floating_point():
            raise TypeError(f"weight {name!r} has dtype {tensor.dtype}; expected a "
                            "floating-point tensor (it is cast to the engine's dtype)")
        prefix, _, suffix = name.rpartition(".layers.")
        layer, _, rest = suffix.partition(".")
        if prefix == "model" and layer.isdigit() and rest in FUSED:
            pattern, parts = FUSED[rest]
            names = [f"model.layers.{layer}.{pattern.format(p)}" for p in parts]
            rows = [_part_rows(c, p) for p in parts]
            if names[0] not in self.shapes:
                self._unknown(name)
            want = (sum(rows), *self.shapes[names[0]][1:])
            if tuple(tensor.shape) != want:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{want} ({' + '.join(map(str, rows))} rows: "
                                 f"{'/'.join(parts)})")
            check_finite(name, tensor, self.dtype)
            return list(zip(names, torch.split(tensor, rows)))
        if name not in self.shapes:
            self._unknown(name)
        if tuple(tensor.shape) != self.shapes[name]:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{self.shapes[name]}")
        check_finite(name, tensor, self.dtype)
        return [(name, tensor)]

    def _unknown(self, name: str):
        c = self.model.config
        raise ValueError(f"unexpected weight {name!r} for {c.architecture} "
                         f"(attention_bias={c.attention_bias}, "
                         f"{c.num_hidden_layers} layers)")

    def stage(self, tensor: torch.Tensor, copy: bool) -> torch.Tensor:
        """``tensor`` in the engine's dtype on its device: a copy when it is cast or moved,
        or when ``copy`` (the caller may reuse its buffer after ``load`` returns)."""
        if tensor.dtype != self.dtype or tensor.device != self.device:
            return tensor.detach().to(device=self.device, dtype=self.dtype)
        return tensor.detach().clone() if copy else tensor.detach()

    def check(self, chunk, mode: str) -> list[tuple[str, torch.Tensor]]:
        """All entries of ``chunk``, checked, staged per ``mode``: ``"copy"`` (cast or
        cloned now), ``"cast"`` (cast now, kept as is if already right: fresh tensors) or
        ``"defer"`` (kept as given; cast when applied)."""
        out = []
        with one_torch_thread():
            for name, tensor in _pairs(chunk):
                for n, t in self.entries(name, tensor):
                    out.append((n, t.detach() if mode == "defer" else
                                self.stage(t, mode == "copy")))
        return out
