"""Multi-epoch RL rollouts: does speculation pay when the same prompts come back? One run.

    python bench/bench_rl.py --rollout-epochs 3 [--out bench/results/rl_epochs.json]
    python bench/bench_rl.py --rollout-epochs 3 --quick        # 4 prompts x 4, 256 tokens

The workload of reasoning RL (GRPO): ``--prompts`` held-out GSM-style questions
(``gsm_questions(seed=1234)``; the shipped EAGLE drafter trained on seed 0) through the chat
template, each sampled ``--n`` times at T = 1 (seeded per epoch and prompt) with a long
``--max-tokens`` cap, revisited for ``--epochs`` epochs. Between epochs the target moves the way
a policy update moves it: ``--drift-steps`` AdamW steps of the transformers model (float32, lr
``--drift-lr``) on other text (HumanEval prompts, next-token loss), pushed into every engine
with ``LLM.update_weights`` (the weight version goes up; the rollout memory ages its history).

Engines (bfloat16, one per row, ``policy: auto``, or ``--policy static``: the same tree shape
verified in every row and step, so tau compares at the same verify budget), run in lockstep:
each round steps every row's engine once, in turn, so all rows see the machine at the same
moments, and each row's wall time counts only its own steps:
``off`` (no speculation), ``suffix`` (rollout memory: siblings + history + own text),
``eagle`` (the shipped drafter, frozen), ``suffix+eagle`` (one merged tree), and on request
``eagle-dir`` (the EAGLE drafter at ``--drafter-dir``, to compare two drafters in one run),
``eagle-online`` (the shipped drafter trained further after each epoch, as an RL trainer's
step would leave time for: ``--online-steps`` AdamW steps, ``DrafterTrainer.train_now``, on the
finished samples of its own rollouts so far with their target features, harvested while it
decodes; the training seconds are reported apart, not in the rollout's wall time),
``ngram`` and ``off-control`` (a second engine without speculation: engines in one process
differ by where their memory landed, so its ratio to ``off``, ideally 1.00, is the run's noise
floor for the other rows' ratios). Each engine sees
the same prompts, seeds and weights, so every row samples the same tokens (checked: ``mismatch``
counts samples that differ from ``off``; bfloat16 near-ties can flip one).

Per epoch and row: wall seconds of the rollout; tau (tokens committed per verify step) and,
per draft source, accepted draft tokens per verify step; speedup over ``off`` for the whole
rollout and for its tail (from the step at which at most ``--tail-batch`` samples are still
running to the end); per running-batch bucket the committed tokens/s ratio against ``off``,
the slowest bucket's and the seconds spent in buckets ``off`` never ran (no ratio covers them:
with every sample at the cap, ``off`` runs the full batch to the end); the rollout memory's
bytes; and the replay projection of the row's trace
under a GPU cost table (``--gpu-table``, default the H200-class roofline of ``--model``: a
projection, not a measurement; ``bench/replay.py``): predicted speedup over ``off`` of the steps
as logged and of the row's most used strategy run statically. ``--trace DIR`` keeps the traces.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from pathlib import Path

import torch
from common import machine_info, markdown_table, quiet_transformers, write_json

from specengine import LLM, SamplingParams
from specengine.data.prompt_sets import gsm_questions, humaneval_prompts
from specengine.models.loader import resolve_model

MODEL = "smollm2-135m-instruct"
EVAL_GSM_SEED = 1234  # the shipped drafter trains on seed 0 (examples/train_drafter.py)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def rows(spec_depth: int, policy: str = "auto", topk: int | None = None,
         budget: int | None = None, drafter_dir: str | None = None) -> dict[str, dict | None]:
    """Row name -> speculative_config (None: no speculation). ``policy="static"`` verifies
    the same tree shape (depth, ``topk``, ``budget`` nodes) in every row and step, so the
    rows' tau compare at the same verify budget. ``drafter_dir``: the EAGLE checkpoint of
    the ``eagle-dir`` row."""
    common = {"num_speculative_tokens": spec_depth, "policy": policy}
    if topk is not None:
        common["topk"] = topk
    if budget is not None:
        common["num_verify_tokens"] = budget
    return {"off": None,
            "off-control": None,  # a second engine without speculation: the run's noise floor
            "ngram": {"method": "ngram", **common},
            "suffix": {"method": "suffix", **common},
            "eagle": {"method": "eagle", **common},
            # the shipped drafter trained further between epochs on the row's own rollouts
            "eagle-online": {"method": "eagle", **common},
            # another EAGLE drafter (a checkpoint directory) beside the shipped one
            "eagle-dir": {"method": "eagle", "model": drafter_dir, **common},
            "suffix+eagle": {"method": ["suffix", "eagle"], **common}}


class Drift:
    """The target's policy updates between epochs: AdamW steps of a float32 transformers copy
    on windows of HumanEval prompt text (``batch`` x ``length`` tokens per step)."""

    def __init__(self, model_dir, tok, lr: float, batch: int = 4, length: int = 128):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ids = tok("\n\n".join(p["prompt"] for p in humaneval_prompts()),
                  return_tensors="pt").input_ids[0]
        self.windows = ids[:len(ids) // length * length].view(-1, length)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.batch, self.done = batch, 0

    def step(self, steps: int) -> dict[str, torch.Tensor]:
        """``steps`` more updates; returns the new weights (name -> tensor)."""
        self.model.train()
        for _ in range(steps):
            idx = torch.arange(self.done * self.batch, (self.done + 1) * self.batch)
            x = self.windows[idx % len(self.windows)]
            loss = self.model(input_ids=x, labels=x).loss
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.done += 1
        self.opt.zero_grad(set_to_none=True)  # the gradients' memory until the next epoch
        self.model.eval()
        return {k: v.detach() for k, v in self.model.state_dict().items()}


class Online:
    """The ``eagle-online`` row's drafter training: every finished sample of the row's rollouts
    goes into a ``HiddenBuffer`` with its target features (``harvest``: the features decoding
    computed anyway), and ``train`` runs a ``DrafterTrainer``'s AdamW steps on them (one
    cosine schedule of ``total_steps`` over the epochs, peak ``lr``) and hands the weights to
    the engine's drafter as its next version."""

    def __init__(self, llm: LLM, total_steps: int, lr: float, batch_tokens: int = 2048):
        from specengine.speculative.training.fit import TrainConfig
        from specengine.speculative.training.harvest import HiddenBuffer, harvest
        from specengine.speculative.training.online import DrafterTrainer

        self.buffer = HiddenBuffer(max_items=4096, max_bytes=2 << 30)
        drafter = harvest(llm, self.buffer).inner
        self.trainer = DrafterTrainer(drafter, self.buffer, TrainConfig(
            steps=max(total_steps, 1), warmup=min(10, max(total_steps // 10, 1)), lr=lr,
            batch_tokens=batch_tokens, seed=0), min_rollouts=1)

    def train(self, steps: int) -> dict:
        """``steps`` training steps now; returns what they did (seconds, samples, loss)."""
        t0 = time.perf_counter()
        done = self.trainer.train_now(steps)
        gc.collect()  # the step's activations before the next allocations (drift, rollout)
        return {"steps": done, "seconds": time.perf_counter() - t0,
                "samples": len(self.buffer.snapshot()), "version": self.trainer.version,
                "last": {k: float(v) for k, v in self.trainer.last.items()
                         if isinstance(v, (int, float))}}


def rollout(llms: dict[str, LLM], prompts: list[list[int]],
            params: list[SamplingParams]) -> dict[str, dict]:
    """Run one rollout on every engine in lockstep: each round steps every engine that still
    has work once, in an order shuffled every round (seeded), so the rows see the same machine
    at the same moments (a slow minute of the machine slows them all alike; ratios come from
    one run) and no row always runs right after the same other one. Each row's clock counts
    only its own steps. Returns per row:
    outputs (per request, per sample token ids), wall seconds and per-step ``(end second on
    the row's clock, running, tokens committed)``."""
    state = {}
    for name, llm in llms.items():
        state[name] = {"ids": [llm.add_request(p, sp) for p, sp in zip(prompts, params)],
                       "done": {}, "steps": [], "clock": 0.0}
    busy, order = list(llms), random.Random(0)
    while busy:
        order.shuffle(busy)
        for name in busy:
            llm, st = llms[name], state[name]
            eng = llm.engine
            running = len(eng.scheduler.running) + sum(len(g) for g in eng.scheduler.waiting)
            before = eng.metrics.generated_tokens
            t0 = time.perf_counter()
            outs = llm.step()
            st["clock"] += time.perf_counter() - t0
            for out in outs:
                st["done"][out.request_id] = [list(c.token_ids) for c in out.outputs]
            st["steps"].append((st["clock"], running, eng.metrics.generated_tokens - before))
        busy = [n for n in busy if llms[n].has_unfinished_requests()]
    return {name: {"outputs": [st["done"][i] for i in st["ids"]], "wall_s": st["clock"],
                   "steps": st["steps"]} for name, st in state.items()}


def tail_seconds(steps: list[tuple], tail_batch: int) -> float:
    """Seconds from the first step run with at most ``tail_batch`` samples left to the end."""
    start = 0.0
    for end, running, _ in steps:
        if running <= tail_batch:
            return steps[-1][0] - start
        start = end
    return 0.0


def _per_key(steps: list[tuple], key) -> dict[int, list[float]]:
    """``steps`` grouped by ``key(running)``: per group [seconds, tokens committed, steps]."""
    out: dict[int, list[float]] = {}
    prev = 0.0
    for end, running, tokens in steps:
        acc = out.setdefault(key(running), [0.0, 0.0, 0])
        acc[0] += end - prev
        acc[1] += tokens
        acc[2] += 1
        prev = end
    return out


def _bucket(running: int) -> int:
    return next(x for x in BUCKETS + (10**9,) if running <= x)


def bucket_rates(steps: list[tuple]) -> dict[int, tuple[float, float, int]]:
    """Per running-batch bucket (upper edge in ``BUCKETS``): (seconds, tokens committed,
    steps)."""
    return {b: (s, t, n) for b, (s, t, n) in _per_key(steps, _bucket).items()}


def bucket_ratios(mine: dict, theirs: dict) -> dict[int, float]:
    """Per bucket in both ``bucket_rates``: the committed tokens/s of ``mine`` over
    ``theirs``."""
    return {b: (mine[b][1] / mine[b][0]) / (theirs[b][1] / theirs[b][0])
            for b in mine if b in theirs and mine[b][0] > 0 and theirs[b][0] > 0
            and theirs[b][1] > 0}


def same_batch_ratios(mine: list[tuple], theirs: list[tuple]) -> dict[int, float]:
    """Per running-batch bucket (upper edge in ``BUCKETS``): the committed tokens/s of
    ``mine`` over ``theirs`` at the same number of running sequences, averaged over the
    counts of the bucket weighted by ``mine``'s seconds at each (counts ``theirs`` never ran
    are left out). A bucket spans several counts (5-8 sequences: bucket 8) and a CPU step
    costs about the same at each, so a row whose samples finish at other moments spends its
    bucket's time at other counts and ``bucket_ratios`` reads that mix as a change of speed;
    this ratio does not."""
    m, t = _per_key(mine, int), _per_key(theirs, int)
    num: dict[int, float] = {}
    den: dict[int, float] = {}
    for n, (sec, tok, _) in m.items():
        if n not in t or sec <= 0 or t[n][0] <= 0 or t[n][1] <= 0:
            continue
        b = _bucket(n)
        num[b] = num.get(b, 0.0) + tok / (t[n][1] / t[n][0])  # seconds x (mine / theirs)
        den[b] = den.get(b, 0.0) + sec
    return {b: num[b] / den[b] for b in num}


def counters(llm: LLM) -> dict:
    """The metrics this bench differences per epoch."""
    m = llm.get_metrics()
    src = m.get("source_stats", {})
    return {"spec_steps": m.get("spec_steps", 0), "accepted": m.get("accepted_tokens", 0),
            "drafted": m.get("drafted_tokens", 0),
            "src_accepted": {k: v["nodes_accepted"] for k, v in src.items()},
            "src_verified": {k: v["nodes_verified"] for k, v in src.items()},
            "memory_bytes": m.get("rollout_memory_bytes"),
            "suffix_seconds": m.get("suffix_update_seconds", 0.0)
            + m.get("suffix_lookup_seconds", 0.0)}


def epoch_row(name: str, run: dict, before: dict, after: dict, base: dict | None,
              tail_batch: int) -> dict:
    """One row's numbers for one epoch (``base``: the ``off`` row's run, None for itself)."""
    spec = after["spec_steps"] - before["spec_steps"]
    acc = after["accepted"] - before["accepted"]
    row = {"row": name, "wall_s": run["wall_s"], "tail_s": tail_seconds(run["steps"], tail_batch),
           "spec_steps": spec, "tau": (acc + spec) / spec if spec else 1.0,
           "drafted": after["drafted"] - before["drafted"], "accepted": acc,
           "memory_bytes": after["memory_bytes"],
           "suffix_seconds": after["suffix_seconds"] - before["suffix_seconds"],
           "accepted_per_step_by_source": {
               k: (v - before["src_accepted"].get(k, 0)) / spec if spec else 0.0
               for k, v in after["src_accepted"].items()},
           "verified_by_source": {k: v - before["src_verified"].get(k, 0)
                                  for k, v in after["src_verified"].items()},
           "steps": len(run["steps"]),
           "tokens": sum(t for *_, t in run["steps"])}
    if base is not None:
        row["speedup"] = base["wall_s"] / run["wall_s"]
        bt, rt = tail_seconds(base["steps"], tail_batch), row["tail_s"]
        row["tail_speedup"] = bt / rt if rt else None
        mine, theirs = bucket_rates(run["steps"]), bucket_rates(base["steps"])
        ratios = bucket_ratios(mine, theirs)
        row["bucket_ratio"] = ratios
        row["bucket_rates"], row["off_bucket_rates"] = mine, theirs  # (s, tokens, steps)
        row["slowest_bucket"] = min(ratios.items(), key=lambda kv: kv[1]) if ratios else None
        same = same_batch_ratios(run["steps"], base["steps"])
        row["same_batch_ratio"] = same
        row["slowest_same_batch"] = min(same.items(), key=lambda kv: kv[1]) if same else None
        # seconds in buckets off never ran (its samples all ran to the end together): no
        # ratio covers them, though they are part of this row's wall time
        row["unmatched_s"] = sum(v[0] for b, v in mine.items() if b not in ratios)
        row["mismatch"] = sum(a != b for ra, rb in zip(run["outputs"], base["outputs"])
                              for a, b in zip(ra, rb))
    return row


def projection(trace, table) -> dict:
    """The replay projection of one row's trace on ``table``: predicted seconds of ``off``,
    ``as-logged`` (the steps this row ran) and ``static`` with its most used strategy, and
    their speedups over ``off`` (``bench/replay.py``)."""
    from replay import default_policies

    from specengine.replay.projection import replay

    out = {"table": table.label}
    off = replay(trace, table, "off")
    base = off.seconds
    if off.warnings:
        out["warnings"] = off.warnings
    for pol in default_policies(trace):
        try:
            secs = replay(trace, table, pol).seconds
        except ValueError as e:  # a static policy without statistics for its source
            out[pol] = {"error": str(e)}
            continue
        out[pol] = {"seconds": secs, "speedup": base / secs if secs else None}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", "--rollout-epochs", type=int, default=3,
                    help="epochs (RL steps) over the same prompts, >= 1")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--spec-depth", type=int, default=6, help="num_speculative_tokens")
    ap.add_argument("--policy", default="auto", choices=("auto", "static"),
                    help="static: every row verifies the same tree shape every step (tau at "
                         "the same verify budget)")
    ap.add_argument("--topk", type=int, default=None, help="tree width (default: the config's)")
    ap.add_argument("--budget", type=int, default=None,
                    help="verify budget, nodes (default: the config's)")
    ap.add_argument("--drift-steps", type=int, default=4)
    ap.add_argument("--drift-lr", type=float, default=1e-5)
    ap.add_argument("--tail-batch", type=int, default=8)
    ap.add_argument("--online-steps", type=int, default=100,
                    help="eagle-online: drafter training steps after each epoch but the last")
    ap.add_argument("--online-lr", type=float, default=5e-4,
                    help="eagle-online: the peak learning rate of that training")
    ap.add_argument("--online-batch-tokens", type=int, default=2048,
                    help="eagle-online: tokens per training step (its memory grows with them: "
                         "the target's full-vocabulary distributions of every row)")
    ap.add_argument("--rows", default="off,suffix,eagle,suffix+eagle",
                    help="comma-separated: off, off-control, ngram, suffix, eagle, eagle-online, "
                         "eagle-dir, suffix+eagle (eagle rows need the model's EAGLE drafter; "
                         "off-control is a second engine without speculation, whose ratio to "
                         "off is the run's noise floor; eagle-online trains its drafter between "
                         "epochs; eagle-dir drafts with --drafter-dir)")
    ap.add_argument("--drafter-dir", default=None,
                    help="eagle-dir: an EAGLE drafter checkpoint directory (model.safetensors "
                         "and config.json, as `specengine train-drafter` writes), to compare "
                         "with the shipped drafter's eagle row in one run")
    ap.add_argument("--model", default=MODEL,
                    help="target model alias or directory (e.g. qwen2.5-coder-0.5b-instruct)")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 4 samples, 256 tokens")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV cache per engine, GiB (default: the engine's, 1 GiB); less lets "
                         "more engines of a larger model share the machine's memory")
    ap.add_argument("--trace", help="directory for per-epoch rollout traces (replay input)")
    ap.add_argument("--gpu-table", default=None,
                    help="cost table of the replay projection, made for --model (default: the "
                         "H200-class roofline of --model, a projection, not a measurement)")
    ap.add_argument("--out", help="write results as JSON here")
    a = ap.parse_args(argv)
    known = rows(a.spec_depth, a.policy, a.topk, a.budget, a.drafter_dir)
    names = [r for r in a.rows.split(",") if r]
    bad = [r for r in names if r not in known]
    if bad or len(set(names)) != len(names) or "off" not in names:
        ap.error(f"--rows {a.rows!r}: a comma-separated subset of {','.join(known)} without "
                 "repeats, including off (the baseline)")
    if a.online_steps < 0 or not a.online_lr > 0 or a.online_batch_tokens < 1:
        ap.error(f"--online-steps {a.online_steps} / --online-lr {a.online_lr} / "
                 f"--online-batch-tokens {a.online_batch_tokens}: need >= 0 / > 0 / >= 1")
    for name in ("epochs", "prompts", "n", "max_tokens", "spec_depth"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= 1")
    if ("eagle-dir" in names) != (a.drafter_dir is not None):
        ap.error("--drafter-dir and the eagle-dir row go together: name both or neither")
    if a.drafter_dir is not None and not (Path(a.drafter_dir) / "config.json").is_file():
        ap.error(f"--drafter-dir {a.drafter_dir}: no EAGLE checkpoint there (config.json missing)")
    from step_costs import gpu_table

    try:
        gpu = gpu_table(a.gpu_table, a.model)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    if a.quick:
        a.prompts, a.n, a.max_tokens = 4, 4, 256
    quiet_transformers()
    from transformers import AutoTokenizer

    model_dir = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q["question"]}],
                                           tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
               for q in gsm_questions(a.prompts, seed=EVAL_GSM_SEED)]
    # built in this order: engines built later run up to ~1% slower here (5 identical
    # engines: 0.988-1.0x), so off-control is built last, after every speculative row, and
    # the summary also gives each row against the mean of the two baselines
    names = [n for n in names if n != "off-control"] + \
        (["off-control"] if "off-control" in names else [])
    specs = {k: known[k] for k in names}
    kv = None if a.kv_cache_gib is None else int(a.kv_cache_gib * 2**30)
    if kv is not None and kv <= 0:
        ap.error(f"--kv-cache-gib {a.kv_cache_gib}: must be > 0")
    llms = {k: LLM(a.model, dtype="bfloat16", speculative_config=v, seed=0,
                   kv_cache_memory_bytes=kv)
            for k, v in specs.items()}
    drift = Drift(model_dir, tok, a.drift_lr) if a.epochs > 1 and a.drift_steps else None
    online = Online(llms["eagle-online"], a.online_steps * (a.epochs - 1), a.online_lr,
                    a.online_batch_tokens) if "eagle-online" in llms else None
    results = []
    for epoch in range(a.epochs):
        train = {}
        if epoch and online is not None:
            train = online.train(a.online_steps)
        if epoch and drift is not None:
            weights = drift.step(a.drift_steps)
            for llm in llms.values():
                llm.update_weights(weights)
        params = [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens,
                                 seed=10_000 * epoch + i) for i in range(len(prompts))]
        before = {name: counters(llm) for name, llm in llms.items()}
        for llm in llms.values():
            llm.start_trace()
        runs = rollout(llms, prompts, params)
        rows_out = []
        for name, llm in llms.items():
            trace = llm.stop_trace()
            if a.trace:
                trace.save(f"{a.trace}/epoch{epoch}_{name}.json")
            rows_out.append(epoch_row(name, runs[name], before[name], counters(llm),
                                      None if name == "off" else runs["off"], a.tail_batch))
            rows_out[-1]["gpu_projection"] = projection(trace, gpu)
            # what the policy chose and why, counted from the engine's start (every epoch so far)
            rows_out[-1]["policy_so_far"] = llm.engine.policy.stats()
            if name == "eagle-online":
                rows_out[-1]["online_training"] = train
            print(f"epoch {epoch} {name}: {runs[name]['wall_s']:.1f} s, "
                  f"tau {rows_out[-1]['tau']:.2f}", flush=True)
        lengths = [len(s) for r in runs["off"]["outputs"] for s in r]
        results.append({"epoch": epoch, "weight_version": llms["off"].weight_version,
                        "output_tokens": sum(lengths), "max_output": max(lengths),
                        "rows": rows_out})
    table = []
    for r in results:
        for row in r["rows"]:
            sb = row.get("slowest_bucket")
            table.append([r["epoch"], row["row"], f"{row['wall_s']:.1f}", f"{row['tau']:.2f}",
                          ", ".join(f"{k} {v:.2f}"
                                    for k, v in row["accepted_per_step_by_source"].items()),
                          f"{row.get('speedup', 1.0):.2f}",
                          f"{row['tail_speedup']:.2f}" if row.get("tail_speedup") else "-",
                          f"{sb[1]:.2f} (b<={sb[0]}, {row['bucket_rates'][sb[0]][2]} steps)"
                          + (f"; {row['unmatched_s']:.1f} s in buckets off never ran"
                             if row.get("unmatched_s") else "") if sb else "-",
                          "{1:.2f} (b<={0})".format(*row["slowest_same_batch"])
                          if row.get("slowest_same_batch") else "-",
                          row.get("mismatch", 0),
                          f"{row['memory_bytes'] / 2**20:.1f}" if row["memory_bytes"] else "-",
                          f"{row['gpu_projection'].get('as-logged', {}).get('speedup', 0):.2f}"])
    print(markdown_table(["epoch", "row", "wall s", "tau", "accepted/step by source",
                          "speedup", "tail speedup", "slowest bucket",
                          "slowest bucket, same batch", "mismatch",
                          "memory MiB", "GPU projection (as logged)"], table))
    summary = over_epochs(results)
    if summary:
        print(markdown_table(
            ["row", "epochs", "speedup mean +- sd", "vs mean of off and off-control",
             "speedup min", "slowest bucket min", "slowest bucket, epochs pooled",
             "spec steps"],
            [[name, v["epochs"], f"{v['speedup_mean']:.3f} +- {v['speedup_sd']:.3f}",
              f"{v['vs_baselines_mean']:.3f}",
              f"{v['speedup_min']:.3f}", f"{v['slowest_bucket_min']:.3f}",
              "{:.3f} (b<={}, {} steps)".format(*v["slowest_bucket_pooled"])
              if v["slowest_bucket_pooled"] else "-", v["spec_steps"]]
             for name, v in summary.items()]))
    if a.out:
        write_json(a.out, {"bench": "rl_epochs", "machine": machine_info(), "args": vars(a),
                           "epochs": results, "over_epochs": summary})
    return 0


