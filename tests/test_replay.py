"""Rollout traces (``specengine.replay.trace``), step-cost tables (``specengine.replay.cost_table``)
and the replay projection (``specengine.replay.projection``): hand-computed answers on a synthetic
trace, a trace
recorded on a tiny random model checked against its outputs, and bad inputs."""

import json
from pathlib import Path

import pytest
from helpers import rand_prompts

from specengine import LLM, SamplingParams
from specengine.models.config import ModelConfig
from specengine.replay.cost_table import CostTable, StepShape, model_sizes, roofline_table
from specengine.replay.projection import AcceptanceStats, logged_shape, parse_policy, replay
from specengine.replay.trace import RolloutTrace
from specengine.speculative.strategy import Strategy

# forward(T, C) = 0.01 + 0.001 T + 1e-6 C: linear, so bilinear interpolation is exact
TABLE = {
    "format": "specengine-step-costs", "version": 1, "kind": "measured", "label": "synthetic",
    "forward": {"tokens": [1, 101], "context": [1, 10001],
                "seconds": [[0.01 + 0.001 + 1e-6, 0.01 + 0.001 + 1e-6 * 10001],
                            [0.01 + 0.101 + 1e-6, 0.01 + 0.101 + 1e-6 * 10001]]},
    "pair_s": 1e-7, "step_s": 0.002, "sequence_s": 1e-4, "node_s": 5e-5,
    "draft": {"d": {"step_s": 0.001, "depth_s": 5e-4, "sequence_depth_s": 1e-4, "node_s": 0.0}}}


def fwd(t, c, pairs):
    return 0.01 + 0.001 * t + 1e-6 * c + 1e-7 * (pairs - c)


def synthetic_trace() -> RolloutTrace:
    """Two 10-token prompts, outputs of 3 and 5 tokens, chain depth 2 from drafter "d"."""
    seq = {"prompt_tokens": 10, "max_tokens": 8, "first_step": 0, "finish_reason": "stop"}
    doc = {"format": "specengine-rollout-trace", "version": 1,
           "meta": {"drafter": "d", "policy": "static", "max_num_seqs": 8,
                    "max_num_batched_tokens": 100, "wall_s": 0.08},
           "sequences": {"0": dict(seq, output_tokens=3, group="a"),
                         "1": dict(seq, output_tokens=5, group="b")},
           "steps": [
               {"start": 0.0, "end": 0.03, "draft_s": 0, "forward_s": 0.03, "sample_s": 0,
                "strategy": "chain(d=2)", "depth": 2, "topk": 1, "proposed": 0,
                "forward_tokens": 20, "decode": [],
                "prefill": [{"seqs": [0], "new": 10, "cached": 0, "commit": [1]},
                            {"seqs": [1], "new": 10, "cached": 0, "commit": [1]}]},
               {"start": 0.03, "end": 0.05, "draft_s": 0, "forward_s": 0.02, "sample_s": 0,
                "strategy": "chain(d=2)", "depth": 2, "topk": 1, "proposed": 4,
                "forward_tokens": 6, "prefill": [], "decode": [
                    {"seq": 0, "ctx": 10, "commit": 2, "nodes": {"d": [1, 1]}, "accepted": 1,
                     "path": ["d"]},
                    {"seq": 1, "ctx": 10, "commit": 3, "nodes": {"d": [1, 1]}, "accepted": 2,
                     "path": ["d", "d"]}]},
               {"start": 0.05, "end": 0.07, "draft_s": 0, "forward_s": 0.02, "sample_s": 0,
                "strategy": "chain(d=2)", "depth": 2, "topk": 1, "proposed": 2,
                "forward_tokens": 3, "prefill": [], "decode": [
                    {"seq": 1, "ctx": 13, "commit": 1, "nodes": {"d": [1, 1]}, "accepted": 0,
                     "path": []}]}]}
    return RolloutTrace.from_dict(doc)


PREFILL = fwd(20, 20, 110) + 0.002 + 2e-4  # two 10-token prompts: 55 pairs each


