"""Llama-family decoder (Llama 2/3, Mistral without sliding window, Qwen2) over a paged KV cache.

Architecture: Touvron et al., "LLaMA" (arXiv 2302.13971): pre-RMSNorm decoder layers with
rotary position embeddings (RoFormer, arXiv 2104.09864; HF "rotate-half" layout), grouped-query
attention (Ainslie et al., arXiv 2305.13245) and a SwiGLU MLP (Shazeer, arXiv 2002.05202).

Tokens of all sequences in a step are packed flat into ``T`` rows (no batch dim, no padding);
the attention backend finds each token's sequence and context through ``AttentionMetadata``.
q/k/v and gate/up projections are fused into one matrix each (fewer GEMM calls); ``load_weights``
(all weights) maps Hugging Face parameter names onto the fused layout (``hf_parameters``; a
running engine's updates go through ``specengine.lifecycle.weights``, which writes the same views)
and then prepacks the linear weights (``kernels.prepack``: AMX
tiles for bfloat16 on CPUs that have them). Packed copies are checked against the parameters'
version counters on use and rebuilt if a weight was modified.

Hot path per layer: norm, qkv linear, RoPE of q and k in place in the qkv output (float32
cos/sin), K/V write, attention, o linear, fused add + norm, gate_up linear with SiLU-and-mul in
its epilogue, down linear.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from specengine.attention.base import AttentionBackend, AttentionMetadata
from specengine.attention.cpu import CpuAttention
from specengine.models.config import ModelConfig
from specengine.ops import kernels
from specengine.ops.extension import ext
from specengine.ops.kernels import add_rms_norm

# what ``decoder_forward`` reads of each layer (``LlamaModel._decoder_weights``)
_DECODER_PARAMS = ("input_norm", "qkv_proj", "o_proj", "post_attn_norm", "gate_up_proj",
                   "down_proj", "qkv_bias", "o_bias")
_DECODER_PARAM_NAMES = list(_DECODER_PARAMS)


def _same_stamp(a: torch.Tensor | list, b: torch.Tensor | list) -> bool:
    """True when two ``_param_stamp`` results are equal (both tensors or both lists)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32, with Llama 3.1 scaling if set.

    Llama 3.1 scaling (Meta's reference code): wavelengths longer than
    ``original_max / low_freq_factor`` are divided by ``factor``, shorter than
    ``original_max / high_freq_factor`` are kept, and the band between is interpolated.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def rope_cache(config: ModelConfig) -> torch.Tensor:
    """``[max_position_embeddings, 2 * head_dim]`` float32: per position, the full-width cos
    and the signed sin (``[-sin, sin]``) used by ``apply_rope``."""
    inv_freq = rope_inv_freq(config)
    t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos, -sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by ``cos``/``sin`` ``[T, 1, D]`` (same dtype as x).

    Equals HF's ``x * cos + rotate_half(x) * sin``: ``roll`` swaps the halves and the sign
    lives in ``sin``. Returns a new tensor.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: attention then SwiGLU MLP, each with a residual add."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        self.scale = c.head_dim ** -0.5
        self.eps = c.rms_norm_eps

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = param(c.hidden_size)
        self.qkv_proj = param(self.q_size + 2 * self.kv_size, c.hidden_size)
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if c.attention_bias else None
        self.o_proj = param(c.hidden_size, self.q_size)
        self.o_bias = param(c.hidden_size) if c.o_proj_bias else None
        self.post_attn_norm = param(c.hidden_size)
        self.gate_up_proj = param(2 * c.intermediate_size, c.hidden_size)
        self.down_proj = param(c.hidden_size, c.intermediate_size)
        self._packed: dict[str, kernels.PackedWeight] = {}

    def packed(self, name: str) -> kernels.PackedWeight:
        """``kernels.prepack`` of the weight parameter ``name``, rebuilt when it changed."""
        w = getattr(self, name)
        pw = self._packed.get(name)
        if pw is None or not pw.is_current(w):
            pw = self._packed[name] = kernels.prepack(w, glu=name == "gate_up_proj", reuse=pw)
        return pw

    def prepack(self) -> None:
        """Pack the linear weights now (otherwise done on first use)."""
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            self.packed(name)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend,
                out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``/``residual`` ``[T, hidden]`` -> (layer output, residual); the caller adds
        them (fused into the next norm). ``residual`` is None for the first layer.

        ``out_rows`` (``[R]`` int64, optional): the rows whose output is wanted; the others
        only write their K/V (a drafter catching up on tokens it did not see: their keys are
        needed, their outputs are not). Output and residual are then ``[R, hidden]``, the
        same values bit for bit as those rows of the whole layer's (every kernel here works
        row by row), at R rows' cost of attention, ``o_proj`` and MLP instead of T's."""
        if residual is None:
            residual = hidden
            hidden = kernels.rms_norm(hidden, self.input_norm, self.eps)
        else:
            hidden, residual = add_rms_norm(hidden, residual, self.input_norm, self.eps)

        T, nq, nkv = hidden.shape[0], self.num_heads, self.num_kv_heads
        qkv = kernels.linear(hidden, self.packed("qkv_proj"), self.qkv_bias)
        qkv = qkv.view(T, nq + 2 * nkv, -1)
        kernels.rope_(qkv[:, :nq + nkv], cos, sin)  # q and k rotated in place
        q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        k_cache, v_cache = kv_cache
        backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if out_rows is not None:
            q, residual, T = q[out_rows], residual[out_rows], out_rows.shape[0]
            kv_lens = meta.kv_lens[out_rows]
            tree = meta.tree_mask is not None
            meta = AttentionMetadata(meta.slot_mapping[out_rows], meta.block_tables,
                                     meta.query_seq[out_rows], kv_lens, int(kv_lens.max()),
                                     meta.tree_base[out_rows] if tree else None,
                                     meta.tree_mask[out_rows] if tree else None)
        attn = backend.forward(q, k_cache, v_cache, meta, self.scale)
        hidden = kernels.linear(attn.reshape(T, self.q_size), self.packed("o_proj"), self.o_bias)

        hidden, residual = add_rms_norm(hidden, residual, self.post_attn_norm, self.eps)
        hidden = kernels.linear(kernels.linear_glu(hidden, self.packed("gate_up_proj")),
                            self.packed("down_proj"))
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM over packed tokens and a paged KV cache.

    Parameters are created uninitialised (``torch.empty``) in ``dtype``; fill them with
    ``load_weights`` (the loader does) before use. Inference only (no autograd).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = c = config
        dtype = dtype or torch.get_default_dtype()
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(c, dtype) for _ in range(c.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(c.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (self.embed_tokens if c.tie_word_embeddings else
                        nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, dtype=dtype),
                                     requires_grad=False))
        # float32 whatever the model dtype: RoPE runs in float32 with one rounding
        self.register_buffer("rope_cache", rope_cache(c), persistent=False)
        self._lm_head_packed: kernels.PackedWeight | None = None
        # ``_decoder_weights``' last result: (parameters, their (data_ptr, version), the first
        # layer's QKV pack, tensors, biases)
        self._decoder_kept: tuple | None = None
        # float32: logits from a float32 copy of the LM head over float32-cast hidden states
        # (vLLM's head_dtype, #48390); None: the model dtype
        self.head_dtype: torch.dtype | None = None
        self._head_f32: tuple[int, int, kernels.PackedWeight] | None = None  # version, ptr, copy

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """Run the decoder over ``T`` packed tokens, writing their K/V into the caches.

        Args:
            input_ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 position of each token in its sequence
                (< ``max_position_embeddings``).
            kv_caches: one ``(k_cache, v_cache)`` per layer, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype.
            meta: slots for the new K/V and what each token attends to.
            backend: paged attention implementation. It receives ``q`` ``[T, heads, D]``
                that may be a non-contiguous view when ``T > 1``.

        Returns:
            ``[T, hidden_size]`` hidden states after the final norm, model dtype.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries, the model has "
                             f"{len(self.layers)} layers")
        cs = self.rope_cache[positions].unsqueeze(1)  # [T, 1, 2D]
        cos, sin = cs.chunk(2, dim=-1)
        hidden, residual = self.embed_tokens[input_ids], None
        out = self._layers_in_extension(hidden, cos, sin, kv_caches, meta, backend)
        if out is not None:
            return out
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer.forward(hidden, residual, cos, sin, kv, meta, backend)
        hidden, _ = add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps)
        return hidden

    def _layers_in_extension(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                             meta: AttentionMetadata, backend: AttentionBackend
                             ) -> torch.Tensor | None:
        """The layer loop and final norm as one extension call (``csrc/decoder_forward.cpp``:
        the same kernels in the same order, so the same bits) when every op of it would run in
        the extension's CPU kernels anyway; None otherwise (the caller runs the loop)."""
        mod = ext()
        if (mod is None or not hasattr(mod, "decoder_forward") or type(backend) is not CpuAttention
                or hidden.device.type != "cpu" or hidden.dtype not in (torch.float32,
                                                                       torch.bfloat16)
                or not self.layers or not hidden.shape[0] or cos.dtype != torch.float32):
            return None
        packed = self._decoder_weights(hidden)
        if packed is None:
            return None
        tensors, biases, kind = packed
        for k_cache, v_cache in kv_caches:
            if (k_cache.dtype != hidden.dtype or not k_cache.is_contiguous()
                    or not v_cache.is_contiguous()):
                return None
        first = self.layers[0]
        sizes = [first.qkv_proj.shape[0], first.o_proj.shape[0], first.gate_up_proj.shape[0],
                 first.down_proj.shape[0]]
        return mod.decoder_forward(
            hidden, cos, sin, tensors, biases, sizes, kernels.PACKED_KINDS.index(kind),
            first.num_heads, first.num_kv_heads, first.head_dim, first.scale, first.eps,
            [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping,
            meta.block_tables, meta.query_seq, meta.kv_lens, meta.tree_base, meta.tree_mask,
            self.norm)

    def _decoder_weights(self, hidden: torch.Tensor
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], str] | None:
        """``(tensors, biases, kind)`` that ``decoder_forward`` takes for ``hidden``
        ``[T, hidden_size]``: per layer its input norm, packed QKV and O weights, post-attention
        norm, packed gate-up and down weights, and its two biases (or None); None when a
        layer's packed kernels do not take ``hidden``'s rows (or differ in kind).

        Kept between steps: reused while every one of those parameters is the same tensor
        with the same storage and version counter (``kernels._version``) as when it was
        built and the packs still take ``hidden``'s rows (same instruction-set epoch and
        row limit), so a weight update, an in-place change, a replaced parameter or a new
        ``SPECENGINE_ISA`` cap rebuilds it through ``DecoderLayer.packed`` (repacking what is
        stale). Building it costs ~0.3 ms per step at batch 1 (120 ``packed`` checks); the
        check that it still holds is one extension call (``param_stamps``): in a batch-1 step
        of ~9 ms on Zen 4 0.12 ms, where a Python loop over the 180 parameters took 0.25 ms
        (``bench/step_phases.py``; after a forward their objects are out of the CPU caches)."""
        rows = hidden.shape[0]
        stamp = self._param_stamp()
        kept = self._decoder_kept
        if (kept is not None and _same_stamp(kept[1], stamp)
                and kept[2].rows_for(hidden) == rows):
            return kept[3], kept[4], kept[2].kind
        self._decoder_kept = None
        # kept alive with the stamp, so no new parameter can take a kept one's id
        params = [layer._parameters.get(n) for layer in self.layers for n in _DECODER_PARAMS]
        tensors, biases, kind = [], [], None
        for layer in self.layers:
            packs = [layer.packed(n) for n in ("qkv_proj", "o_proj", "gate_up_proj",
                                               "down_proj")]
            if (any(pw.rows_for(hidden) != rows or pw.kind != packs[0].kind for pw in packs)
                    or not packs[2].glu):
                return None
            kind = packs[0].kind
            tensors += [layer.input_norm, packs[0].packed, packs[1].packed, layer.post_attn_norm,
                        packs[2].packed, packs[3].packed]
            biases += [layer.qkv_bias, layer.o_bias]
        first = self.layers[0].packed("qkv_proj")
        self._decoder_kept = (params, stamp, first, tensors, biases)
        return tensors, biases, kind

    def _param_stamp(self) -> torch.Tensor | list:
        """Per layer and ``_DECODER_PARAMS`` name, the parameter's id, data pointer and
        version counter: ``[L * 8, 3]`` int64 from one extension call (``param_stamps``), or,
        without it, the same as a list of tuples (None for an absent parameter)."""
        mod = ext()
        if mod is not None and hasattr(mod, "param_stamps"):
            return mod.param_stamps([layer._parameters for layer in self.layers],
                                    _DECODER_PARAM_NAMES)
        params = [layer._parameters.get(n) for layer in self.layers for n in _DECODER_PARAMS]
        return [(id(p), p.data_ptr(), kernels._version(p)) if p is not None else None
                for p in params]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` hidden states (model dtype) -> ``[N, vocab_size]`` float32
        logits: float32 accumulation rounded once to float32 in the model dtype's kernel, or,
        with ``head_dtype = torch.float32`` on a bfloat16 model, the float32 hidden states
        times a float32 copy of the LM head (refreshed when the head's weights change)."""
        if self.head_dtype == torch.float32 and self.dtype != torch.float32:
            return kernels.linear(hidden.float(), self._float_head())
        pw = self._lm_head_packed
        if pw is None or not pw.is_current(self.lm_head):
            pw = self._lm_head_packed = kernels.prepack(self.lm_head, reuse=pw)
        return kernels.linear(hidden, pw, out_f32=True)

    def _float_head(self) -> kernels.PackedWeight:
        """The packed float32 copy of ``lm_head``, rebuilt when the head was modified."""
        w = self.lm_head
        key = (kernels._version(w), w.data_ptr())
        if self._head_f32 is None or self._head_f32[:2] != key:
            old = self._head_f32[2] if self._head_f32 is not None else None
            copy = w.detach().float()
            self._head_f32 = (*key, kernels.prepack(copy, reuse=old))
        pw = self._head_f32[2]
        if not pw.is_current(pw.weight):  # the instruction-set cap changed
            pw = kernels.prepack(pw.weight, reuse=pw)
            self._head_f32 = (*key, pw)
        return pw

    def drop_packed(self) -> None:
        """Forget the kernels' packed copies of the weights (and the float32 head copy); they
        are rebuilt on first use (``specengine.lifecycle.memory``'s sleep frees them this way)."""
        for layer in self.layers:
            layer._packed.clear()
        self._lm_head_packed = None
        self._head_f32 = None
        self._decoder_kept = None

    def packed_weights(self) -> list[kernels.PackedWeight]:
        """The packed copies held now (for memory accounting)."""
        packs = [pw for layer in self.layers for pw in layer._packed.values()]
        packs.append(self._lm_head_packed)
        if self._head_f32 is not None:
            packs.append(self._head_f32[2])
        return [pw for pw in packs if pw is not None]

    def prepack(self) -> None:
        """Pack the linear weights for the fast kernels (``kernels.prepack``); ``load_weights``
        and weight updates (``specengine.lifecycle.weights``) call it. Packed copies are rebuilt on
        use if a weight changes afterwards (each is checked against its parameter's version
        counter); this rebuilds the stale ones now."""
        for layer in self.layers:
            layer.prepack()
        pw = self._lm_head_packed
        if pw is None or not pw.is_current(self.lm_head):
            self._lm_head_packed = kernels.prepack(self.lm_head, reuse=pw)

    def hf_parameters(self) -> dict[str, torch.Tensor]:
        """Hugging Face parameter name -> the tensor it fills: one of our parameters or a row
        slice of a fused one (a view: copying into it writes the parameter). ``lm_head.weight``
        is absent when embeddings are tied."""
        c = self.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
            c.intermediate_size
        # HF suffix -> (our attribute, row offset, rows) within a layer; rows None = whole.
        layer_map = {
            "input_layernorm.weight": ("input_norm", 0, None),
            "post_attention_layernorm.weight": ("post_attn_norm", 0, None),
            "self_attn.q_proj.weight": ("qkv_proj", 0, q),
            "self_attn.k_proj.weight": ("qkv_proj", q, kv),
            "self_attn.v_proj.weight": ("qkv_proj", q + kv, kv),
            "self_attn.q_proj.bias": ("qkv_bias", 0, q),
            "self_attn.k_proj.bias": ("qkv_bias", q, kv),
            "self_attn.v_proj.bias": ("qkv_bias", q + kv, kv),
            "self_attn.o_proj.weight": ("o_proj", 0, None),
            "self_attn.o_proj.bias": ("o_bias", 0, None),
            "mlp.gate_proj.weight": ("gate_up_proj", 0, inter),
            "mlp.up_proj.weight": ("gate_up_proj", inter, inter),
            "mlp.down_proj.weight": ("down_proj", 0, None),
        }
        out = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            for suffix, (attr, start, rows) in layer_map.items():
                p = getattr(layer, attr)
                if p is not None:
                    out[f"model.layers.{i}.{suffix}"] = p if rows is None else \
                        p[start:start + rows]
        return out

    def _checked(self, weights: Iterable[tuple[str, torch.Tensor]],
                 dests: dict[str, torch.Tensor]
                 ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, destination, tensor)`` per entry of ``weights`` (``dests``: from
        ``hf_parameters``), lazily; skips ``rotary_emb.inv_freq`` and, when embeddings are
        tied, ``lm_head.weight``.

        Raises:
            ValueError: an unknown name or a shape that differs. TypeError: not a tensor.
        """
        c = self.config
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and c.tie_word_embeddings):
                continue
            dest = dests.get(name)
            if dest is None:
                raise ValueError(f"unexpected weight {name!r} for {c.architecture} "
                                 f"(attention_bias={c.attention_bias})")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            yield name, dest, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors (``model.layers.N.self_attn.q_proj.weight``, ...)
        into the fused parameters, casting to the model dtype; every parameter must be given.
        Tensors are copied as they come (one at a time from a safetensors stream).

        ``lm_head.weight`` is ignored when embeddings are tied; ``rotary_emb.inv_freq`` always.

        Raises:
            ValueError: a name is unknown, a shape differs, or a parameter was not provided.
            TypeError: an entry is not a tensor.
        """
        dests = self.hf_parameters()
        seen = set()
        for name, dest, tensor in self._checked(weights, dests):
            dest.copy_(tensor)
            seen.add(name)
        if missing := dests.keys() - seen:
            raise ValueError(f"{len(missing)} weights missing, e.g. {sorted(missing)[:3]}")
        self.prepack()
