"""EAGLE drafter drift: tau and tokens/s when the target moves under its drafter, one run.

The RL situation: after a policy update the target changes; an EAGLE drafter shares its
embedding, final norm and LM head (they follow ``LLM.update_weights``) but its own layer was
trained on the old target. Three stages, each measured with the speculative engine and with
plain decoding of the same target (the baseline of every ratio):

  (i)   original: ``smollm2-135m-instruct`` with the shipped EAGLE drafter (or ``--drafter``).
  (ii)  changed: a few AdamW steps of the transformers model (float32, loaded from the same HF
        directory the engine reads, i.e. the dequantized GGUF in the cache) on other text
        (HumanEval code prompts, next-token loss), pushed into both bfloat16 engines with
        ``LLM.update_weights``; the drafter is now stale.
  (iii) retrained: the drafter trained online (``DrafterTrainer.train_now``, a fixed number of
        steps) on rollouts of the changed target, harvested while the plain engine decodes
        other prompts of the same kind (``harvest``: features come from the decode steps, no
        extra forward; the speculative engine would give the same rollouts), then hot-swapped
        in.

Prompts: GSM-style questions from ``specengine.data.prompt_sets.gsm_questions(n, seed=1234)``
through the chat template; the first ``--prompts`` are measured (greedy, batch ``--batch``), the
next
``--train-prompts`` only feed the harvest (sampled at ``--harvest-temperature``, seeded): the
measured prompts are never trained on.

Per row: tok/s and tau as in ``bench_spec.py`` (decode tokens / decode wall time; tokens
committed per target forward of a speculative step), speedup over plain decoding of the same
target, mismatch (greedy outputs that differ from plain decoding of the same target; bfloat16
near-ties can flip one, float32 never does), and for the plain rows of (ii) how many outputs
the target change altered. Also printed: the target's greedy agreement with the original on
the original's outputs (how far it moved, independent of the drafter), the drafter versions and
tau per version (``get_metrics()``; version 0 covers stages (i) and (ii)), the fine-tuning
loss, harvest and training time.

    python bench/bench_drift.py [--out drift.json]   # 8 prompts, 128 tokens, 200 train steps
    python bench/bench_drift.py --quick              # 3 prompts, 64 tokens, 40 train steps
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from bench_spec import llm_kwargs, mismatches, run_engine
from common import machine_info, markdown_table, quiet_transformers, stderr_logger, write_json

from specengine import LLM, SamplingParams
from specengine.data.prompt_sets import gsm_questions, humaneval_prompts
from specengine.models.loader import resolve_model
from specengine.speculative.training.fit import TrainConfig
from specengine.speculative.training.harvest import HiddenBuffer, harvest, teacher_force
from specengine.speculative.training.online import DrafterTrainer

MODEL = "smollm2-135m-instruct"


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block on ``n`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fine_tune(model_dir, tok, steps: int, lr: float, batch: int, length: int) -> tuple:
    """``steps`` AdamW steps of the transformers model of ``model_dir`` (float32) on windows of
    ``batch x length`` tokens of concatenated HumanEval prompts; returns (model, losses)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok("\n\n".join(p["prompt"] for p in humaneval_prompts()),
              return_tensors="pt").input_ids[0]
    windows = ids[:len(ids) // length * length].view(-1, length)
    opt = torch.optim.AdamW(hf.parameters(), lr=lr)
    losses = []
    hf.train()
    for s in range(steps):
        x = windows[torch.arange(s * batch, (s + 1) * batch) % len(windows)]
        loss = hf(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return hf.eval(), losses


def agreement(model, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Share of output positions where ``model``'s greedy token (teacher-forced on
    prompt + output) is the output token: 1.0 for the model that produced ``outputs`` (up to
    bfloat16 near-ties); how much of the original's greedy text a changed target keeps."""
    seqs = [p + o for p, o in zip(prompts, outputs)]
    hits = total = 0
    for p, o, h in zip(prompts, outputs, teacher_force(model, seqs)):
        pred = model.compute_logits(h[len(p) - 1:]).argmax(-1)
        hits += int((pred == torch.tensor(o)).sum())
        total += len(o)
    return hits / max(total, 1)


def interleaved(llms: list[LLM], prompts: list[list[int]], batch: int,
                params: list[SamplingParams], repeats: int) -> list[dict]:
    """``bench_spec.run_engine`` of each engine over ``prompts``, the engines taking turns per
    group of ``batch`` prompts (a shared machine's slow phases then hit all alike); per engine
    the summed counters, ``tok_s``, ``tau`` and ``outputs``."""
    parts = [[] for _ in llms]
    for i in range(0, len(prompts), batch):
        for llm, part in zip(llms, parts):
            part.append(run_engine(llm, prompts[i:i + batch], batch, params[i:i + batch],
                                   repeats))
    out = []
    for part in parts:
        d = {k: sum(r[k] for r in part) for k in
             ("requests", "generated_tokens", "prefill_time", "wall_s", "spec_steps",
              "accepted_tokens", "draft_time", "decode_time")}
        d["tok_s"] = (d["generated_tokens"] - d["requests"]) / max(
            d["wall_s"] - d["prefill_time"], 1e-9)
        d["tau"] = (d["accepted_tokens"] + d["spec_steps"]) / d["spec_steps"] \
            if d["spec_steps"] else 1.0
        d["outputs"] = [o for r in part for o in r["outputs"]]
        out.append(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="3 prompts, 64 tokens, 16 harvest prompts, 40 train steps")
    ap.add_argument("--out", help="write results as JSON here")
    ap.add_argument("--drafter", help="EAGLE checkpoint directory (default: the shipped one)")
    ap.add_argument("--prompts", type=int, help="measured prompts (default 8; 3 with --quick)")
    ap.add_argument("--train-prompts", type=int,
                    help="prompts whose rollouts train the drafter (default 64; 16 with --quick)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per request (default 128; 64 "
                    "with --quick)")
    ap.add_argument("--batch", type=int, default=1, help="batch of the measured runs")
    ap.add_argument("--tree", default="4,2,8",
                    help="depth,topk,budget of the static draft tree (4,1,4: a chain)")
    ap.add_argument("--ft-steps", type=int, default=16, help="AdamW steps changing the target")
    ap.add_argument("--ft-lr", type=float, default=5e-4)
    ap.add_argument("--ft-batch", type=int, default=2, help="sequences per fine-tuning step")
    ap.add_argument("--ft-len", type=int, default=128, help="tokens per fine-tuning sequence")
    ap.add_argument("--harvest-temperature", type=float, default=1.0)
    ap.add_argument("--train-steps", type=int,
                    help="online drafter training steps (default 200; 40 with --quick)")
    ap.add_argument("--train-lr", type=float, default=5e-4)
    ap.add_argument("--train-batch-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1, help="runs per row, best kept")
    ap.add_argument("--threads", type=int, help="torch threads of the measured runs "
                    "(default: torch's)")
    ap.add_argument("--train-threads", type=int, default=1,
                    help="torch threads of the fine-tuning and the drafter training (not "
                    "measured); one is immune to the OpenMP barrier stalls that make them "
                    "5-10x slower on a busy 2-core machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    q = args.quick
    n_eval = args.prompts or (3 if q else 8)
    n_train = args.train_prompts or (16 if q else 64)
    max_tokens = args.max_tokens or (64 if q else 128)
    train_steps = args.train_steps if args.train_steps is not None else (40 if q else 200)
    depth, topk, budget = (int(x) for x in args.tree.split(","))
    from transformers import AutoTokenizer
    quiet_transformers()

    start = time.perf_counter()
    log = stderr_logger(start)
    info = machine_info()
    model_dir = resolve_model(MODEL)
    log(f"drift benchmark: {MODEL} bfloat16, {n_eval} prompts at batch {args.batch}, "
        f"{max_tokens} tokens, tree {args.tree}; threads={info['torch_threads']}")
    tok = AutoTokenizer.from_pretrained(model_dir)

    def chat(question: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        return tok(text, add_special_tokens=False).input_ids

    qs = [chat(x["question"]) for x in gsm_questions(n_eval + n_train, seed=1234)]
    eval_ps, train_ps = qs[:n_eval], qs[n_eval:]
    kw = llm_kwargs(MODEL, "bfloat16", {"all": qs}, max_tokens, budget)
    spec_cfg = {"method": "eagle", "model": args.drafter, "policy": "static",
                "num_speculative_tokens": depth, "topk": topk, "num_verify_tokens": budget}
    plain = LLM(MODEL, **kw)
    spec = LLM(MODEL, speculative_config=spec_cfg, **kw)
    drafter = spec.engine.drafter
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in (plain, spec):
        llm.generate([{"prompt_token_ids": eval_ps[0]}], warm, use_tqdm=False)
    log(f"engines built; drafter {args.drafter or 'shipped'} (draft vocab "
        f"{drafter.model.config.draft_vocab_size})")
    greedy = [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * n_eval
    results, first_plain = [], None

    def measure(stage: str) -> None:
        nonlocal first_plain
        base, r = interleaved([plain, spec], eval_ps, args.batch, greedy, args.repeats)
        base.update(stage=stage, method="no spec", speedup=1.0, mismatch=None)
        k, first = mismatches(r["outputs"], base["outputs"])
        r.update(stage=stage, method=f"eagle d{depth} k{topk} m{budget}",
                 speedup=r["tok_s"] / base["tok_s"], mismatch=k, first_mismatch=first,
                 drafter_version=drafter.version)
        if first_plain is None:
            first_plain = base["outputs"]
        else:
            base["changed_vs_original"] = mismatches(base["outputs"], first_plain)[0]
        results.extend([base, r])
        log(f"{stage}: plain {base['tok_s']:.1f} tok/s; eagle {r['tok_s']:.1f} tok/s, "
            f"tau {r['tau']:.2f}, mismatch {k}/{n_eval}")

    measure("original")
    target = plain.engine.runner.model
    agree_before = agreement(target, eval_ps, first_plain)

    t0 = time.perf_counter()
    with torch_threads(args.train_threads):
        hf, losses = fine_tune(model_dir, tok, args.ft_steps, args.ft_lr, args.ft_batch,
                               args.ft_len)
    for llm in (plain, spec):
        names = llm.update_weights(hf.named_parameters())
    ft_s = time.perf_counter() - t0
    del hf
    agree = agreement(target, eval_ps, first_plain)
    log(f"changed the target: {args.ft_steps} AdamW steps (lr {args.ft_lr}), loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}, {len(names)} tensors updated, {ft_s:.0f}s; "
        f"greedy agreement with the original on its outputs {agree:.3f} "
        f"(original itself: {agree_before:.3f})")
    measure("changed")

    t0 = time.perf_counter()
    buf = HiddenBuffer(max_items=n_train + 1, max_bytes=1 << 34)
    h = harvest(plain, buf)
    sampled = [SamplingParams(temperature=args.harvest_temperature, max_tokens=max_tokens,
                              seed=1000 + i) for i in range(n_train)]
    plain.generate([{"prompt_token_ids": p} for p in train_ps], sampled, use_tqdm=False)
    plain.engine.drafter = h.inner
    harvest_s = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in buf.snapshot())
    log(f"harvested {len(buf)} rollouts ({tokens} tokens) of the changed target in "
        f"{harvest_s:.0f}s")
    cfg = TrainConfig(steps=train_steps, batch_tokens=args.train_batch_tokens,
                      lr=args.train_lr, warmup=max(1, train_steps // 10), unroll=2, max_len=384)
    trainer = DrafterTrainer(drafter, buf, cfg, min_rollouts=1)
    t_train = time.perf_counter()
    with torch_threads(args.train_threads):
        done = trainer.train_now(train_steps)
    train_s = time.perf_counter() - t_train
    log(f"trained the drafter online: {done} steps in {train_s:.0f}s, last loss "
        f"{trainer.last.get('loss', float('nan')):.3f}; version {trainer.version}")
    measure("retrained")

    m = spec.get_metrics()
    rows = [[r["stage"], r["method"], r["tok_s"], r["tau"], r["speedup"],
             f"{r['mismatch']}/{n_eval}" if r["mismatch"] is not None else None,
             f"{r['changed_vs_original']}/{n_eval}" if "changed_vs_original" in r else None]
            for r in results]
    print(markdown_table(["stage", "method", "tok/s", "tau", "speedup", "mismatch",
                          "outputs changed vs original"], rows) + "\n")
    tau = {r["stage"]: r["tau"] for r in results if r["method"] != "no spec"}
    print(f"tau: original {tau['original']:.2f} -> changed (stale drafter) "
          f"{tau['changed']:.2f} -> retrained {tau['retrained']:.2f}")
    print(f"drafter_version {m['drafter_version']}, tau_per_version {m['tau_per_version']}")
    print(f"target change: {args.ft_steps} AdamW steps lr {args.ft_lr} on HumanEval prompts, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f} ({ft_s:.0f}s), greedy agreement with "
          f"the original on its outputs {agree:.3f}; harvest {len(buf)} "
          f"rollouts, {tokens} tokens ({harvest_s:.0f}s); training {done} steps "
          f"({train_s:.0f}s)")
    mismatched = sum(r["mismatch"] or 0 for r in results)
    print(f"lossless (greedy): {'PASS' if mismatched == 0 else 'FAIL'}  {mismatched} of "
          f"{3 * n_eval} speculative outputs differ from plain decoding of the same target")
    if args.out:
        for r in results:
            r.pop("outputs", None)
        doc = {"machine": info, "args": vars(args), "model": MODEL, "dtype": "bfloat16",
               "max_tokens": max_tokens, "engine_kwargs": kw, "speculative_config": spec_cfg,
               "prompts": {"measured": n_eval, "train": n_train,
                           "prompt_tokens": [len(p) for p in eval_ps]},
               "fine_tune": {"steps": args.ft_steps, "lr": args.ft_lr, "batch": args.ft_batch,
                             "length": args.ft_len, "losses": losses, "seconds": ft_s,
                             "tensors_updated": len(names), "agreement": agree,
                             "agreement_before": agree_before},
               "harvest": {"rollouts": len(buf), "tokens": tokens, "seconds": harvest_s,
                           "temperature": args.harvest_temperature},
               "training": {"steps": done, "seconds": train_s, "config": vars(cfg),
                            "versions": [(v, step, t - t_train) for v, step, t in
                                         trainer.versions], "last": trainer.last},
               "drafter_version": m["drafter_version"],
               "tau_per_version": m["tau_per_version"], "results": results,
               "lossless": {"mismatched": mismatched, "compared": 3 * n_eval},
               "seconds": time.perf_counter() - start}
        write_json(args.out, doc)
        log(f"wrote {args.out}")
    log("done")


if __name__ == "__main__":
    main()