def test_as_logged_matches_hand_computation():
    r = replay(synthetic_trace(), CostTable(TABLE), "as-logged")
    # step 1: two rows of length 11 with 2 nodes (depths 1, 2): 11 + 2*11 + 3 = 36 pairs each
    step1 = fwd(6, 22, 72) + (0.001 + 5e-4 * 2 + 1e-4 * 2 * 2) + (0.002 + 2e-4 + 5e-5 * 4)
    step2 = fwd(3, 14, 45) + (0.001 + 5e-4 * 2 + 1e-4 * 2) + (0.002 + 1e-4 + 5e-5 * 2)
    assert r.steps == 3
    assert r.seconds == pytest.approx(PREFILL + step1 + step2, rel=1e-12)
    assert r.measured_s == 0.08 and r.tokens == 8
    # the policy the trace ran ("static") priced per step and decode row, when the table does
    priced = CostTable(dict(TABLE, policy={"static": {"step_s": 1e-3, "sequence_s": 1e-4}}))
    r2 = replay(synthetic_trace(), priced, "as-logged")
    assert r2.policy_s == pytest.approx(3e-3 + (2 + 2 + 1) * 1e-4)  # rows sampled
    assert r2.seconds == pytest.approx(r.seconds + r2.policy_s, rel=1e-12)
    assert replay(synthetic_trace(), priced, "off").policy_s == 0  # simulated: no policy


def test_off_matches_hand_computation():
    r = replay(synthetic_trace(), CostTable(TABLE), "off")
    decode = [fwd(2, 22, 22) + 0.0022, fwd(2, 24, 24) + 0.0022,  # both running
              fwd(1, 13, 13) + 0.0021, fwd(1, 14, 14) + 0.0021]  # the 5-token one alone
    assert r.steps == 5 and r.draft_s == 0
    assert r.seconds == pytest.approx(PREFILL + sum(decode), rel=1e-12)


def test_static_matches_hand_computation():
    trace = synthetic_trace()
    stats = AcceptanceStats(trace)
    p, n = stats.per_depth("d", 1)
    assert p == pytest.approx([2 / 3, 1 / 3]) and n == pytest.approx([1.0, 1.0])
    # per sequence (prompt group, sample index) once it has min_rows rows of its own
    assert stats.per_depth("d", 1, ("b", None)) == (p, n)  # 2 rows < 4: the whole trace's
    own = AcceptanceStats(trace, min_rows=2)
    assert own.per_depth("d", 1, ("b", None)) == ([0.5, 0.5], [1.0, 1.0])
    assert own.per_depth("d", 1, ("a", None)) == (p, n)  # 1 row
    acc, nod = stats.expected("d", Strategy(3))  # depth 3 extrapolated: p3 = p2 * (p2 / p1)
    assert acc == pytest.approx([0, 2 / 3, 1, 1 + 1 / 6]) and nod == pytest.approx([0, 1, 2, 3])
    r = replay(trace, CostTable(TABLE), "static:d=2")
    # each sequence commits 1 + 1 tokens a step: the 3-token one is done after one decode step
    step1 = fwd(6, 22, 72) + (0.001 + 5e-4 * 2 + 1e-4 * 4) + (0.002 + 2e-4 + 5e-5 * 4)
    step2 = fwd(3, 13, 13 * 3 + 3) + (0.001 + 5e-4 * 2 + 1e-4 * 2) + (0.002 + 1e-4 + 5e-5 * 2)
    assert r.steps == 3
    assert r.seconds == pytest.approx(PREFILL + step1 + step2, rel=1e-12)
    assert replay(trace, CostTable(TABLE), "static:d=2,source=d").seconds == r.seconds


def test_interpolation_and_extrapolation():
    t = CostTable(TABLE)
    for tok, ctx in [(1, 1), (50, 5000), (101, 10001), (300, 40000)]:  # last one: outside
        assert t.forward_seconds(tok, ctx) == pytest.approx(0.01 + 0.001 * tok + 1e-6 * ctx)
    shape = StepShape(tokens=10, context=100, pairs=150, rows=2, nodes=3,
                      drafts={"d": (2, 3, 3), "unpriced": (2, 3, 3)})
    s = t.step_seconds(shape)
    assert s["draft"] == pytest.approx(0.001 + 5e-4 * 3 + 1e-4 * 6)
    assert s["other"] == pytest.approx(0.002 + 2e-4 + 1.5e-4)
    assert s["forward"] == pytest.approx(fwd(10, 100, 150))
    doc = json.loads(json.dumps(TABLE))
    doc["draft"]["d"]["sequence_s"] = 2e-4  # per sequence drafted for, whatever the depth
    assert CostTable(doc).draft_seconds("d", 2, 3, 3) == pytest.approx(s["draft"] + 4e-4)