def over_epochs(results: list[dict]) -> dict[str, dict]:
    """Per row but ``off``, across the epochs: the mean, standard deviation and least of its
    speedup over ``off``, the mean of its speedup over the mean seconds of ``off`` and
    ``off-control`` (built first and last), the least of its slowest bucket, its slowest
    bucket with the epochs pooled (seconds and tokens per bucket summed over the epochs, then
    the ratio: a bucket an epoch spends one step in is one sample, which loses whenever that
    step's draft is rejected; the loss guard keeps its promise over a bucket's last steps,
    whatever the epoch), and its speculative steps in all.
    The ``off-control`` row's spread is the run's noise: a row within it of 1.0 is as fast
    as no speculation as far as this machine can tell."""
    rows: dict[str, list[dict]] = {}
    both = []  # per epoch: the mean seconds of off and off-control
    for r in results:
        walls = {row["row"]: row["wall_s"] for row in r["rows"]}
        both.append((walls["off"] + walls.get("off-control", walls["off"])) / 2)
        for row in r["rows"]:
            if row["row"] != "off":
                rows.setdefault(row["row"], []).append(row)
    out = {}
    for name, rs in rows.items():
        sp = [x.get("speedup", 1.0) for x in rs]
        out[name] = {"epochs": len(rs),
                     "vs_baselines_mean": statistics.fmean(b / x["wall_s"]
                                                           for b, x in zip(both, rs)),
                     "speedup_mean": statistics.fmean(sp),
                     "speedup_sd": statistics.stdev(sp) if len(sp) > 1 else 0.0,
                     "speedup_min": min(sp),
                     "slowest_bucket_min": min(x["slowest_bucket"][1] if x.get("slowest_bucket")
                                               else x.get("speedup", 1.0) for x in rs),
                     "slowest_bucket_pooled": _slowest_pooled(rs),
                     "spec_steps": sum(x["spec_steps"] for x in rs)}
    return out


def _slowest_pooled(rows: list[dict]) -> tuple[float, int, int] | None:
    """The slowest bucket of ``rows`` (one row's epochs) with their seconds and tokens per
    bucket summed over the epochs, against ``off``'s summed alike: (ratio, bucket, the row's
    steps in it); None without buckets."""
    mine: dict[int, list] = {}
    theirs: dict[int, list] = {}
    for x in rows:
        for pooled, rates in ((mine, x.get("bucket_rates", {})),
                              (theirs, x.get("off_bucket_rates", {}))):
            for b, v in rates.items():
                acc = pooled.setdefault(b, [0.0, 0.0, 0])
                for i in range(3):
                    acc[i] += v[i]
    ratios = bucket_ratios(mine, theirs)
    if not ratios:
        return None
    b = min(ratios, key=ratios.get)
    return ratios[b], b, mine[b][2]


if __name__ == "__main__":
    raise SystemExit(main())
