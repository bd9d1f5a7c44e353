"""Fitting the EAGLE drafter (``drafters.eagle``) to harvested ``SequenceFeatures``:
``TrainConfig``, the loss (``drafter_loss``), ``evaluate``, one optimizer step (``Fitter``), a
whole resumable run (``fit``), and the FR-Spec draft vocabulary (``reduced_vocab``).

Loss (EAGLE arXiv 2401.15077, EAGLE-3 arXiv 2503.01840), per unrolled step s with weight
``decay**s``: cross-entropy of the draft distribution against the target's distribution (soft
labels from the target's LM head, over the draft vocabulary) plus ``reg_weight`` times smooth-L1
between predicted and true next feature. Step 0 reads the true features (with uniform noise);
step s >= 1 reads step s-1's predictions (training-time test), so deep tree levels train on
what inference feeds them. The draft vocabulary (FR-Spec arXiv 2502.14856) is the most frequent
tokens of the training data.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specengine.ops import kernels
from specengine.speculative.drafters.eagle import EagleModel, load_state, save_drafter
from specengine.speculative.training.harvest import SequenceFeatures


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
            self.autocast = kernels.amx_available() or kernels.avx512_available(torch.bfloat16)

    def amp(self):
        """The autocast context of the drafter's forward (a no-op when ``autocast`` is off)."""
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(self.autocast))


def _batches(data: list[SequenceFeatures], batch_tokens: int, rng: random.Random,
             max_len: int):
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


def _pad(rollouts: list[SequenceFeatures], max_len: int) -> tuple[torch.Tensor, torch.Tensor,
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


def evaluate(model: EagleModel, data: list[SequenceFeatures], cfg: TrainConfig,
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

    def step(self, batch: list[SequenceFeatures]) -> dict:
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


def fit(model: EagleModel, train: list[SequenceFeatures], val: list[SequenceFeatures],
        cfg: TrainConfig, out_dir: str | Path | None = None, save_every: int = 200,
        progress: bool = True,
        save_dtype: torch.dtype = torch.bfloat16, log=None, until: int | None = None) -> dict:
    """Train ``model`` (a trainable copy, see ``trainable_copy``) on ``train`` for ``cfg.steps``
    steps (or stop at step ``until``); resumable from ``out_dir/train_state.pt`` (weights,
    optimizer, step, noise RNG; the batch order is replayed from ``cfg.seed``), so an
    interrupted run ends where an uninterrupted one would; deterministic for ``cfg.seed`` given
    the same data. Saves the drafter into ``out_dir`` every ``save_every`` steps and at the end.
    Returns the validation summary (empty without ``val``)."""
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
