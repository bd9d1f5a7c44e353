"""Training the EAGLE drafter (``drafters.eagle``): hidden-state harvesting, offline
self-distillation (``specengine train-drafter``) and online training with hot swap.

Data: per sequence, token ids ``[L]`` and the target's features ``[L-1, H]`` (post-norm last
hidden states of positions 0..L-2; the last token's feature is never computed in decoding).
They come for free from decoding (``Harvester``, the engine's ``observe`` hook) or from one
teacher-forced target forward (``teacher_force``).

Loss (EAGLE arXiv 2401.15077, EAGLE-3 arXiv 2503.01840), per unrolled step s with weight
``decay**s``: cross-entropy of the draft distribution against the target's distribution (soft
labels from the target's LM head, over the draft vocabulary) plus ``reg_weight`` times smooth-L1
between predicted and true next feature. Step 0 reads the true features (with uniform noise);
step s >= 1 reads step s-1's predictions (training-time test), so deep tree levels train on
what inference feeds them. The draft vocabulary (FR-Spec arXiv 2502.14856) is the most frequent
tokens of the training data.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specengine.jsonl import read_records
from specengine.sequence import Sequence
from specengine.speculative.drafters.base import Drafter
from specengine.speculative.drafters.eagle import (
    EagleConfig,
    EagleDrafter,
    EagleModel,
    load_drafter,
    load_state,
    save_drafter,
)
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree


# ---- harvesting -----------------------------------------------------------------------------
@dataclass
class Rollout:
    """One finished sequence: ``token_ids`` ``[L]`` and target features ``hidden`` ``[L-1, H]``
    (feature i belongs to position i)."""

    token_ids: list[int]
    hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size() + 8 * len(self.token_ids)


class HiddenBuffer:
    """Bounded FIFO of ``Rollout``s: at most ``max_items`` and ``max_bytes``; the oldest are
    dropped first. Thread-safe."""

    def __init__(self, max_items: int = 1024, max_bytes: int = 1 << 30):
        if max_items < 1 or max_bytes < 1:
            raise ValueError(f"HiddenBuffer max_items={max_items}, max_bytes={max_bytes}: "
                             "both must be >= 1")
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: deque[Rollout] = deque()
        self.nbytes = 0
        self.total_added = 0
        self._lock = threading.Lock()

    def add(self, r: Rollout) -> None:
        if len(r.token_ids) < 3 or r.nbytes > self.max_bytes:
            return
        with self._lock:
            self.items.append(r)
            self.nbytes += r.nbytes
            self.total_added += 1
            while len(self.items) > self.max_items or self.nbytes > self.max_bytes:
                self.nbytes -= self.items.popleft().nbytes

    def snapshot(self) -> list[Rollout]:
        with self._lock:
            return list(self.items)

    def __len__(self) -> int:
        return len(self.items)


class Harvester(Drafter):
    """Wraps a drafter (or none) and collects each finished sequence's tokens and target
    features into a ``HiddenBuffer`` through the engine's ``observe`` hook: no extra forward.

    Install with ``harvest(llm, buffer)``. Drafting is the inner drafter's (no inner: none).
    """

    name = "harvester"
    wants_hidden = True

    def __init__(self, inner: Drafter | None, buffer: HiddenBuffer):
        super().__init__(inner.strategy if inner is not None else None)
        self.inner, self.buffer = inner, buffer
        self.feats: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def propose(self, seqs: list[Sequence], strategy: Strategy) -> list[DraftTree | None]:
        if self.inner is None:
            return [None] * len(seqs)
        return self.inner.propose(seqs, strategy)

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        parts = self.feats.setdefault(seq.seq_id, [])
        while parts and parts[-1][0] >= start:  # recomputed after a preemption
            parts.pop()
        if parts and parts[-1][0] + parts[-1][1].shape[0] > start:
            s0, h = parts.pop()
            parts.append((s0, h[:start - s0]))
        parts.append((start, hidden.detach().clone()))
        if self.inner is not None and self.inner.wants_hidden:
            self.inner.observe(seq, start, hidden)

    def release(self, seq: Sequence) -> None:
        parts = self.feats.pop(seq.seq_id, None)
        if parts:
            hidden = torch.cat([h for _, h in parts])
            n = min(hidden.shape[0], len(seq) - 1)
            self.buffer.add(Rollout(list(seq.token_ids[:n + 1]), hidden[:n]))
        if self.inner is not None:
            self.inner.release(seq)


def harvest(llm, buffer: HiddenBuffer) -> Harvester:
    """Make ``llm`` (an ``LLM``) put every finished sequence into ``buffer``; returns the
    installed ``Harvester`` (it keeps any drafter the engine had)."""
    eng = llm.engine
    if isinstance(eng.drafter, Harvester):
        eng.drafter.buffer = buffer
        return eng.drafter
    eng.drafter = Harvester(eng.drafter, buffer)
    return eng.drafter


@torch.inference_mode()
def teacher_force(model, sequences: list[list[int]], max_batch_tokens: int = 4096,
                  block_size: int = 16) -> list[torch.Tensor]:
    """Target features of given token sequences with one prefill forward each (our model and
    KV cache, no other code path).

    Args:
        model: target ``LlamaForCausalLM``.
        sequences: token id lists (length >= 2, shorter than the model's max positions).
        max_batch_tokens: tokens per forward (sequences are packed up to it).

    Returns:
        per sequence ``[L-1, H]`` features (positions 0..L-2) in the model dtype.

    Raises:
        ValueError: a sequence shorter than 2 tokens or too long for the model.
    """
    from specengine.batch import BatchEntry
    from specengine.kv.block_manager import BlockManager
    from specengine.model_runner import ModelRunner
    from specengine.sampling import SampleNoise, SamplingParams

    limit = model.config.max_position_embeddings
    for i, s in enumerate(sequences):
        if not 2 <= len(s) <= limit:
            raise ValueError(f"sequence {i} has {len(s)} tokens; need 2..{limit}")
    longest = max((len(s) for s in sequences), default=1)
    budget = max(max_batch_tokens, longest)
    num_blocks = -(-budget // block_size) + len(sequences) + 1
    runner = ModelRunner(model, min(num_blocks, -(-budget // block_size) * 2 + 64), block_size)
    out: list[torch.Tensor | None] = [None] * len(sequences)
    i = 0
    params = SamplingParams()
    while i < len(sequences):
        bm = BlockManager(runner.kv_cache.shape[2], block_size, runner.copy_block)
        entries, idx, used = [], [], 0
        while i < len(sequences) and (not entries or used + len(sequences[i]) <= budget):
            s = Sequence("tf", 0, list(sequences[i]), params, SampleNoise(0, 0))
            if bm.num_free < -(-len(s) // block_size):
                break
            bm.allocate_shared([s])
            entries.append(BatchEntry(s, len(s), [s], is_prefill=True))
            idx.append(i)
            used += len(s)
            i += 1
        _, hidden = runner.run(entries, bm)
        off = 0
        for e, j in zip(entries, idx):
            out[j] = hidden[off:off + e.num_new - 1].clone()
            off += e.num_new
    return out


# ---- data -----------------------------------------------------------------------------------
def read_prompts(path: str | Path) -> list[dict]:
    """Records of a JSONL file: each needs ``prompt`` (str) or ``messages`` (chat list);
    optional ``response`` (str, used instead of generating). Bad lines are skipped with a
    warning.

    Raises:
        FileNotFoundError: no such file. ValueError: no usable line (says why lines failed).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training data {str(path)!r} does not exist")
    recs, errors = [], []
    for no, rec, err in read_records(path):
        if err is None and not (isinstance(rec.get("prompt"), str) and rec["prompt"].strip()
                                or isinstance(rec.get("messages"), list) and rec["messages"]):
            err = f"line {no}: needs a non-empty 'prompt' string or 'messages' list"
        if err is None and "response" in rec and not isinstance(rec["response"], str):
            err = f"line {no}: 'response' must be a string"
        if err is None:
            recs.append(rec)
        else:
            errors.append(err)
    if not recs:
        why = "; ".join(errors[:3]) if errors else "the file is empty"
        raise ValueError(f"training data {str(path)!r} has no usable lines ({why})")
    for e in errors[:5]:
        print(f"skipped {e}", file=sys.stderr)
    return recs


def encode_prompt(tokenizer, rec: dict) -> list[int]:
    """Prompt token ids of a record (chat template for ``messages``)."""
    if "messages" in rec:
        text = tokenizer.apply_chat_template(rec["messages"], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(rec["prompt"]).input_ids


def reduced_vocab(sequences: list[list[int]], size: int, vocab_size: int,
                  always: list[int] = ()) -> torch.Tensor:
    """FR-Spec draft vocabulary: the ``size`` most frequent ids (``always`` first), then the
    remaining ids in id order to fill up. Returns ``[size]`` int64."""
    counts = Counter(t for s in sequences for t in s)
    ids = list(dict.fromkeys([*always, *(t for t, _ in counts.most_common())]))[:size]
    if len(ids) < size:
        have = set(ids)
        ids += [t for t in range(vocab_size) if t not in have][:size - len(ids)]
    return torch.tensor(ids, dtype=torch.int64)


# ---- training -------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Hyper-parameters of ``fit``.

    Attributes:
        steps: optimizer steps. batch_tokens: tokens per step (sequences packed by length).
        lr, weight_decay, warmup: AdamW with linear warmup and cosine decay.
        unroll: training-time-test depth (steps fed their own predictions).
        warm_unroll_frac: the first ``warm_unroll_frac * steps`` steps train one step only
            (unroll 1, half the cost): the drafter learns the one-step map first, measured to
            reach a given top-1 agreement several times sooner than unrolling from the start.
        decay: weight of unrolled step s is ``decay**s``.
        reg_weight: weight of the smooth-L1 feature loss (cross-entropy has weight 1).
        noise: half-width of uniform noise on step-0 input features.
        max_len: longest sequence used (longer ones are cut).
        seed: everything random derives from it.
        autocast: run the drafter's matmuls in bfloat16 (float32 master weights and
            optimizer; softmax and losses in float32); None: on where the CPU computes bfloat16
            natively (AVX-512 BF16 or AMX), about 2x faster there.
    """

    steps: int = 1000
    batch_tokens: int = 2048
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 50
    unroll: int = 3
    warm_unroll_frac: float = 0.0
    decay: float = 0.8
    reg_weight: float = 0.5
    noise: float = 0.1
    max_len: int = 768
    seed: int = 0
    autocast: bool | None = None

    def __post_init__(self) -> None:
        if self.autocast is None:
            from specengine import kernels
            self.autocast = kernels.amx_available() or kernels.avx512_available(torch.bfloat16)

    def amp(self):
        """The autocast context of the drafter's forward (a no-op when ``autocast`` is off)."""
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(self.autocast))


