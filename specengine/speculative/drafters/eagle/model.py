"""The EAGLE drafter network and its hyper-parameters (EAGLE arXiv 2401.15077, EAGLE-3 arXiv
2503.01840, FR-Spec arXiv 2502.14856): ``EagleConfig``, ``EagleModel``, and the target identity
a drafter records and checks (``target_identity``, from ``eagle.identity``).

The drafter predicts the target's next *feature* (last hidden state) from the current feature
and the next token, then reads a token distribution off it with the target's own LM head:

    x_j   = fc([embed(tok_{j+1}); f_j])          2H -> H (with bias)
    h_j   = DecoderLayer(x_j)                    one Llama layer, its own paged KV cache
    f'_j+1 = final_norm(h_j)                     the target's final RMSNorm weight
    q(tok_{j+2}) = softmax(f'_{j+1} @ lm_head[vocab_map].T)

``f_j`` is the target's hidden state at position j *after* its final norm (what the engine hands
out); EAGLE uses the same post-norm feature. The embedding, final norm and LM head are the
target's tensors, not copies, so they follow ``update_weights`` for free. ``vocab_map`` (FR-Spec)
optionally restricts the draft head to a frequency-ranked subset of token ids.

``EagleModel.forward`` is the paged inference forward (the drafter in ``eagle.drafter`` drives
it); ``EagleModel.unroll`` is the dense, differentiable forward that training uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specengine.attention.base import AttentionMetadata
from specengine.models.config import ModelConfig
from specengine.models.llama import DecoderLayer, add_rms_norm, apply_rope, rope_cache
from specengine.ops import kernels
from specengine.speculative.drafters.eagle.identity import target_identity

LAYER_KEYS = ("input_norm", "qkv_proj", "qkv_bias", "o_proj", "o_bias", "post_attn_norm",
              "gate_up_proj", "down_proj")


@dataclass
class EagleConfig:
    """Drafter hyper-parameters (``config.json`` of a checkpoint).

    Attributes:
        hidden_size: H, equal to the target's.
        vocab_size: the target's vocabulary size.
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim: the layer.
        draft_vocab_size: size of the draft head's vocabulary (== vocab_size: full).
        target: identity of the target (see ``target_identity``).
        training: free-form summary of how it was trained.
    """

    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    draft_vocab_size: int
    target: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, target, draft_vocab_size: int | None = None,
                   intermediate_size: int | None = None) -> EagleConfig:
        """A config whose layer has the target's attention shape."""
        c = target.config
        return cls(hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                   intermediate_size=intermediate_size or c.intermediate_size,
                   num_attention_heads=c.num_attention_heads,
                   num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                   draft_vocab_size=min(draft_vocab_size or c.vocab_size, c.vocab_size),
                   target=target_identity(target))

    def layer_config(self, target_config: ModelConfig) -> ModelConfig:
        """The ``ModelConfig`` of the drafter layer (RoPE and norm eps from the target)."""
        return dataclasses.replace(
            target_config, num_hidden_layers=1, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            attention_bias=False, o_proj_bias=False)

    def check_target(self, target, where: str) -> None:
        """Raise ValueError naming ``where`` unless ``target`` is the model this drafter is for."""
        me, it = self.target, target_identity(target)
        for key in ("hidden_size", "vocab_size"):
            want = me.get(key, getattr(self, key))
            if want != it[key]:
                raise ValueError(f"EAGLE drafter {where} was made for a target with {key}="
                                 f"{want} ({me.get('name')!r}); this target "
                                 f"{it['name']!r} has {key}={it[key]}")
        a, b = me.get("tokenizer_sha256"), it["tokenizer_sha256"]
        if a and b and a != b:
            raise ValueError(f"EAGLE drafter {where} was made for a target with a different "
                             f"tokenizer ({me.get('name')!r}, vocab sha256 {a[:12]}) than "
                             f"{it['name']!r} (sha256 {b[:12]})")


