"""The EAGLE drafter in the engine (EAGLE-2 arXiv 2406.16858): ``EagleDrafter`` grows a dynamic
token tree with an ``EagleModel`` over the drafter's own paged KV pool, and ``make_eagle`` builds
it from a ``speculative_config``.

Drafter position j takes ``(tok_{j+1}, f_j)`` and sits at RoPE position j. With N committed
tokens the engine has observed features 0..N-2 (the last token, the root, has none yet), so the
drafter's real prefix is positions 0..N-2 and its last row predicts the depth-1 tokens. Deeper
nodes feed the drafter's own predicted feature (EAGLE's autoregression over features).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import NamedTuple

import torch

from specengine.attention import make_backend
from specengine.attention.base import AttentionMetadata
from specengine.engine.sequence import Sequence
from specengine.kv.block_manager import BlockManager
from specengine.ops import kernels
from specengine.ops.extension import ext
from specengine.ops.heap import advise_huge_pages
from specengine.ops.lists import int_tensor, padded_tensor
from specengine.speculative.drafters.base import Drafter
from specengine.speculative.drafters.coupling import coupled_topk, plain_params
from specengine.speculative.drafters.eagle.checkpoint import (
    load_drafter,
    load_state,
    shipped_drafters,
)
from specengine.speculative.drafters.eagle.model import EagleConfig, EagleModel
from specengine.speculative.drafters.shadow import new_shadow, sync_shadow
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree


class Candidate(NamedTuple):
    """One node of a tree being grown: the cumulative draft log-probability of its path, its
    depth (1: a child of the root), token, parent (index of the parent candidate, -1: the
    root) and its own log-probability given the parent."""

    cum: float
    depth: int
    token: int
    parent: int
    logprob: float


class _Prefix(NamedTuple):
    """The drafter rows of a step's prefix feed: token ids, input features ``[P, H]``, RoPE
    positions (= KV positions), the sequence of each row, and each sequence's last row."""

    ids: list[int]
    feats: torch.Tensor
    pos: list[int]
    qseq: list[int]
    last: list[int]