def _batches(data: list[Rollout], batch_tokens: int, rng: random.Random, max_len: int):
    """Endless stream of lists of rollouts, about ``batch_tokens`` tokens each (padded size),
    grouped by similar length."""
    order = sorted(range(len(data)), key=lambda i: len(data[i].token_ids))
    groups, cur = [], []
    for i in order:
        n = min(len(data[i].token_ids), max_len)
        if cur and n * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    while True:
        rng.shuffle(groups)
        yield from groups


def _pad(rollouts: list[Rollout], max_len: int) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """``tokens [B, L]``, ``feats [B, L, H]`` float32 (feature L-1 and pads zero), ``valid``
    ``[B, L]`` bool (position has a real feature)."""
    L = min(max(len(r.token_ids) for r in rollouts), max_len)
    H = rollouts[0].hidden.shape[1]
    tokens = torch.zeros(len(rollouts), L, dtype=torch.int64)
    feats = torch.zeros(len(rollouts), L, H)
    valid = torch.zeros(len(rollouts), L, dtype=torch.bool)
    for b, r in enumerate(rollouts):
        n = min(len(r.token_ids), L)
        tokens[b, :n] = torch.tensor(r.token_ids[:n])
        m = min(r.hidden.shape[0], n)
        feats[b, :m] = r.hidden[:m].float()
        valid[b, :m] = True
    return tokens, feats, valid