class EagleModel(nn.Module):
    """The drafter network. Own weights: ``fc`` ``[H, 2H]``, ``fc_bias`` ``[H]``, ``layer`` (a
    ``DecoderLayer``), ``vocab_map`` (int64 ``[Vd]`` or None). Shared with the target (not in
    ``state_dict``): embedding ``[V, H]``, final norm ``[H]``, LM head ``[V, H]``.

    Args:
        config: hyper-parameters.
        target_model: the target ``LlamaForCausalLM`` whose embedding / norm / head are used.
        dtype: parameter dtype (default: the target's).
        vocab_map: draft-vocabulary token ids (sorted by frequency is fine), or None.
    """

    def __init__(self, config: EagleConfig, target_model, dtype: torch.dtype | None = None,
                 vocab_map: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        dtype = dtype or target_model.dtype
        self.layer_config = lc = config.layer_config(target_model.config)
        H = config.hidden_size
        self.fc = nn.Parameter(torch.empty(H, 2 * H, dtype=dtype), requires_grad=False)
        self.fc_bias = nn.Parameter(torch.zeros(H, dtype=dtype), requires_grad=False)
        self.layer = DecoderLayer(lc, dtype)
        self.eps = lc.rms_norm_eps
        self.shared = (target_model,)  # a tuple: not registered as a submodule
        self.register_buffer("vocab_map", None if vocab_map is None else
                             vocab_map.to(torch.int64), persistent=False)
        self.register_buffer("rope", rope_cache(lc), persistent=False)  # float32, as the target
        self._head: tuple | None = None
        self._packs: dict[str, kernels.PackedWeight] = {}  # kernel layouts of fc and the head

    # ---- shared target tensors --------------------------------------------------------------
    @property
    def target(self):
        return self.shared[0]

    def head_weight(self) -> torch.Tensor:
        """``[Vd, H]`` LM-head rows of the draft vocabulary, re-gathered when the target's head
        changes in place (tracked with the tensor's version counter)."""
        w = self.target.lm_head
        if self.vocab_map is None:
            return w
        key = (w.data_ptr(), w._version)
        if self._head is None or self._head[0] != key:
            self._head = (key, w.detach()[self.vocab_map].contiguous())
        return self._head[1]

    def _packed(self, name: str, weight: torch.Tensor) -> kernels.PackedWeight:
        """``kernels.prepack(weight)`` cached under ``name``, redone when the weight changed."""
        pw = self._packs.get(name)
        if pw is None or not pw.is_current(weight):
            pw = self._packs[name] = kernels.prepack(weight)
        return pw

    def drop_packed(self) -> None:
        """Forget the kernels' packed copies and the gathered draft-head rows; they are rebuilt
        on first use (``specengine.lifecycle.memory``'s sleep frees them this way)."""
        self._packs.clear()
        self._head = None

    def packed_weights(self) -> list[kernels.PackedWeight]:
        """The packed copies held now (for memory accounting)."""
        return list(self._packs.values())

    def random_init(self, seed: int = 0) -> EagleModel:
        """Fill the weights randomly (unit-scale activations), in place; returns self."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.copy_((1.0 if "norm" in name else 0.0)
                            + 0.02 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        return self

    # ---- inference (paged) -------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted next features ``[T, H]`` for ``T`` packed rows: token ids ``[T]`` int64,
        features ``[T, H]``, RoPE positions ``[T]`` int64; writes the rows' K/V into ``kv``.
        With ``out_rows`` (``[R]`` int64) only those rows' features ``[R, H]`` are computed;
        the others write their K/V alone (``DecoderLayer.forward``)."""
        t = self.target
        x = torch.cat([t.embed_tokens[input_ids], feats.to(self.fc.dtype)], dim=-1)
        x = kernels.linear(x, self._packed("fc", self.fc), self.fc_bias)
        cos, sin = self.rope[positions].unsqueeze(1).chunk(2, dim=-1)
        h, res = self.layer(x, None, cos, sin, kv, meta, backend, out_rows)
        out, _ = add_rms_norm(h, res, t.norm.to(h.dtype), self.eps)
        return out

    @torch.no_grad()
    def draft_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """``[N, Vd]`` float32 logits over the draft vocabulary for features ``[N, H]``."""
        if self.vocab_map is None:
            return self.target.compute_logits(feats)
        return kernels.linear(feats, self._packed("head", self.head_weight()), out_f32=True)

    def to_full_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids."""
        if self.vocab_map is None:
            return ids
        return self.vocab_map[ids.to(self.vocab_map.device)].to(ids.device)

    # ---- training (dense, autograd) ----------------------------------------------------------
    def unroll(self, tokens: torch.Tensor, feats: torch.Tensor, steps: int,
               noise: float = 0.0, generator: torch.Generator | None = None
               ) -> list[torch.Tensor]:
        """Dense, differentiable drafter over whole sequences, unrolled ``steps`` times
        (EAGLE-3's training-time test): it sees exactly what inference sees.

        Args:
            tokens: ``[B, L]`` int64 token ids.
            feats: ``[B, L, H]`` target features of positions 0..L-1.
            steps: unroll depth s >= 1.
            noise: half-width of uniform noise added to the input features (step 0 only).

        Returns:
            ``steps`` tensors ``[B, L-1, H]`` float32: step s, row j predicts ``f_{j+1+s}``
            from ``(tok_{j+1+s}, prediction of step s-1 at row j)`` (step 0: ``f_j``), attending
            to rows 0..j of step 0 and to row j of steps 1..s (the tree path at inference).
            Rows with ``j + 1 + s >= L`` are meaningless (mask them in the loss).
        """
        t = self.target
        B, L = tokens.shape
        n = L - 1
        lay = self.layer
        nq, nkv, D = lay.num_heads, lay.num_kv_heads, lay.head_dim
        norm_w = t.norm.detach().float()
        f_in = feats[:, :n].float()
        if noise:
            f_in = f_in + (torch.rand(f_in.shape, generator=generator) * 2 - 1) * noise
        emb = t.embed_tokens.detach()
        pos = torch.arange(n)
        keys, vals, outs = [], [], []
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for s in range(steps):
            ids = tokens[:, 1 + s:].clone()
            if ids.shape[1] < n:  # pad: rows past the end are masked out by the caller
                ids = F.pad(ids, (0, n - ids.shape[1]))
            x = torch.cat([emb[ids].float(), f_in], dim=-1)
            x = F.linear(x, self.fc.float(), self.fc_bias.float())
            h = _rms(x, lay.input_norm.float(), self.eps)
            qkv = F.linear(h, lay.qkv_proj.float()).view(B, n, nq + 2 * nkv, D)
            cos, sin = self.rope[(pos + s).clamp(max=self.rope.shape[0] - 1)].float() \
                .unsqueeze(1).chunk(2, dim=-1)
            qk = apply_rope(qkv[:, :, :nq + nkv], cos, sin)
            q, k, v = qk[:, :, :nq], qk[:, :, nq:], qkv[:, :, nq + nkv:]
            k = k.repeat_interleave(nq // nkv, dim=2)  # [B, n, nq, D]
            v = v.repeat_interleave(nq // nkv, dim=2)
            keys.append(k)
            vals.append(v)
            a = _path_attention(q * lay.scale, keys, vals, causal)
            o = F.linear(a.reshape(B, n, nq * D), lay.o_proj.float())
            res = x + o
            h = _rms(res, lay.post_attn_norm.float(), self.eps)
            gate, up = F.linear(h, lay.gate_up_proj.float()).chunk(2, dim=-1)
            res = res + F.linear(F.silu(gate) * up, lay.down_proj.float())
            out = _rms(res, norm_w, self.eps)
            outs.append(out)
            f_in = out  # step s+1 row j reads step s's prediction at row j
        return outs


def _path_attention(q: torch.Tensor, keys: list[torch.Tensor], vals: list[torch.Tensor],
                    causal: torch.Tensor) -> torch.Tensor:
    """Attention of unroll step s = ``len(keys) - 1``: row j of the scaled queries ``q``
    ``[B, n, heads, D]`` attends to rows 0..j of step 0 (``causal`` ``[n, n]`` bool) and to row
    j of steps 1..s (its own tree path). Returns ``[B, n, heads, D]``."""
    n = q.shape[1]
    s0 = torch.einsum("bihd,bjhd->bhij", q, keys[0]).masked_fill(~causal, float("-inf"))
    diag = [torch.einsum("bihd,bihd->bhi", q, kk).unsqueeze(-1) for kk in keys[1:]]
    p = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
    a = torch.einsum("bhij,bjhd->bihd", p[..., :n], vals[0])
    for r, vv in enumerate(vals[1:]):
        a = a + p[..., n + r].transpose(1, 2).unsqueeze(-1) * vv
    return a


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