class _State:
    """Per-sequence drafter state: observed features and a shadow sequence owning the drafter
    KV of positions 0..num_cached-1 (keys: ``token_ids[j] = tok_{j+1}``)."""

    def __init__(self, seq: Sequence, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.feats = torch.empty(64, hidden_size, dtype=dtype, device=device)
        self.num_feats = 0
        self.shadow = new_shadow(seq)

    def put(self, start: int, hidden: torch.Tensor) -> None:
        end = start + hidden.shape[0]
        if end > self.feats.shape[0]:
            grown = torch.empty(max(end, 2 * self.feats.shape[0]), self.feats.shape[1],
                                dtype=self.feats.dtype, device=self.feats.device)
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
    deterministically (the top-k of those scores): lossless under greedy and coupled
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
    observes_at_draft = True
    catches_up = True

    def __init__(self, strategy: Strategy, model: EagleModel, num_blocks: int, block_size: int):
        super().__init__(strategy)
        self.model = model.eval()
        lc = model.layer_config
        p = model.fc
        self.kv = torch.empty(2, num_blocks, block_size, lc.num_key_value_heads, lc.head_dim,
                              dtype=p.dtype, device=p.device)
        advise_huge_pages(self.kv)  # read at every depth: 2 MiB pages (ops.heap), as the target's
        self.kv.zero_()
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
            st = self.states[seq.seq_id] = _State(seq, hidden.shape[1], self.model.fc.dtype,
                                                       self.kv.device)
        st.put(start, hidden)
        v = self._drafted.pop(seq.seq_id, None)
        if v is not None and start > 0:  # rows = the root + the accepted draft nodes
            c = self.per_version.setdefault(v, [0, 0])
            c[0] += 1
            c[1] += hidden.shape[0]

    def observed(self, seq: Sequence) -> int:
        st = self.states.get(seq.seq_id)
        return st.num_feats if st is not None else 0

    def prefill(self, samples: list[Sequence]) -> list[Sequence]:
        """The drafter KV of a just-prefilled prompt (positions ``0 .. n-1``, ``n`` the
        prompt's length less one), computed once from the first sample's features (a K/V
        projection per row, as a catch-up: ``_feed_prefix``) and shared by every other sample
        of the same tokens (``BlockPool.share``: one copy of the blocks, the partly filled last
        one copied when a sample first writes into it), as vLLM's and SGLang's EAGLE workers
        run the draft model over the prompt at prefill. The rows are the ones ``propose``
        would compute (same kernels, so the same bits); a later draft starts from the last
        one. Returns the samples whose KV it holds now: none when the first sample's features
        are not all held, the drafter's KV pool is short or the prompt is one token; a sample
        of other tokens than the first (none at a prompt's prefill) or already holding
        drafter KV is left to its draft."""
        first = samples[0]
        st = self._sync(first, 0)
        if st is None:
            return []
        with torch.inference_mode():
            self._feed_prefix([st.shadow], self._prefix_rows([first], [st]))
        built = [first]
        for s in samples[1:]:
            sib = self.states.get(s.seq_id)
            if s.token_ids != first.token_ids or (sib is not None and sib.shadow.block_table):
                continue
            if sib is None:
                sib = self.states[s.seq_id] = _State(s, st.feats.shape[1], st.feats.dtype,
                                                     self.kv.device)
            self.blocks.share(st.shadow, sib.shadow)
            sib.shadow.token_ids = list(st.shadow.token_ids)
            built.append(s)
        return built

    def stats(self) -> dict:
        """``drafter_version`` and, per version, tau = tokens committed per verify step."""
        return {"drafter_version": self.version,
                "tau_per_version": {v: round(c[1] / c[0], 3)
                                    for v, c in self.per_version.items() if c[0]}}

    def features(self, seq: Sequence) -> torch.Tensor | None:
        st = self.states.get(seq.seq_id)
        return st.feats[:st.num_feats] if st is not None else None

    def release(self, seq: Sequence) -> None:
        st = self.states.pop(seq.seq_id, None)
        self._drafted.pop(seq.seq_id, None)
        if st is not None:
            self.blocks.free(st.shadow)

    def kv_pools(self) -> list[torch.Tensor]:
        """The drafter's own KV pool ``kv`` ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
        return [self.kv]

    def packed_weights(self) -> list:
        """The kernel copies of ``fc`` and the shared LM-head rows (``EagleModel._packed``)."""
        return self.model.packed_weights()

    def drop_packed(self) -> None:
        self.model.drop_packed()

    def trainable_model(self) -> EagleModel:
        return self.model

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Queue new weights (thread-safe); they replace the current ones between steps."""
        with self._lock:
            self._pending = (version, state_dict)

    def swap(self) -> int:
        """Swap queued weights (``publish``) in now instead of before the next ``propose``;
        returns the version in use. Call it only between engine steps (an idle engine)."""
        self._swap()
        return self.version

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
        # shadow row j is keyed by tok_{j+1}; the last real row is always recomputed
        return st if sync_shadow(self.blocks, st.shadow, seq, 1, slots) else None

    @staticmethod
    def _block_tables(shadows: list[Sequence]) -> torch.Tensor:
        """``[b, W]`` int32: the shadows' block tables, zero-padded to the longest."""
        return padded_tensor([sh.block_table for sh in shadows], torch.int32)

    def _meta(self, shadows, qseq, slot_pos, kv_lens, base=None, mask=None):
        bs = self.blocks.block_size
        slots = [shadows[q].block_table[p // bs] * bs + p % bs for q, p in zip(qseq, slot_pos)]
        dev = self.kv.device
        meta = AttentionMetadata(
            slot_mapping=int_tensor(slots, torch.int64, dev),
            block_tables=self._block_tables(shadows).to(dev),
            query_seq=int_tensor(qseq, torch.int32, dev),
            kv_lens=int_tensor(kv_lens, torch.int32, dev),
            max_kv_len=max(kv_lens))
        if base is not None:
            meta.tree_base = int_tensor(base, torch.int32, dev)
            meta.tree_mask = mask.to(dev)
        return meta

    def _topk(self, feats: torch.Tensor, k: int, seqs: list[Sequence], positions: list[int],
              paths: list[list[int]] | None = None) -> list[list[tuple[int, float]]]:
        """Per row of ``feats`` ``[R, H]``: the top-k children as (target id, log-probability)
        by ``coupled_topk`` (row r drafts for ``seqs[r]`` at output position
        ``positions[r]``, after the draft tokens ``paths[r]``), best first; tokens of
        log-probability ``-inf`` are left out."""
        m = self.model
        logits = m.draft_logits(feats)
        values, indices = coupled_topk(logits, min(k, logits.shape[-1]), seqs, positions,
                                       m.config.vocab_size, m.vocab_map, paths)
        rows = zip(m.to_full_ids(indices).tolist(), values.tolist())
        return [[(t, lp) for t, lp in zip(ts, lps) if lp > -torch.inf] for ts, lps in rows]

    @staticmethod
    def _prefix_rows(seqs: list[Sequence], states: list[_State]) -> _Prefix:
        """The real rows of each sequence not in the drafter KV yet (then counted as cached)."""
        ids, feats, pos, qseq, last = [], [], [], [], []
        for b, (st, s) in enumerate(zip(states, seqs)):
            c, n = st.shadow.num_cached, len(s) - 1
            ids += s.token_ids[c + 1:n + 1]
            feats.append(st.feats[c:n])
            pos += range(c, n)
            qseq += [b] * (n - c)
            last.append(len(pos) - 1)
            st.shadow.num_cached = n
        return _Prefix(ids, torch.cat(feats), pos, qseq, last)

    def _feed_prefix(self, shadows: list[Sequence], prefix: _Prefix) -> torch.Tensor:
        """Forward 1 over the ``prefix`` rows. Returns ``[b, H]``: per sequence the predicted
        feature of position n (the depth-1 distribution), n = ``len(seq) - 1``. The rows
        before each sequence's last only write their K/V (a catch-up after the drafter sat
        out costs a K/V projection per token, not a layer)."""
        meta = self._meta(shadows, prefix.qseq, prefix.pos, [p + 1 for p in prefix.pos])
        dev = self.kv.device
        return self.model(torch.tensor(prefix.ids, device=dev), prefix.feats,
                          torch.tensor(prefix.pos, device=dev),
                          (self.kv[0], self.kv[1]), meta, self.backend,
                          torch.tensor(prefix.last, device=dev)
                          if len(prefix.last) < len(prefix.ids) else None)

    def _feed_depth(self, seqs: list[Sequence], shadows: list[Sequence],
                    cands: list[list[Candidate]],
                    frontier: list[list[int]], fed: list[list[int]],
                    feed_feat: list[torch.Tensor], depth: int) -> tuple[torch.Tensor, list]:
        """One drafter forward over the ``frontier`` candidates of every sequence (tree
        attention: each node sees the real prefix and its own ancestors), appended to ``fed``.
        Returns the predicted features ``[R, H]`` and per row ``(b, candidate, fed index)``."""
        ids, feats, pos, qseq, slot_pos, kv_lens, base, rows = [], [], [], [], [], [], [], []
        for b, s in enumerate(seqs):
            n = len(s) - 1
            for ci in frontier[b]:
                fed[b].append(ci)
                g = len(fed[b]) - 1
                ids.append(cands[b][ci].token)
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
                a = cands[b][a].parent
        meta = self._meta(shadows, qseq, slot_pos, kv_lens, base, mask)
        dev = self.kv.device
        f = self.model(torch.tensor(ids, device=dev), torch.cat(feats),
                       torch.tensor(pos, device=dev),
                       (self.kv[0], self.kv[1]), meta, self.backend)
        return f, rows

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
        live_seqs = [seqs[i] for i in live]
        shadows = [states[i].shadow for i in live]
        prefix = self._prefix_rows(live_seqs, [states[i] for i in live])
        n_out = [s.num_output_tokens for s in live_seqs]  # output position of depth-1 tokens
        trees = self._draft_in_extension(live_seqs, shadows, prefix, n_out, strategy)
        if trees is None:
            cands = self._grow(live_seqs, shadows, self._feed_prefix(shadows, prefix), n_out,
                               d, k)
            trees = [self._tree(c, strategy.budget) for c in cands]
        for tree, i in zip(trees, live):
            out[i] = tree
            self._drafted[seqs[i].seq_id] = self.version
        return out

    def _grow(self, live_seqs: list[Sequence], shadows: list[Sequence], f: torch.Tensor,
              n_out: list[int], d: int, k: int) -> list[list[Candidate]]:
        """The candidates of each sequence: depth-1 children of its root feature ``f[b]``, then
        per depth one drafter forward over the frontier (the ``k`` best new nodes)."""
        pen = any(s.params.has_penalties for s in live_seqs)  # draft paths are needed
        cands = [[Candidate(lp, 1, t, -1, lp) for t, lp in kids]
                 for kids in self._topk(f, k, live_seqs, n_out)]
        frontier = [list(range(len(c))) for c in cands]  # candidate indices to feed next
        fed: list[list[int]] = [[] for _ in live_seqs]  # candidate index of each fed node, in order
        feed_feat = [f[b:b + 1].expand(len(frontier[b]), -1) for b in range(len(live_seqs))]
        for depth in range(2, d + 1):
            f, rows = self._feed_depth(live_seqs, shadows, cands, frontier, fed, feed_feat, depth)
            kids = self._topk(f, k, [live_seqs[b] for b, _, _ in rows],
                              [n_out[b] + depth - 1 for b, _, _ in rows],
                              [_path(cands[b], ci) for b, ci, _ in rows] if pen else None)
            new = [[] for _ in live_seqs]
            for r, (b, ci, _) in enumerate(rows):
                cum = cands[b][ci].cum
                for t, lp in kids[r]:
                    cands[b].append(Candidate(cum + lp, depth, t, ci, lp))
                    new[b].append((len(cands[b]) - 1, r))
            if depth == d:
                break
            for b in range(len(live_seqs)):
                best = sorted(new[b], key=lambda x: -cands[b][x[0]].cum)[:k]
                frontier[b] = [c for c, _ in best]
                feed_feat[b] = f[[r for _, r in best]]
        return cands

    def _draft_in_extension(self, live_seqs: list[Sequence], shadows: list[Sequence],
                            prefix: _Prefix, n_out: list[int], strategy: Strategy
                            ) -> list[DraftTree] | None:
        """``_feed_prefix``, ``_grow`` and ``_tree`` in one extension call (``eagle_draft``,
        csrc/eagle_draft.cpp: the same kernels in the same order, so the same trees and
        drafter KV bit for bit), or None where it does not apply: no extension, weights not all
        packed for one CPU kernel, no draft vocabulary map, biases in the layer, batch
        invariance off, or a request with filters or penalties."""
        mod, m = ext(), self.model
        lay, t = m.layer, m.target
        if (mod is None or not hasattr(mod, "eagle_draft") or m.vocab_map is None
                or self.kv.device.type != "cpu" or lay.qkv_bias is not None
                or lay.o_bias is not None or not kernels.batch_invariant()
                or not all(plain_params(s.params, m.config.vocab_size) for s in live_seqs)):
            return None
        packs = [m._packed("fc", m.fc), lay.packed("qkv_proj"), lay.packed("o_proj"),
                 lay.packed("gate_up_proj"), lay.packed("down_proj"),
                 m._packed("head", m.head_weight())]
        kinds = {pw.kind for pw in packs}
        if (len(kinds) != 1 or None in kinds
                or any(pw.weight.dtype != prefix.feats.dtype for pw in packs)):
            return None
        fc, qkv, o, gate_up, down, head = packs
        params = [s.params for s in live_seqs]
        nodes, token, parent, logprob = mod.eagle_draft(
            prefix.ids, prefix.feats.contiguous(), prefix.pos, prefix.qseq, prefix.last,
            [t.embed_tokens, fc.packed, m.fc_bias, lay.input_norm, qkv.packed, o.packed,
             lay.post_attn_norm, gate_up.packed, down.packed, t.norm, head.packed, m.rope],
            [pw.weight.shape[0] for pw in packs], kernels.PACKED_KINDS.index(kinds.pop()),
            gate_up.glu, lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.scale, lay.eps,
            self.kv[0], self.kv[1], self._block_tables(shadows), [len(s) - 1 for s in live_seqs],
            self.blocks.block_size,
            torch.tensor([0.0 if p.greedy else p.temperature for p in params],
                         dtype=torch.float32),
            torch.tensor([0 if p.greedy else s.noise.key for s, p in zip(live_seqs, params)],
                         dtype=torch.int64),
            n_out, m.vocab_map, strategy.depth, strategy.topk, strategy.budget)
        return [DraftTree(ts[:n], ps[:n], lps[:n], ["eagle"] * n) for n, ts, ps, lps in
                zip(nodes.tolist(), token.tolist(), parent.tolist(), logprob.tolist())]

    @staticmethod
    def _tree(cands: list[Candidate], budget: int) -> DraftTree:
        """The ``budget`` best candidates by cumulative log-prob (ties: shallower first), as a
        tree whose children are ordered by log-prob."""
        order = sorted(range(len(cands)), key=lambda c: (-cands[c].cum, cands[c].depth))[:budget]
        keep = sorted(order, key=lambda c: (cands[c].depth, -cands[c].cum))
        index = {c: j for j, c in enumerate(keep)}
        return DraftTree([cands[c].token for c in keep],
                         [index[cands[c].parent] if cands[c].parent >= 0 else -1 for c in keep],
                         [cands[c].logprob for c in keep], ["eagle"] * len(keep))


def _path(cands: list[Candidate], c: int) -> list[int]:
    """The tokens from the root's child down to candidate ``c``."""
    out = []
    while c >= 0:
        out.append(cands[c].token)
        c = cands[c].parent
    return out[::-1]


def make_eagle(cfg, target, num_blocks: int, block_size: int) -> EagleDrafter:
    """The ``EagleDrafter`` for ``speculative_config`` ``cfg`` (method ``eagle``) and ``target``
    (a ``LoadedModel``). ``cfg.model``: a checkpoint directory; None: the drafter shipped for the
    target; ``"random"``: random weights (tests).

    Raises:
        ValueError: no shipped drafter for the target, or a checkpoint that does not fit it.
    """
    from specengine.engine.config import parse_dtype

    dtype = parse_dtype(cfg.draft_dtype) if cfg.draft_dtype else target.model.dtype
    if cfg.model == "random":
        model = EagleModel(EagleConfig.for_target(target), target.model, dtype).random_init()
    else:
        path, why = (cfg.model, {}) if cfg.model else shipped_drafters(target)
        if path is None:
            tried = "; ".join(f"{k}: {v}" for k, v in why.items()) or "none shipped"
            raise ValueError(f"speculative_config method='eagle' without 'model': no drafter "
                             f"is shipped for target {Path(target.model_dir).name!r} (checked "
                             f"by tokenizer, architecture and weight fingerprint; {tried}); "
                             "train one with `specengine train-drafter` and pass its directory")
        model = load_drafter(path, target, dtype)
    return EagleDrafter(cfg.strategy, model.to(target.model.device), num_blocks, block_size)