def drafter_loss(model: EagleModel, tokens, feats, valid, cfg: TrainConfig,
                 generator: torch.Generator | None = None, train: bool = True,
                 unroll: int | None = None) -> dict:
    """Loss and per-step statistics of one padded batch (see module docstring).

    Returns:
        ``loss`` (scalar tensor), ``top1`` (list per step: draft argmax == target argmax over
        the draft vocabulary), ``ce``, ``reg`` (floats), ``tau`` (estimated greedy chain
        acceptance length: 1 + mean over rows of the leading run of steps whose draft argmax
        equals the target's and whose fed token was the target's argmax), ``rows``.
    """
    outs = model.unroll(tokens, feats, unroll or cfg.unroll, noise=cfg.noise if train else 0.0,
                        generator=generator)
    head = model.head_weight().detach()
    head = head.to(torch.bfloat16) if cfg.autocast else head.float()
    B, L = tokens.shape
    n, H = L - 1, feats.shape[2]
    with torch.no_grad():  # the target's next-token distribution after positions 1..L-1
        t_logits = feats[:, 1:] @ head.T  # [B, n, Vd]; index i: feature of position i + 1
        t_probs = torch.softmax(t_logits.float(), dim=-1)
        t_top = t_logits.argmax(-1)
    loss = torch.zeros(())
    stats = {"top1": [], "ce": 0.0, "reg": 0.0}
    rows, run, acc, base = 0, None, None, None
    for s, out in enumerate(outs):
        m = n - s  # rows j < m predict the feature of position j + 1 + s
        if m <= 0:
            stats["top1"].append(0.0)
            continue
        ok = valid[:, :m] & valid[:, 1 + s:1 + s + m]  # [B, m]
        sel = ok.reshape(-1)
        if not sel.any():
            stats["top1"].append(0.0)
            continue
        o = out[:, :m].reshape(-1, H)[sel]
        true = feats[:, 1 + s:1 + s + m].reshape(-1, H)[sel]
        p = t_probs[:, s:s + m].reshape(-1, t_probs.shape[2])[sel]
        logq = torch.log_softmax((o @ head.T).float(), dim=-1)
        ce = -(p * logq).sum(-1).mean()
        reg = F.smooth_l1_loss(o.float(), true)
        loss = loss + cfg.decay ** s * (ce + cfg.reg_weight * reg)
        with torch.no_grad():
            hit = torch.zeros(B, m, dtype=torch.bool)
            hit.view(-1)[sel] = logq.argmax(-1) == t_top[:, s:s + m].reshape(-1)[sel]
            stats["top1"].append(float(hit.view(-1)[sel].float().mean()))
            stats["ce"] += float(ce) / len(outs)
            stats["reg"] += float(reg) / len(outs)
            if s == 0:
                run, base, rows = hit, ok, int(ok.sum())
                acc = hit.float()
            else:
                # the token fed at step s is tok_{j+1+s}: it must be what the target chose
                fed_ok = tokens[:, 1 + s:1 + s + m] == model.to_full_ids(t_top[:, s - 1:s - 1 + m])
                run = run[:, :m] & hit & fed_ok
                acc[:, :m] += run.float()
    stats["loss"] = loss
    stats["tau"] = 1.0 + float(acc[base].mean()) if rows else 1.0
    stats["rows"] = rows
    return stats