def test_roofline_by_hand():
    cfg = ModelConfig("LlamaForCausalLM", "llama", vocab_size=100, hidden_size=8,
                      intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=4, tie_word_embeddings=True)
    sizes = model_sizes(cfg)
    # per layer: q 8*8 + k, v 2*8*4 + o 8*8 + mlp 3*8*16 = 576; head 800
    assert sizes["linear_params"] == 2 * 576 + 800
    assert sizes["kv_values_per_token"] == 2 * 2 * 4 and sizes["attention_flops_per_pair"] == 64
    doc = roofline_table(cfg, model="tiny", bytes_per_s=1e9, flops_per_s=1e10,
                         tokens=[1, 1000], context=[16, 4096])
    t = CostTable(doc)
    assert t.kind == "projection" and "NOT a measurement" in t.label
    w = (2 * 576 + 800 + 5 * 8) * 2
    assert t.forward_seconds(1, 16) == pytest.approx(
        max((w + 32 * 17) / 1e9, (2 * 1952 + 64 * 16) / 1e10))
    assert t.forward_seconds(1000, 16) == pytest.approx(
        max((w + 32 * 1016) / 1e9, (2 * 1952 * 1000 + 64 * 16) / 1e10))
    assert t.pair_s == pytest.approx(64 / 1e10)


def test_shipped_h200_table_is_a_labelled_projection():
    path = Path(__file__).parent.parent / "bench" / "cost_tables" / "h200_roofline.json"
    t = CostTable.load(path)
    assert t.kind == "projection"
    assert "NOT a measurement" in t.label and "PROJECTION" in t.doc["notes"]
    # weights of the default model (bf16) over 4.8 TB/s: ~56 us for a batch-1 decode
    assert 5e-5 < t.forward_seconds(1, 100) < 6e-5



def test_a_table_for_another_model_is_named_in_the_replay_warnings():
    """A table names the model it prices (an alias also prices a directory of that name);
    replaying another model's trace with it says so, the same model's does not."""
    t = CostTable(dict(TABLE, model="smollm2-135m-instruct"))
    assert t.prices("smollm2-135m-instruct") and t.prices("/cache/models/smollm2-135m-instruct")
    assert not t.prices("qwen2.5-coder-0.5b-instruct")
    assert t.prices(None) and CostTable(TABLE).prices("qwen2.5-coder-0.5b-instruct")
    trace = synthetic_trace()
    assert replay(trace, t, "off").warnings == []  # the trace names no model
    trace.meta["model"] = "qwen2.5-coder-0.5b-instruct"
    warnings = replay(trace, t, "as-logged").warnings
    assert len(warnings) == 1 and "prices 'smollm2-135m-instruct'" in warnings[0]
    trace.meta["model"] = "smollm2-135m-instruct"
    assert replay(trace, t, "as-logged").warnings == []


def test_bench_gpu_table_defaults_to_the_roofline_of_the_run_model(tiny_llama_dir, monkeypatch):
    """``bench/step_costs.gpu_table`` (the GPU projection of ``rl_epochs`` and
    ``replay_validate``): without a path, the H200-class roofline of the run's model; the
    shipped table, SmolLM2-135M's, for another model is an error naming both."""
    bench = Path(__file__).parent.parent / "bench"
    monkeypatch.syspath_prepend(str(bench))
    import step_costs

    shipped = bench / "cost_tables" / "h200_roofline.json"
    t = step_costs.gpu_table(None, str(tiny_llama_dir))
    assert t.kind == "projection" and t.model == str(tiny_llama_dir)
    # the tiny model's weights read far faster than SmolLM2's 269 MB
    assert t.forward_seconds(1, 100) < CostTable.load(shipped).forward_seconds(1, 100) / 100
    with pytest.raises(ValueError, match="prices 'smollm2-135m-instruct', not"):
        step_costs.gpu_table(str(shipped), str(tiny_llama_dir))
    assert step_costs.gpu_table(str(shipped), "smollm2-135m-instruct").model == \
        "smollm2-135m-instruct"

