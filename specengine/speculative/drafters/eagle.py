"""EAGLE-style feature drafter (EAGLE arXiv 2401.15077, EAGLE-2 arXiv 2406.16858, EAGLE-3
arXiv 2503.01840, FR-Spec arXiv 2502.14856).

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

Drafter position j takes ``(tok_{j+1}, f_j)`` and sits at RoPE position j. With N committed
tokens the engine has observed features 0..N-2 (the last token, the root, has none yet), so the
drafter's real prefix is positions 0..N-2 and its last row predicts the depth-1 tokens. Deeper
nodes feed the drafter's own predicted feature (EAGLE's autoregression over features).

A checkpoint is a directory with ``model.safetensors`` (fc, the layer, and ``vocab_map`` if
reduced) and ``config.json`` (``EagleConfig`` plus the target identity).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specengine import ops
from specengine.attention import make_backend
from specengine.attention.base import AttentionMetadata
from specengine.kv.block_manager import BlockManager
from specengine.models.config import ModelConfig
from specengine.models.llama import DecoderLayer, add_rms_norm, apply_rope, rope_cache
from specengine.sequence import Sequence
from specengine.speculative.drafters.base import Drafter
from specengine.speculative.drafters.coupling import coupled_logprobs
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree

FORMAT = "specengine-eagle"
DRAFTERS_DIR = Path(__file__).resolve().parents[2] / "drafters"  # specengine/drafters
LAYER_KEYS = ("input_norm", "qkv_proj", "qkv_bias", "o_proj", "o_bias", "post_attn_norm",
              "gate_up_proj", "down_proj")


def tokenizer_hash(tokenizer) -> str | None:
    """sha256 of the tokenizer's ``token -> id`` map (None without a tokenizer)."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def target_identity(target) -> dict:
    """What a drafter must match in its target (a ``LoadedModel``): name, hidden size,
    vocabulary size, tokenizer hash."""
    return {"name": Path(target.model_dir).name, "hidden_size": target.config.hidden_size,
            "vocab_size": target.config.vocab_size,
            "tokenizer_sha256": tokenizer_hash(target.tokenizer)}


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
        self._packs: dict[str, ops.PackedWeight] = {}  # kernel layouts of fc and the head

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

    def _packed(self, name: str, weight: torch.Tensor) -> ops.PackedWeight:
        """``ops.prepack(weight)`` cached under ``name``, redone when the weight changed."""
        pw = self._packs.get(name)
        if pw is None or not pw.is_current(weight):
            pw = self._packs[name] = ops.prepack(weight)
        return pw

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
                backend) -> torch.Tensor:
        """Predicted next features ``[T, H]`` for ``T`` packed rows: token ids ``[T]`` int64,
        features ``[T, H]``, RoPE positions ``[T]`` int64; writes the rows' K/V into ``kv``."""
        t = self.target
        x = torch.cat([t.embed_tokens[input_ids], feats.to(self.fc.dtype)], dim=-1)
        x = ops.linear(x, self._packed("fc", self.fc), self.fc_bias)
        cos, sin = self.rope[positions].unsqueeze(1).chunk(2, dim=-1)
        h, res = self.layer(x, None, cos, sin, kv, meta, backend)
        out, _ = add_rms_norm(h, res, t.norm.to(h.dtype), self.eps)
        return out

    @torch.no_grad()
    def draft_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """``[N, Vd]`` float32 logits over the draft vocabulary for features ``[N, H]``."""
        if self.vocab_map is None:
            return self.target.compute_logits(feats)
        return ops.linear(feats, self._packed("head", self.head_weight()), out_f32=True)

    def to_full_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids."""
        return ids if self.vocab_map is None else self.vocab_map[ids]

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
            q = q * lay.scale
            s0 = torch.einsum("bihd,bjhd->bhij", q, keys[0]).masked_fill(~causal, float("-inf"))
            diag = [torch.einsum("bihd,bihd->bhi", q, kk).unsqueeze(-1) for kk in keys[1:]]
            p = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
            a = torch.einsum("bhij,bjhd->bihd", p[..., :n], vals[0])
            for r, vv in enumerate(vals[1:]):
                a = a + p[..., n + r].transpose(1, 2).unsqueeze(-1) * vv
            o = F.linear(a.reshape(B, n, nq * D), lay.o_proj.float())
            res = x + o
            h = _rms(res, lay.post_attn_norm.float(), self.eps)
            gate, up = F.linear(h, lay.gate_up_proj.float()).chunk(2, dim=-1)
            res = res + F.linear(F.silu(gate) * up, lay.down_proj.float())
            out = _rms(res, norm_w, self.eps)
            outs.append(out)
            f_in = out  # step s+1 row j reads step s's prediction at row j
        return outs


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# ---- checkpoints ----------------------------------------------------------------------------
def save_drafter(model: EagleModel, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` into ``out_dir`` (created)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for name, p in model.named_parameters():
        sd[name] = p.detach().to(dtype or p.dtype).contiguous()
    if model.vocab_map is not None:
        sd["vocab_map"] = model.vocab_map.to(torch.int64).contiguous()
    cfg = {"format": FORMAT, "version": 1, **dataclasses.asdict(model.config)}
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return out


def read_config(ckpt_dir: str | Path) -> EagleConfig:
    """``EagleConfig`` of a checkpoint directory.

    Raises:
        FileNotFoundError: no such directory / config.json. ValueError: not an EAGLE drafter
            config or a corrupt one.
    """
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"EAGLE drafter {str(ckpt_dir)!r}: no config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"EAGLE drafter {str(ckpt_dir)!r}: corrupt config.json ({e})") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"EAGLE drafter {str(ckpt_dir)!r}: config.json is not a {FORMAT!r} "
                         "config")
    names = {f.name for f in dataclasses.fields(EagleConfig)}
    try:
        return EagleConfig(**{k: v for k, v in raw.items() if k in names})
    except TypeError as e:
        raise ValueError(f"EAGLE drafter {str(ckpt_dir)!r}: config.json lacks fields ({e})") \
            from e


def load_drafter(ckpt_dir: str | Path, target, dtype: torch.dtype | None = None) -> EagleModel:
    """Load a checkpoint for ``target`` (a ``LoadedModel``).

    Raises:
        FileNotFoundError: missing directory or files.
        ValueError: a drafter for another target (hidden size, vocabulary, tokenizer), a
            corrupt or incomplete checkpoint; the message names the directory.
    """
    from specengine.models.loader import iter_safetensors

    ckpt_dir = Path(ckpt_dir)
    cfg = read_config(ckpt_dir)
    cfg.check_target(target, repr(str(ckpt_dir)))
    wfile = ckpt_dir / "model.safetensors"
    if not wfile.is_file():
        raise FileNotFoundError(f"EAGLE drafter {str(ckpt_dir)!r}: no model.safetensors")
    sd = dict(iter_safetensors([wfile]))
    vmap = sd.pop("vocab_map", None)
    if vmap is not None and (vmap.dim() != 1 or vmap.numel() != cfg.draft_vocab_size
                             or int(vmap.max()) >= cfg.vocab_size or int(vmap.min()) < 0):
        raise ValueError(f"EAGLE drafter {str(ckpt_dir)!r}: vocab_map does not match "
                         f"draft_vocab_size={cfg.draft_vocab_size} / vocab_size="
                         f"{cfg.vocab_size}")
    model = EagleModel(cfg, target.model, dtype, vmap)
    load_state(model, sd, str(ckpt_dir))
    return model.eval()


def load_state(model: EagleModel, sd: dict[str, torch.Tensor], where: str = "state") -> None:
    """Copy ``sd`` (names as ``named_parameters``) into ``model``; ValueError on a missing,
    unexpected or misshaped tensor."""
    params = dict(model.named_parameters())
    if missing := sorted(set(params) - set(sd)):
        raise ValueError(f"EAGLE drafter {where}: missing weights {missing[:4]}")
    if extra := sorted(set(sd) - set(params)):
        raise ValueError(f"EAGLE drafter {where}: unexpected weights {extra[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(sd[name].shape) != tuple(p.shape):
                raise ValueError(f"EAGLE drafter {where}: weight {name!r} has shape "
                                 f"{tuple(sd[name].shape)}, expected {tuple(p.shape)}")
            p.copy_(sd[name])


def shipped_drafter(target) -> Path | None:
    """The drafter shipped in ``specengine/drafters/<target name>/``, if any."""
    d = DRAFTERS_DIR / Path(target.model_dir).name
    return d if (d / "config.json").is_file() else None


# ---- the drafter ---------------------------------------------------------------------------
class _State:
    """Per-sequence drafter state: observed features and a shadow sequence owning the drafter
    KV of positions 0..num_cached-1 (keys: ``token_ids[j] = tok_{j+1}``)."""

    def __init__(self, seq: Sequence, hidden_size: int, dtype: torch.dtype):
        self.feats = torch.empty(64, hidden_size, dtype=dtype)
        self.num_feats = 0
        self.shadow = Sequence(seq.request_id, seq.index, [], seq.params, seq.noise)

    def put(self, start: int, hidden: torch.Tensor) -> None:
        end = start + hidden.shape[0]
        if end > self.feats.shape[0]:
            grown = torch.empty(max(end, 2 * self.feats.shape[0]), self.feats.shape[1],
                                dtype=self.feats.dtype)
            grown[:self.num_feats] = self.feats[:self.num_feats]
            self.feats = grown
        self.feats[start:end] = hidden
        self.num_feats = end


class EagleDrafter(Drafter):
    """EAGLE-2 dynamic-tree drafting with an ``EagleModel`` over its own paged KV pool.

    Per depth, the top-k nodes by cumulative draft log-probability are fed to the drafter and
    each gets its top-k children; after the last depth the best ``budget`` nodes overall are kept
    (a child never outscores its parent, so they form a tree). For a sampled sequence the
    log-probabilities are those of the draft scores perturbed by the sequence's own sampling
    noise (``drafters.coupling``), so the tree follows what the target will sample;
    tokens its top-k / top-p / min-p drop are not drafted. Children are chosen
    deterministically (``DraftTree.sampled=False``): lossless under greedy and sampling
    verification. Each depth is one drafter forward over all sequences (tree attention).

    Args:
        strategy: default tree shape.
        model: the drafter network (inference dtype).
        num_blocks, block_size: its KV pool (one layer).

    Attributes:
        version: id of the weights in use; ``publish`` queues new ones, swapped in before the
            next ``propose`` (drafter KV is then recomputed from the stored features).
    """

    name = "eagle"
    wants_hidden = True

    def __init__(self, strategy: Strategy, model: EagleModel, num_blocks: int, block_size: int):
        super().__init__(strategy)
        self.model = model.eval()
        lc = model.layer_config
        p = model.fc
        self.kv = torch.zeros(2, num_blocks, block_size, lc.num_key_value_heads, lc.head_dim,
                              dtype=p.dtype, device=p.device)
        self.blocks = BlockManager(num_blocks, block_size, self._copy_block)
        self.backend = make_backend("auto", p.device)
        self.max_pos = model.rope.shape[0]
        self.states: dict[int, _State] = {}
        self.version = 0
        self.per_version: dict[int, list[int]] = {}  # version -> [verify steps, committed]
        self._drafted: dict[int, int] = {}  # seq id -> version of its pending draft
        self._pending: tuple[int, dict] | None = None
        self._lock = threading.Lock()

    def _copy_block(self, src: int, dst: int) -> None:
        self.kv[:, dst] = self.kv[:, src]

    # ---- hooks ------------------------------------------------------------------------------
    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        st = self.states.get(seq.seq_id)
        if st is None:
            st = self.states[seq.seq_id] = _State(seq, hidden.shape[1], self.model.fc.dtype)
        st.put(start, hidden)
        v = self._drafted.pop(seq.seq_id, None)
        if v is not None and start > 0:  # rows = the root + the accepted draft nodes
            c = self.per_version.setdefault(v, [0, 0])
            c[0] += 1
            c[1] += hidden.shape[0]

    def stats(self) -> dict:
        """``drafter_version`` and, per version, tau = tokens committed per verify step."""
        return {"drafter_version": self.version,
                "tau_per_version": {v: round(c[1] / c[0], 3)
                                    for v, c in self.per_version.items() if c[0]}}

    def release(self, seq: Sequence) -> None:
        st = self.states.pop(seq.seq_id, None)
        self._drafted.pop(seq.seq_id, None)
        if st is not None:
            self.blocks.free(st.shadow)

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Queue new weights (thread-safe); they replace the current ones between steps."""
        with self._lock:
            self._pending = (version, state_dict)

    def _swap(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        load_state(self.model, pending[1], f"version {pending[0]}")
        self.version = pending[0]
        for st in self.states.values():  # drafter KV of the old weights is stale
            st.shadow.num_cached = 0

    # ---- drafting ---------------------------------------------------------------------------
    def _sync(self, seq: Sequence, slots: int) -> _State | None:
        """Make the shadow's valid KV the longest prefix still matching ``seq`` and reserve
        room for the real prefix plus ``slots`` tree nodes; None if it cannot draft."""
        st = self.states.get(seq.seq_id)
        n = len(seq) - 1  # drafter positions with real features: 0..n-1
        if st is None or n < 1 or st.num_feats < n or n + slots > self.max_pos:
            return None
        sh = st.shadow
        keys = seq.token_ids[1:]
        c, cached = 0, min(sh.num_cached, n - 1)  # always recompute the last row
        while c < cached and sh.token_ids[c] == keys[c]:
            c += 1
        sh.num_cached = c
        sh.token_ids = keys
        self.blocks.shrink(sh, c)
        need = n + slots - c
        if self.blocks.blocks_to_grow(sh, need) > self.blocks.num_free:
            self.blocks.free(sh)
            return None
        self.blocks.grow(sh, need)
        return st

    def _meta(self, shadows, qseq, slot_pos, kv_lens, base=None, mask=None):
        bs = self.blocks.block_size
        width = max(len(sh.block_table) for sh in shadows)
        tables = [sh.block_table + [0] * (width - len(sh.block_table)) for sh in shadows]
        slots = [shadows[q].block_table[p // bs] * bs + p % bs for q, p in zip(qseq, slot_pos)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_seq=torch.tensor(qseq, dtype=torch.int32),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32), max_kv_len=max(kv_lens))
        if base is not None:
            meta.tree_base = torch.tensor(base, dtype=torch.int32)
            meta.tree_mask = mask
        return meta

    def _topk(self, feats: torch.Tensor, k: int, seqs: list[Sequence],
              positions: list[int]) -> list[list[tuple[int, float]]]:
        """Per row of ``feats`` ``[R, H]``: the top-k children as (target id, log-probability)
        by ``coupled_logprobs`` (row r drafts for ``seqs[r]`` at output position
        ``positions[r]``), best first; tokens of log-probability ``-inf`` are left out."""
        m = self.model
        logp = coupled_logprobs(m.draft_logits(feats), seqs, positions, m.config.vocab_size,
                                m.vocab_map)
        top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
        rows = zip(m.to_full_ids(top.indices).tolist(), top.values.tolist())
        return [[(t, lp) for t, lp in zip(ts, lps) if lp > -torch.inf] for ts, lps in rows]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], strategy: Strategy) -> list[DraftTree | None]:
        self._swap()
        d, k = strategy.depth, strategy.topk
        slots = k * (d - 1)
        states = [self._sync(s, slots) for s in seqs]
        live = [i for i, st in enumerate(states) if st is not None]
        out: list[DraftTree | None] = [None] * len(seqs)
        if not live:
            return out
        shadows = [states[i].shadow for i in live]
        # forward 1: the real rows not cached yet (the last one predicts depth 1)
        ids, feats, pos, qseq, kv_lens, last = [], [], [], [], [], []
        for b, i in enumerate(live):
            st, s = states[i], seqs[i]
            c, n = st.shadow.num_cached, len(s) - 1
            ids += s.token_ids[c + 1:n + 1]
            feats.append(st.feats[c:n])
            pos += range(c, n)
            qseq += [b] * (n - c)
            kv_lens += range(c + 1, n + 1)
            last.append(len(pos) - 1)
        model, kv = self.model, (self.kv[0], self.kv[1])
        meta = self._meta(shadows, qseq, pos, kv_lens)
        f = model(torch.tensor(ids), torch.cat(feats), torch.tensor(pos), kv, meta, self.backend)
        f = f[last]  # [b, H]: predicted features of position n (next-token distribution)
        live_seqs = [seqs[i] for i in live]
        n_out = [s.num_output_tokens for s in live_seqs]  # output position of depth-1 tokens
        # candidates per sequence: (cum logprob, depth, token, parent candidate, logprob)
        cands = [[(lp, 1, t, -1, lp) for t, lp in kids]
                 for kids in self._topk(f, k, live_seqs, n_out)]
        for i in live:
            states[i].shadow.num_cached = len(seqs[i]) - 1
        frontier = [list(range(len(c))) for c in cands]  # candidate indices to feed next
        fed: list[list[int]] = [[] for _ in live]  # candidate index of each fed node, in order
        feed_feat = [f[b:b + 1].expand(len(frontier[b]), -1) for b in range(len(live))]
        for depth in range(2, d + 1):
            ids, feats, pos, qseq, slot_pos, kv_lens, base, rows = [], [], [], [], [], [], [], []
            for b, i in enumerate(live):
                n = len(seqs[i]) - 1
                for ci in frontier[b]:
                    fed[b].append(ci)
                    g = len(fed[b]) - 1
                    ids.append(cands[b][ci][2])
                    pos.append(n + depth - 2)
                    qseq.append(b)
                    slot_pos.append(n + g)
                    kv_lens.append(n + g + 1)
                    base.append(n)
                    rows.append((b, ci, g))
                feats.append(feed_feat[b])
            width = max(len(x) for x in fed)
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for r, (b, ci, _) in enumerate(rows):
                where = {c: gg for gg, c in enumerate(fed[b])}
                a = ci
                while a >= 0:
                    mask[r, where[a]] = True
                    a = cands[b][a][3]
            meta = self._meta(shadows, qseq, slot_pos, kv_lens, base, mask)
            f = model(torch.tensor(ids), torch.cat(feats), torch.tensor(pos), kv, meta,
                      self.backend)
            kids = self._topk(f, k, [live_seqs[b] for b, _, _ in rows],
                              [n_out[b] + depth - 1 for b, _, _ in rows])
            new = [[] for _ in live]
            for r, (b, ci, _) in enumerate(rows):
                cum = cands[b][ci][0]
                for t, lp in kids[r]:
                    cands[b].append((cum + lp, depth, t, ci, lp))
                    new[b].append((len(cands[b]) - 1, r))
            if depth == d:
                break
            for b in range(len(live)):
                best = sorted(new[b], key=lambda x: -cands[b][x[0]][0])[:k]
                frontier[b] = [c for c, _ in best]
                feed_feat[b] = f[[r for _, r in best]]
        for b, i in enumerate(live):
            out[i] = self._tree(cands[b], strategy.budget)
            self._drafted[seqs[i].seq_id] = self.version
        return out

    @staticmethod
    def _tree(cands: list[tuple], budget: int) -> DraftTree:
        """The ``budget`` best candidates by cumulative log-prob (ties: shallower first), as a
        tree whose children are ordered by log-prob."""
        order = sorted(range(len(cands)), key=lambda c: (-cands[c][0], cands[c][1]))[:budget]
        keep = sorted(order, key=lambda c: (cands[c][1], -cands[c][0]))
        index = {c: j for j, c in enumerate(keep)}
        return DraftTree([cands[c][2] for c in keep],
                         [index[cands[c][3]] if cands[c][3] >= 0 else -1 for c in keep],
                         [cands[c][4] for c in keep])


def make_eagle(cfg, target, num_blocks: int, block_size: int) -> EagleDrafter:
    """The ``EagleDrafter`` for ``speculative_config`` ``cfg`` (method ``eagle``) and ``target``
    (a ``LoadedModel``). ``cfg.model``: a checkpoint directory; None: the drafter shipped for the
    target; ``"random"``: random weights (tests).

    Raises:
        ValueError: no shipped drafter for the target, or a checkpoint that does not fit it.
    """
    from specengine.config import parse_dtype

    dtype = parse_dtype(cfg.draft_dtype) if cfg.draft_dtype else target.model.dtype
    if cfg.model == "random":
        model = EagleModel(EagleConfig.for_target(target), target.model, dtype).random_init()
    else:
        path = cfg.model or shipped_drafter(target)
        if path is None:
            shipped = sorted(p.parent.name for p in DRAFTERS_DIR.glob("*/config.json"))
            raise ValueError(f"speculative_config method='eagle' without 'model': no drafter "
                             f"is shipped for target {Path(target.model_dir).name!r} (shipped: "
                             f"{shipped}); "
                             "train one with `specengine train-drafter` and pass its directory")
        model = load_drafter(path, target, dtype)
    return EagleDrafter(cfg.strategy, model, num_blocks, block_size)