def evaluate(model: EagleModel, data: list[Rollout], cfg: TrainConfig,
             batch_tokens: int = 4096) -> dict:
    """Mean top-1 agreement per step and estimated chain tau over ``data`` (no noise)."""
    model.eval()
    tot, top1, tau = 0, [0.0] * cfg.unroll, 0.0
    with torch.no_grad():
        gen = _batches(data, batch_tokens, random.Random(0), cfg.max_len)
        seen = 0
        for group in gen:
            if seen >= len(data):
                break
            seen += len(group)
            tokens, feats, valid = _pad([data[i] for i in group], cfg.max_len)
            with cfg.amp():
                st = drafter_loss(model, tokens, feats, valid, cfg, train=False)
            w = st["rows"]
            tot += w
            top1 = [a + b * w for a, b in zip(top1, st["top1"])]
            tau += st["tau"] * w
    return {"top1": [round(x / max(tot, 1), 4) for x in top1],
            "tau_chain_est": round(tau / max(tot, 1), 3), "rows": tot}


def trainable_copy(model: EagleModel) -> EagleModel:
    """A float32 copy of ``model`` (same shared target tensors) with gradients on."""
    vm = model.vocab_map
    copy = EagleModel(model.config, model.target, torch.float32, vm)
    load_state(copy, {k: v.float() for k, v in model.state_dict().items()}, "copy")
    for p in copy.parameters():
        p.requires_grad_(True)
    return copy