@pytest.fixture(scope="module")
def traced(tiny_llama_dir):
    """A seeded T = 1 rollout on the tiny model with n-gram chains of depth 3, the trees'
    nodes labelled with two sources in turn; its outputs and trace."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "policy": "static", "prompt_lookup_min": 1})
    drafter = llm.engine.drafter
    propose = drafter.propose

    def labelled(seqs, strategy):
        trees = propose(seqs, strategy)
        for t in trees:
            if t is not None:
                t.sources = ["a" if i % 2 == 0 else "b" for i in range(t.num_nodes)]
        return trees

    drafter.propose = labelled
    prompts = [p * 4 for p in rand_prompts(3, lo=3, hi=6, vocab=20, seed=3)]
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24)
    llm.start_trace()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.stop_trace(), llm


def test_trace_consistent_with_outputs(traced):
    outs, trace, _ = traced
    lengths = sorted(len(o.token_ids) for r in outs for o in r.outputs)
    assert sorted(s["output_tokens"] for s in trace.sequences.values()) == lengths
    committed = {i: 0 for i in trace.sequences}
    verified = 0
    for st in trace.steps:
        nodes = 0
        for r in st["decode"]:
            committed[r["seq"]] += r["commit"]
            if "nodes" in r:
                verified += 1
                assert set(r["nodes"]) <= {"a", "b"}
                n = sum(sum(c) for c in r["nodes"].values())
                nodes += n
                assert len(r["path"]) == r["accepted"] <= n
                assert r["commit"] <= r["accepted"] + 1
            else:
                assert r["commit"] == 1
        for p in st["prefill"]:
            for i, c in zip(p["seqs"], p["commit"]):
                committed[i] += c
        # the forward holds the prompts, one root per decode and every verified node
        assert st["forward_tokens"] == sum(p["new"] for p in st["prefill"]) + len(
            st["decode"]) + nodes
        assert logged_shape(st).nodes == nodes
    assert sorted(committed.values()) == lengths
    assert sum(committed.values()) == trace.output_tokens == sum(lengths)
    assert verified > 0  # the repeated prompts give the n-gram drafter matches
    assert trace.wall_s >= trace.step_seconds() > 0
    # every sequence is admitted in the first step, so plain decoding needs as many steps as
    # the longest output (the prefill samples the first token)
    r = replay(trace, CostTable(TABLE), "off")
    assert r.steps == max(lengths)
    assert replay(trace, CostTable(TABLE), "as-logged").steps == len(trace.steps)


def test_trace_round_trip(traced, tmp_path):
    _, trace, _ = traced
    path = tmp_path / "t.json"
    trace.save(path)
    back = RolloutTrace.load(path)
    assert back.to_dict() == json.loads(json.dumps(trace.to_dict()))
    assert not (tmp_path / "t.json.tmp").exists()
    t = CostTable(TABLE)
    assert replay(back, t, "as-logged").seconds == replay(trace, t, "as-logged").seconds


def test_trace_start_stop_errors(traced):
    _, _, llm = traced
    with pytest.raises(RuntimeError, match="start_trace"):
        llm.stop_trace()
    llm.start_trace()
    with pytest.raises(RuntimeError, match="already"):
        llm.start_trace()
    assert llm.stop_trace().steps == []
    assert llm.engine.trace is None


def test_bad_tables():
    def broken(**kw):
        doc = json.loads(json.dumps(TABLE))
        for k, v in kw.items():
            if k.startswith("forward_"):
                doc["forward"][k[8:]] = v
            else:
                doc[k] = v
        return doc

    cases = [(broken(format="x"), "not a step-cost table"), (broken(version=9), "version 9"),
             (broken(kind="guess"), "kind='guess'"),
             (broken(forward_tokens=[5, 1]), "forward.tokens must be strictly ascending"),
             (broken(forward_context=[0, 2]), "forward.context must be a non-empty list"),
             (broken(forward_seconds=[[1.0, 2.0]]), "must be 2 rows"),
             (broken(forward_seconds=[[1.0, -2.0], [1.0, 1.0]]), "finite and >= 0"),
             (broken(step_s=-1), "step_s=-1"),
             (broken(draft={"d": {"speed": 1}}), "draft.d must be an object"),
             (broken(policy={"auto": {"step_s": -1}}), "policy.auto.step_s=-1")]
    for doc, msg in cases:
        with pytest.raises(ValueError, match=msg):
            CostTable(doc, "t")


def test_bad_traces_and_policies(tmp_path):
    doc = synthetic_trace().to_dict()
    with pytest.raises(ValueError, match="not a rollout trace"):
        RolloutTrace.from_dict({"steps": []})
    with pytest.raises(ValueError, match="version 2"):
        RolloutTrace.from_dict(dict(doc, version=2))
    bad = json.loads(json.dumps(doc))
    del bad["steps"][1]["forward_tokens"]
    with pytest.raises(ValueError, match=r"step 1 lacks \['forward_tokens'\]"):
        RolloutTrace.from_dict(bad)
    bad = json.loads(json.dumps(doc))
    del bad["steps"][2]["decode"][0]["ctx"]
    with pytest.raises(ValueError, match=r"step 2 decode row 0 lacks \['ctx'\]"):
        RolloutTrace.from_dict(bad)
    bad = json.loads(json.dumps(doc))
    bad["steps"][2]["decode"][0]["seq"] = 9
    with pytest.raises(ValueError, match=r"unknown sequences \[9\]"):
        RolloutTrace.from_dict(bad)
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        RolloutTrace.load(path)
    with pytest.raises(ValueError, match="not JSON"):
        CostTable.load(path)
    for policy in ["fast", "static:4", "static:d=0", "static:d=2,q=1"]:
        with pytest.raises(ValueError, match="policy"):
            parse_policy(policy)
    trace, table = synthetic_trace(), CostTable(TABLE)
    with pytest.raises(ValueError, match="no draft nodes from source 'eagle'"):
        replay(trace, table, "static:d=2,source=eagle")
    with pytest.raises(ValueError, match="branching k=2"):
        replay(trace, table, "static:d=2,k=2")


def test_replay_cli(tmp_path):
    """bench/replay.py: a table row per policy with the speedup over off; bad input exits 2."""
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    trace, table = tmp_path / "trace.json", tmp_path / "table.json"
    synthetic_trace().save(trace)
    table.write_text(json.dumps(TABLE))
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(root / "bench" / "replay.py"), "--trace", str(trace),
           "--table", str(table), "--out", str(out)]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["off", "as-logged", "static:d=2"]
    t = CostTable(TABLE)
    off = replay(synthetic_trace(), t, "off").seconds
    assert rows[1]["speedup_vs_off"] == pytest.approx(
        off / replay(synthetic_trace(), t, "as-logged").seconds)
    assert "| synthetic | measured | as-logged |" in res.stdout and "0.080" in res.stdout
    table.write_text(json.dumps(dict(TABLE, kind="guess")))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and "kind='guess'" in res.stderr


def test_default_policies_name_a_source_for_merged_traces(traced):
    """A trace whose nodes come from sources other than the drafter's name (a merged drafter:
    here "a" and "b" under "ngram") gets a static policy of its busiest source, which replays."""
    import importlib.util

    path = Path(__file__).parent.parent / "bench" / "replay.py"
    spec = importlib.util.spec_from_file_location("bench_replay", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _, trace, _ = traced
    policies = mod.default_policies(trace)
    assert policies[:2] == ["off", "as-logged"]
    assert policies[2].startswith("static:d=3") and policies[2].split("source=")[1] in {"a", "b"}
    with pytest.raises(ValueError, match="no draft nodes from source 'ngram'"):
        replay(trace, CostTable(TABLE), "static:d=3")
    assert replay(trace, CostTable(TABLE), policies[2]).seconds > 0


def test_rl_epochs_same_batch_ratio_is_not_moved_by_the_mix_of_batch_sizes(monkeypatch):
    """``bench/rl_epochs.py``: two rows that run every step at the same speed per running
    count, one spending its bucket-8 time at 5 sequences and the other at 8 (a CPU step costs
    the same at both): the bucket ratio reads 0.82, the same-batch ratio 1.0; a row twice as
    fast at each count reads 2.0."""
    import importlib.util

    bench = Path(__file__).parent.parent / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("bench_rl_epochs", bench / "rl_epochs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def steps(plan):  # (running, tokens, seconds) per step -> (end, running, tokens)
        out, t = [], 0.0
        for running, tokens, sec in plan:
            t += sec
            out.append((t, running, tokens))
        return out

    off = steps([(8, 8, 0.05)] * 10 + [(5, 5, 0.05)] * 10)
    late = steps([(8, 8, 0.05)] * 2 + [(5, 5, 0.05)] * 18)
    fast = steps([(8, 16, 0.05)] * 10 + [(5, 10, 0.05)] * 10)
    mixed = mod.bucket_ratios(mod.bucket_rates(late), mod.bucket_rates(off))
    assert mixed[8] == pytest.approx(106 / 130)
    assert mod.same_batch_ratios(late, off) == {8: pytest.approx(1.0)}
    assert mod.same_batch_ratios(fast, off) == {8: pytest.approx(2.0)}
    assert mod.same_batch_ratios(steps([(3, 3, 0.05)]), off) == {}  # a count off never ran