class Fitter:
    """Optimizer state over a trainable ``EagleModel``; ``step`` runs one update."""

    def __init__(self, model: EagleModel, cfg: TrainConfig):
        self.model, self.cfg = model, cfg
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                     weight_decay=cfg.weight_decay)
        self.step_no = 0
        self.gen = torch.Generator().manual_seed(cfg.seed)

    def lr(self) -> float:
        c, s = self.cfg, self.step_no
        if s < c.warmup:
            return c.lr * (s + 1) / c.warmup
        frac = (s - c.warmup) / max(1, c.steps - c.warmup)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def step(self, batch: list[Rollout]) -> dict:
        self.model.train()
        tokens, feats, valid = _pad(batch, self.cfg.max_len)
        warm = self.step_no < self.cfg.warm_unroll_frac * self.cfg.steps
        with self.cfg.amp():
            st = drafter_loss(self.model, tokens, feats, valid, self.cfg, self.gen,
                              unroll=1 if warm else None)
        for g in self.opt.param_groups:
            g["lr"] = self.lr()
        self.opt.zero_grad(set_to_none=True)
        st["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.step_no += 1
        st["loss"] = float(st["loss"].detach())
        return st


def fit(model: EagleModel, train: list[Rollout], val: list[Rollout], cfg: TrainConfig,
        out_dir: str | Path | None = None, save_every: int = 200, progress: bool = True,
        save_dtype: torch.dtype = torch.bfloat16, log=None, until: int | None = None) -> dict:
    """Train ``model`` (a trainable copy, see ``trainable_copy``) on ``train`` for ``cfg.steps``
    steps (or stop at step ``until``); resumable from ``out_dir/train_state.pt`` (weights,
    optimizer, step, noise RNG; the batch order is replayed from ``cfg.seed``), so an
    interrupted run ends where an uninterrupted one would; deterministic for ``cfg.seed`` given
    the same data. Saves the drafter into ``out_dir`` every ``save_every`` steps and at the end.
    Returns the validation summary (empty without ``val``)."""
    from tqdm.auto import tqdm

    torch.manual_seed(cfg.seed)
    fitter = Fitter(model, cfg)
    rng = random.Random(cfg.seed)
    state_path = Path(out_dir) / "train_state.pt" if out_dir else None
    if state_path is not None and state_path.is_file():
        st = torch.load(state_path, weights_only=False)
        load_state(model, st["model"], str(state_path))
        fitter.opt.load_state_dict(st["opt"])
        fitter.step_no = st["step"]
        fitter.gen.set_state(st["gen"])
    batches = _batches(train, cfg.batch_tokens, rng, cfg.max_len)
    # the stream is a pure function of rng: replaying it is how resuming stays deterministic
    for _ in range(fitter.step_no):
        next(batches)
    bar = tqdm(total=cfg.steps, initial=fitter.step_no, desc="train-drafter", disable=not progress)
    ema = None
    while fitter.step_no < cfg.steps:
        st = fitter.step([train[i] for i in next(batches)])
        if ema is None or len(ema["top1"]) != len(st["top1"]):  # (re)start: unroll changed
            ema = st
        ema = {k: 0.9 * ema[k] + 0.1 * st[k] for k in ("loss", "tau")} \
            | {"top1": [0.9 * a + 0.1 * b for a, b in zip(ema["top1"], st["top1"])]}
        bar.update(1)
        bar.set_postfix(loss=f"{ema['loss']:.3f}", top1=f"{ema['top1'][0]:.3f}",
                        tau=f"{ema['tau']:.2f}")
        if log is not None and fitter.step_no % 20 == 0:
            log(f"step {fitter.step_no} loss {ema['loss']:.4f} top1 "
                f"{[round(x, 3) for x in ema['top1']]} tau~{ema['tau']:.3f}")
        if out_dir and (fitter.step_no % save_every == 0 or fitter.step_no == cfg.steps):
            save_drafter(model, out_dir, save_dtype)
            torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                        "opt": fitter.opt.state_dict(), "step": fitter.step_no,
                        "gen": fitter.gen.get_state()}, state_path)
        if until is not None and fitter.step_no >= until:
            break
    bar.close()
    return evaluate(model, val, cfg) if val else {}


# ---- the `train-drafter` command ------------------------------------------------------------
def add_cli(sub) -> None:
    """Register ``specengine train-drafter`` on an argparse subparsers object."""
    t = sub.add_parser("train-drafter", help="train an EAGLE drafter by self-distillation")
    t.add_argument("--model", default="smollm2-135m-instruct", help="target model")
    t.add_argument("--data", required=True,
                   help="JSONL: 'prompt' or 'messages' per line, optional 'response'")
    t.add_argument("--out", required=True, help="checkpoint directory to write")
    t.add_argument("--max-tokens", type=int, default=256, help="response length when generating")
    t.add_argument("--temperatures", default="0,1",
                   help="sampling temperatures used round-robin over prompts when generating")
    t.add_argument("--draft-vocab", type=int, default=8192, help="FR-Spec draft vocabulary size")
    t.add_argument("--val-frac", type=float, default=0.05)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-tokens", type=int, default=2048)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--unroll", type=int, default=3)
    t.add_argument("--warm-unroll-frac", type=float, default=0.0,
                   help="fraction of the steps trained with unroll 1 before unrolling")
    t.add_argument("--noise", type=float, default=0.1)
    t.add_argument("--reg-weight", type=float, default=0.5)
    t.add_argument("--max-len", type=int, default=768)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="target dtype for generation and features")
    t.add_argument("--init", default=None, help="start from this drafter checkpoint")
    t.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    t.add_argument("--max-num-seqs", type=int, default=96,
                   help="sequences decoded at once while generating responses")
    t.add_argument("--no-progress", action="store_true")


def collect(llm, recs: list[dict], max_tokens: int, temperatures: list[float], seed: int,
            progress: bool = True) -> list[Rollout]:
    """Rollouts for ``recs``: given responses are teacher-forced, the others generated by
    ``llm`` (features harvested while decoding)."""
    from specengine.sampling import SamplingParams

    tok = llm.get_tokenizer()
    given, gen_ids, gen_params = [], [], []
    for i, rec in enumerate(recs):
        ids = encode_prompt(tok, rec)
        if "response" in rec:
            given.append(ids + tok(rec["response"], add_special_tokens=False).input_ids)
        elif len(ids) < llm.engine_config.max_model_len - 1:
            gen_ids.append(ids)
            gen_params.append(SamplingParams(temperature=temperatures[i % len(temperatures)],
                                             max_tokens=max_tokens, seed=seed + i))
    out = []
    if given:
        limit = llm.engine_config.max_model_len
        given = [g[:limit] for g in given if len(g) >= 3]
        out += [Rollout(s, h) for s, h in zip(given, teacher_force(llm.engine.runner.model,
                                                                    given))]
    if gen_ids:
        buf = HiddenBuffer(max_items=len(gen_ids) + 1, max_bytes=1 << 40)
        h = harvest(llm, buf)
        try:
            llm.generate([{"prompt_token_ids": p} for p in gen_ids], gen_params,
                         use_tqdm=progress)
        finally:
            llm.engine.drafter = h.inner
        out += buf.snapshot()
    return out


def train_drafter_main(args) -> int:
    """``specengine train-drafter``: generate (or read) responses, train, save, evaluate."""
    from specengine.api import LLM

    t0 = time.perf_counter()
    try:
        recs = read_prompts(args.data)
        temps = [float(x) for x in str(args.temperatures).split(",") if x.strip()]
        if not temps or any(t < 0 for t in temps):
            raise ValueError(f"--temperatures {args.temperatures!r}: need numbers >= 0")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "train_log.txt", "a", encoding="utf-8")

    def log(msg: str) -> None:
        logf.write(f"[{time.perf_counter() - t0:7.1f}s] {msg}\n")
        logf.flush()

    torch.manual_seed(args.seed)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_len + args.max_tokens,
              seed=args.seed, max_num_seqs=args.max_num_seqs)
    loaded = _loaded(llm)
    cache = out / "rollouts.pt"
    if cache.is_file():
        data = [Rollout(t, h) for t, h in torch.load(cache, weights_only=False)]
        log(f"loaded {len(data)} rollouts from {cache}")
    else:
        data = collect(llm, recs, args.max_tokens, temps, args.seed, not args.no_progress)
        torch.save([(r.token_ids, r.hidden) for r in data], cache)
        log(f"collected {len(data)} rollouts, {sum(len(r.token_ids) for r in data)} tokens")
    rng = random.Random(args.seed)
    order = list(range(len(data)))
    rng.shuffle(order)
    n_val = max(1, int(len(data) * args.val_frac)) if len(data) > 1 else 0
    val = [data[i] for i in order[:n_val]]
    train = [data[i] for i in order[n_val:]]
    if not train:
        print("error: no training sequences were produced", file=sys.stderr)
        return 2
    if args.init:
        base = load_drafter(args.init, loaded, torch.float32)
    else:
        eos = list(loaded.config.eos_token_ids)
        vmap = reduced_vocab([r.token_ids for r in train], args.draft_vocab,
                             loaded.config.vocab_size, eos)
        ecfg = EagleConfig.for_target(loaded, draft_vocab_size=len(vmap))
        base = EagleModel(ecfg, loaded.model, torch.float32, vmap).random_init(args.seed)
    model = trainable_copy(base)
    cfg = TrainConfig(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr,
                      unroll=args.unroll, warm_unroll_frac=args.warm_unroll_frac,
                      noise=args.noise, reg_weight=args.reg_weight,
                      max_len=args.max_len, seed=args.seed)
    counts = Counter(t for r in train for t in r.token_ids)
    covered = sum(counts[t] for t in model.vocab_map.tolist()) if model.vocab_map is not None \
        else sum(counts.values())
    model.config.training = {
        "data": str(args.data), "prompts": len(recs), "train_sequences": len(train),
        "val_sequences": len(val), "train_tokens": sum(len(r.token_ids) for r in train),
        "draft_vocab_coverage": round(covered / max(1, sum(counts.values())), 4),
        "temperatures": temps, "max_tokens": args.max_tokens, **asdict(cfg),
        "args": {k: v for k, v in vars(args).items() if k != "func"}}
    summary = fit(model, train, val, cfg, out, save_every=args.save_every,
                  progress=not args.no_progress, log=log)
    model.config.training["val"] = summary
    save_drafter(model, out, torch.bfloat16)
    log(f"done: {summary}")
    print(json.dumps({"out": str(out), "val": summary,
                      "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


def _loaded(llm):
    """A ``LoadedModel`` view of an ``LLM`` (model, config, tokenizer, model_dir)."""
    from specengine.models.loader import LoadedModel

    m = llm.engine.runner.model
    return LoadedModel(m, m.config, llm.tokenizer, llm.model_dir)


# ---- online training ------------------------------------------------------------------------
class DrafterTrainer:
    """Trains an ``EagleDrafter``'s weights in a background thread on harvested rollouts and
    publishes new versions; the drafter swaps them in between engine steps (outputs never
    change: verification is lossless whatever the drafter).

    Args:
        drafter: the engine's ``EagleDrafter``.
        buffer: filled by a ``Harvester`` on the same engine (``harvest(llm, buffer)``).
        cfg: training hyper-parameters (``cfg.steps`` is the schedule length).
        publish_every: optimizer steps between published versions.
        min_rollouts: wait for this many rollouts before training.

    Use ``start(max_steps=None, max_seconds=None)``, ``stop()``, or ``train_now(steps)`` to run
    synchronously. ``versions`` lists ``(version, step, seconds)``.
    """

    def __init__(self, drafter: EagleDrafter, buffer: HiddenBuffer, cfg: TrainConfig | None = None,
                 publish_every: int = 20, min_rollouts: int = 4):
        self.drafter, self.buffer = drafter, buffer
        self.cfg = cfg or TrainConfig(steps=200, warmup=10, lr=5e-4)
        self.model = trainable_copy(drafter.model)
        self.fitter = Fitter(self.model, self.cfg)
        self.publish_every, self.min_rollouts = publish_every, min_rollouts
        self.version = drafter.version
        self.versions: list[tuple[int, int, float]] = []
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = random.Random(self.cfg.seed)

    def _batch(self) -> list[Rollout] | None:
        data = self.buffer.snapshot()
        if len(data) < self.min_rollouts:
            return None
        self._rng.shuffle(data)
        batch, used = [], 0
        for r in data:
            n = min(len(r.token_ids), self.cfg.max_len)
            if batch and (len(batch) + 1) * max(used, n) > self.cfg.batch_tokens:
                break
            batch.append(r)
            used = max(used, n)
        return batch

    def publish(self) -> int:
        """Hand the current weights to the drafter as a new version; returns it."""
        self.version += 1
        dtype = self.drafter.model.fc.dtype
        sd = {k: v.detach().to(dtype).clone() for k, v in self.model.state_dict().items()}
        self.drafter.publish(sd, self.version)
        self.versions.append((self.version, self.fitter.step_no, time.perf_counter()))
        return self.version

    def train_now(self, steps: int) -> int:
        """Run ``steps`` updates in this thread (fewer if the buffer is too small), publish;
        returns the steps run."""
        done = 0
        for _ in range(steps):
            batch = self._batch()
            if batch is None:
                break
            self.last = self.fitter.step(batch)
            done += 1
        if done:
            self.publish()
        return done

    def start(self, max_steps: int | None = None, max_seconds: float | None = None) -> None:
        """Train in a background thread until ``stop``, ``max_steps`` or ``max_seconds``."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("DrafterTrainer is already running")
        self._stop.clear()

        def loop():
            t0, n = time.perf_counter(), 0
            while not self._stop.is_set():
                if max_steps is not None and n >= max_steps:
                    break
                if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                    break
                batch = self._batch()
                if batch is None:
                    self._stop.wait(0.05)
                    continue
                self.last = self.fitter.step(batch)
                n += 1
                if n % self.publish_every == 0:
                    self.publish()
            if n % self.publish_every:
                self.publish()

        self._thread = threading.Thread(target=loop, name="drafter-trainer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to finish (it publishes what it has) and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
