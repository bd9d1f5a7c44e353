"""Sample migration between two engines (two-stage KV transfer, or re-prefill): outputs are
token for token those of an unmoved run, at every stage boundary, with and without speculation;
KV blocks come back on both engines; metrics, the cost rule and the errors."""

import pickle

import pytest
import torch
from helpers import rand_prompts

from specengine import LLM, SamplingParams
from specengine.engine.sequence import SequenceStatus
from specengine.lifecycle.migration import MigrationCost, merge_outputs
from specengine.models.loader import save_random_model

SPECS = {
    None: None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "policy": "static"},
    "eagle": {"method": "eagle", "model": "random", "num_speculative_tokens": 3, "topk": 2,
              "num_verify_tokens": 5, "policy": "static"},
}


def make(target_dir, spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(str(target_dir), dtype="float32", block_size=8, speculative_config=SPECS[spec],
               **kw)


@pytest.fixture(scope="module")
def plain(target_dir):
    return make(target_dir)


def workload(max_tokens=16):
    """Greedy and seeded T=1 requests (one with n=3 and logprobs) over random prompts; some
    with a repeated pattern so n-gram drafts get accepted."""
    prompts = rand_prompts(4, lo=5, hi=30, seed=3)
    prompts[1] = prompts[1][:6] * 4
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                             logprobs=2),
              SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=max_tokens,
                             ignore_eos=True, logprobs=1, presence_penalty=0.5)]
    return prompts, params


def expected(plain, prompts, params):
    outs = plain.generate(prompts, params, use_tqdm=False)
    return {(f"r{i}", o.index): o for i, out in enumerate(outs) for o in out.outputs}


def roundtrip(x):
    """What a Ray actor boundary does to a payload."""
    return pickle.loads(pickle.dumps(x))


def drive(src, dst, prompts, params, move, lead=0, with_kv=True):
    """Run the requests on ``src``; a running sample for which ``move(info)`` holds gets stage
    one then, and ``lead`` source steps later stage two and an import into ``dst`` (payloads
    pickled on the way). Both engines step until done.

    Returns:
        ``({(request id, index): CompletionOutput}, {moved sample: import result})``.
    """
    for i, (p, sp) in enumerate(zip(prompts, params)):
        src.add_request(p, sp, request_id=f"r{i}")
    done, moved, pending = {}, {}, {}
    while src.has_unfinished_requests() or dst.has_unfinished_requests():
        live = {(i.request_id, i.index): i for i in src.running_sequences()}
        for key, info in live.items():
            if key not in moved and key not in pending and info.running and move(info):
                pending[key] = [roundtrip(src.export_prefix(*key)) if lead else None, lead]
        for key, (prefix, left) in list(pending.items()):
            if key not in live:  # finished before stage two
                src.migration.cancel_export(*key)
                del pending[key]
            elif left == 0:
                del pending[key]
                state = roundtrip(src.export_sequence(*key, with_kv=with_kv))
                moved[key] = dst.import_sequence(state, prefix)
            else:
                pending[key][1] -= 1
        for out in src.step() + dst.step():
            for o in out.outputs:
                key = (out.request_id, o.index)
                assert key not in done
                done[key] = o
    return done, moved


def same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        g, w = got[k], want[k]
        assert g.token_ids == w.token_ids, k
        assert g.finish_reason == w.finish_reason and g.text == w.text
        assert (g.logprobs is None) == (w.logprobs is None)
        if w.logprobs is not None:
            assert [sorted(d) for d in g.logprobs] == [sorted(d) for d in w.logprobs]
            assert g.sampled_logprobs == pytest.approx(w.sampled_logprobs, abs=1e-5)


def at_baseline(*llms):
    for llm in llms:
        m = llm.get_metrics()
        assert m["kv_blocks_free"] == m["kv_blocks_total"]
        assert not llm.engine.requests and not llm.engine.scheduler.running
        d = llm.engine.drafter
        if d is not None and hasattr(d, "blocks"):
            assert d.blocks.num_free == d.blocks.num_blocks and not d.states


STAGES = {  # when a sample moves, and source steps between stage one and two
    "after_prefill": (lambda i: i.num_output_tokens >= 1, 0),
    "mid_decode": (lambda i: i.num_output_tokens >= 5, 2),
    "before_finish": (lambda i: i.max_tokens - i.num_output_tokens <= 2, 0),
}


@pytest.mark.parametrize("spec", [None, "ngram", "eagle"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_kv_migration_is_exact(target_dir, plain, spec, stage):
    prompts, params = workload()
    want = expected(plain, prompts, params)
    src, dst = make(target_dir, spec), make(target_dir, spec)
    when, lead = STAGES[stage]
    # move every sample except two of the n=3 request's (only some samples of it move)
    got, moved = drive(src, dst, prompts, params,
                       lambda i: when(i) and (i.request_id, i.index) not in
                       {("r3", 0), ("r3", 2)}, lead=lead)
    same(got, want)
    assert set(moved) == {("r0", 0), ("r1", 0), ("r2", 0), ("r3", 1)}
    assert set(moved.values()) == {"kv"}
    m_src, m_dst = src.get_metrics(), dst.get_metrics()
    assert m_src["migrated_out"] == m_dst["migrated_in"] == 4
    assert m_src["migration_stage2_bytes"] > 0 and m_dst["migration_import_bytes"] > 0
    if lead:
        assert m_src["migration_stage1_bytes"] > 0
    if spec is not None and stage != "before_finish":
        assert m_dst["spec_steps"] > 0  # the destination drafted for the moved samples
    at_baseline(src, dst)


@pytest.mark.parametrize("spec", [None, "eagle"])
def test_reprefill_migration_is_exact(target_dir, plain, spec):
    prompts, params = workload()
    want = expected(plain, prompts, params)
    src, dst = make(target_dir, spec), make(target_dir, spec)
    got, moved = drive(src, dst, prompts, params,
                       lambda i: i.num_output_tokens >= 4 and i.index != 0, with_kv=False)
    same(got, want)
    assert moved == {("r3", 1): "reprefill", ("r3", 2): "reprefill"}
    assert src.get_metrics()["reprefilled_out"] == dst.get_metrics()["reprefilled_in"] == 2
    # the first recomputes all its tokens; the second may find the prompt's blocks cached
    assert dst.get_metrics()["prefill_tokens"] >= len(prompts[3]) + 4 + 1
    at_baseline(src, dst)


def test_waiting_sample_moves_as_tokens(target_dir, plain):
    """A sample not admitted yet (no KV) moves as tokens; its siblings stay."""
    prompts, params = workload()
    want = expected(plain, prompts, params)
    src, dst = make(target_dir), make(target_dir)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        src.add_request(p, sp, request_id=f"r{i}")
    with pytest.raises(ValueError, match="not running"):
        src.export_prefix("r3", 2)
    state = roundtrip(src.export_sequence("r3", 2))
    assert state.tail is None and state.num_cached == 0
    assert dst.import_sequence(state) == "reprefill"
    parts = {}
    while src.has_unfinished_requests() or dst.has_unfinished_requests():
        for out in src.step() + dst.step():
            parts.setdefault(out.request_id, []).append(out)
    assert len(parts["r3"]) == 2
    merged = merge_outputs(parts["r3"])
    assert [o.index for o in merged.outputs] == [0, 1, 2]
    got = {(rid, o.index): o for rid, p in parts.items() for o in merge_outputs(p).outputs}
    same(got, want)
    at_baseline(src, dst)


def test_stale_stage_one_after_preemption(target_dir, plain):
    """A sample preempted (and recomputed) between the stages sends all its K/V in stage
    two; the stale stage-one chunk is not used."""
    prompts, params = workload()
    want = expected(plain, prompts, params)
    src, dst = make(target_dir), make(target_dir)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        src.add_request(p, sp, request_id=f"r{i}")
    for _ in range(3):
        src.step()
    prefix = src.export_prefix("r3", 1)  # 25 prompt tokens
    assert prefix.start == 0 and prefix.end % 8 == 0 and prefix.end > 0
    seq = src.engine.requests["r3"].seqs[1]
    src.engine.scheduler.preempt(seq)
    src.step()  # recomputed
    assert seq.status == SequenceStatus.RUNNING
    state = roundtrip(src.export_sequence("r3", 1))
    assert state.tail.start == 0 and state.tail.end == state.num_cached == len(seq) - 1
    assert dst.import_sequence(state, prefix) == "kv"
    got = {}
    while src.has_unfinished_requests() or dst.has_unfinished_requests():
        for out in src.step() + dst.step():
            got.update({(out.request_id, o.index): o for o in out.outputs})
    same(got, want)
    at_baseline(src, dst)


def test_last_running_sample_leaving_returns_the_finished_siblings(target_dir):
    """When the only unfinished sample of a request leaves, the source returns the finished
    ones at its next step; the destination returns the moved one."""
    src, dst = make(target_dir), make(target_dir)
    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    src.add_request([5, 6, 7, 8, 9], sp, request_id="a")
    src.step()
    seqs = src.engine.requests["a"].seqs
    seqs[0].params = SamplingParams(temperature=1.0, seed=3, max_tokens=2, ignore_eos=True)
    src.step()
    assert seqs[0].is_finished and not seqs[1].is_finished
    dst.import_sequence(roundtrip(src.export_sequence("a", 1)))
    assert src.has_unfinished_requests() and "a" not in src.engine.requests
    (part,) = src.step()
    assert [o.index for o in part.outputs] == [0] and not src.has_unfinished_requests()
    outs = []
    while dst.has_unfinished_requests():
        outs += dst.step()
    assert [o.index for o in outs[0].outputs] == [1] and len(outs[0].outputs[0].token_ids) == 12
    at_baseline(src, dst)


def test_metrics_with_an_injected_clock(target_dir):
    src, dst = make(target_dir), make(target_dir)
    ticks = iter(range(100))
    src.migration.clock = dst.migration.clock = lambda: float(next(ticks))
    src.add_request(list(range(1, 20)), SamplingParams(temperature=0, max_tokens=8),
                    request_id="x")
    src.step()
    src.step()  # 20 tokens, 20 cached: stage one covers positions 0..15
    per_token = 2 * 2 * 2 * 16 * 4  # layers x K/V x kv heads x head dim x float32
    prefix = src.export_prefix("x", 0)
    assert (prefix.start, prefix.end, prefix.nbytes) == (0, 16, 16 * per_token)
    info = src.running_sequences()[0]
    assert info.kv_bytes == 20 * per_token and info.num_cached == 20
    state = src.export_sequence("x", 0)
    assert (state.tail.start, state.tail.end) == (16, 20)
    assert dst.import_sequence(state, prefix) == "kv"
    m, d = src.get_metrics(), dst.get_metrics()
    assert m["migration_stage1_seconds"] == 1.0 and m["migration_stage2_seconds"] == 1.0
    assert m["migration_stage1_bytes"] == 16 * per_token
    assert m["migration_stage2_bytes"] == 4 * per_token + 8 * 21
    assert d["migration_import_seconds"] == 1.0
    assert d["migration_import_bytes"] == 20 * per_token + 8 * 21
    assert (m["migrated_out"], d["migrated_in"], m["reprefilled_out"]) == (1, 1, 0)
    while dst.has_unfinished_requests():
        dst.step()
    at_baseline(src, dst)


def test_cost_rule():
    cost = MigrationCost(bandwidth=1e6, latency=0.01)
    assert cost.transfer_seconds(1e6) == pytest.approx(1.02)
    assert cost.choose(1_000_000, prefill_seconds=2.0) == "kv"
    assert cost.choose(1_000_000, prefill_seconds=0.5) == "reprefill"
    with pytest.raises(ValueError, match="bandwidth"):
        MigrationCost(bandwidth=0)


def test_predicted_remaining_learns_from_finished_siblings(target_dir):
    """Without a policy record: all the room until a length is learnt, then the group's
    E[L - c | L > c] from the requests finished by ``step`` (c itself once it outlived them)."""
    llm = make(target_dir)
    llm.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=20,
                                                 ignore_eos=True), request_id="b")
    llm.step()
    (info,) = llm.running_sequences()
    assert info.predicted_remaining_tokens == 19 and info.acceptance_length == 1.0
    llm.abort_request("b")  # aborted: no length learnt
    llm.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=12,
                                                 ignore_eos=True), request_id="c")
    while llm.has_unfinished_requests():
        llm.step()
    llm.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=20,
                                                 ignore_eos=True), request_id="a")
    llm.step()
    llm.step()
    (info,) = llm.running_sequences()
    assert info.num_output_tokens == 2 and info.predicted_remaining_tokens == 10
    for _ in range(12):
        llm.step()
    (info,) = llm.running_sequences()
    assert info.num_output_tokens == 14 and info.predicted_remaining_tokens == 6  # the room
    while llm.has_unfinished_requests():
        llm.step()
    at_baseline(llm)


def test_prefill_seconds_follow_measured_rate(target_dir):
    llm = make(target_dir)
    assert llm.prefill_seconds(100) == pytest.approx(0.1)  # no measurement yet: 1 ms/token
    llm.generate([list(range(1, 40))], SamplingParams(max_tokens=2), use_tqdm=False)
    m = llm.engine.metrics
    assert llm.prefill_seconds(100) == pytest.approx(m.prefill_time / m.prefill_tokens * 100)


def test_import_errors_change_nothing(target_dir):
    src, dst = make(target_dir), make(target_dir, kv_cache_memory_bytes=4096 * 2)
    with pytest.raises(ValueError, match="no unfinished sample"):
        src.export_sequence("nope", 0)
    src.add_request(list(range(1, 30)), SamplingParams(temperature=0, max_tokens=8),
                    request_id="x")
    src.step()
    prefix = src.export_prefix("x", 0)
    state = src.export_sequence("x", 0)
    with pytest.raises(ValueError, match="stage-one chunk"):
        dst.import_sequence(state)  # tail starts at 24: the prefix is needed
    with pytest.raises(RuntimeError, match="KV blocks needed"):
        dst.import_sequence(state, prefix)  # 2 blocks of 8 in the pool
    assert not dst.engine.requests and dst.engine.blocks.num_free == 2
    state.weight_version = 3
    with pytest.raises(ValueError, match="weight version"):
        dst.import_sequence(state, prefix)
    state.weight_version = 0
    other = make(target_dir)
    assert other.import_sequence(state, prefix) == "kv"
    with pytest.raises(ValueError, match="already has that sample"):
        other.import_sequence(state, prefix)
    with pytest.raises(ValueError, match="already in use"):
        other.add_request([1, 2, 3], request_id="x")
    assert other.add_request([1, 2, 3]) != "x"
    while other.has_unfinished_requests():
        other.step()
    at_baseline(src, dst, other)


def test_kv_chunk_shape_must_fit(target_dir, tmp_path):
    src = make(target_dir)
    wide = LLM(str(save_random_model(tmp_path / "w", {"num_hidden_layers": 3}, seed=1)),
               dtype="float32", block_size=8, kv_cache_memory_bytes=8 << 20)
    src.add_request(list(range(1, 12)), SamplingParams(temperature=0, max_tokens=8),
                    request_id="x")
    src.step()
    state = src.export_sequence("x", 0)
    with pytest.raises(ValueError, match="does not fit"):
        wide.import_sequence(state)
    assert wide.engine.blocks.num_free == wide.engine.blocks.num_blocks
    assert state.tail.kv.device.type == "cpu"
    assert src.import_sequence(state) == "kv"  # it fits the engine it came from
    while src.has_unfinished_requests():
        src.step()
    at_baseline(src, wide)


@pytest.mark.parametrize("caching", [True, False])
def test_eagle_features_move_with_the_kv(target_dir, plain, caching):
    """The target features an EAGLE engine keeps per KV slot (with or without prefix caching:
    its drafter reads them there when it drafts) arrive at the destination's drafter and its
    per-slot features."""
    prompts, params = workload()
    want = expected(plain, prompts, params)
    src = make(target_dir, "eagle", enable_prefix_caching=caching)
    dst = make(target_dir, "eagle", enable_prefix_caching=caching)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        src.add_request(p, sp, request_id=f"r{i}")
    for _ in range(3):
        src.step()
    seq = src.engine.requests["r3"].seqs[1]
    blocks = src.engine.blocks
    feats = blocks.features.read(blocks.slots(seq, 0, seq.num_cached))
    prefix = roundtrip(src.export_prefix("r3", 1))
    src.step()
    feats = torch.cat([feats, blocks.features.read(blocks.slots(seq, feats.shape[0],
                                                                seq.num_cached))])
    state = roundtrip(src.export_sequence("r3", 1))
    assert state.tail.features is not None and prefix.features is not None
    assert dst.import_sequence(state, prefix) == "kv"
    moved = dst.engine.requests["r3"].seqs[0]
    assert torch.equal(dst.engine.drafter.features(moved), feats)
    bf = dst.engine.blocks.features
    assert torch.equal(bf.read(dst.engine.blocks.slots(moved, 0, moved.num_cached)), feats)
    got = {}
    while src.has_unfinished_requests() or dst.has_unfinished_requests():
        for out in src.step() + dst.step():
            got.update({(out.request_id, o.index): o for o in out.outputs})
    same(got, want)
    assert dst.get_metrics()["spec_steps"] > 0
    at_baseline(src, dst)


def test_drafter_without_features_gets_a_reprefill(target_dir, plain):
    """A sample sent with K/V but no target features (the source kept none) cannot be drafted
    for by an EAGLE destination: it is re-prefilled there instead, output unchanged."""
    prompts, params = workload()
    want = expected(plain, prompts, params)
    src, dst = make(target_dir, enable_prefix_caching=False), make(target_dir, "eagle")
    got, moved = drive(src, dst, prompts, params, lambda i: i.num_output_tokens >= 3)
    same(got, want)
    assert set(moved.values()) == {"reprefill"} and len(moved) == 6
    assert dst.get_metrics()["reprefilled_in"] == 6
    at_baseline(src, dst)


def test_prefill_seconds_use_the_policys_latency_model(target_dir):
    class Latency:
        num_forward = 3

        def forward_time(self, tokens, context, num_seqs):
            return 0.5 + 0.01 * tokens + context + num_seqs

    llm = make(target_dir)
    llm.engine.policy.latency = Latency()
    assert llm.prefill_seconds(100) == pytest.approx(2.5)


def test_text_and_stop_strings_move(tiny_llama_tok_dir):
    """Detokenized text and the stop-string check continue on the destination: the moved
    sample stops at the same string with the same text."""
    def mk():
        return LLM(str(tiny_llama_tok_dir), dtype="float32", block_size=8,
                   kv_cache_memory_bytes=16 << 20)

    plain, src, dst = mk(), mk(), mk()
    free = plain.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=24,
                                                          ignore_eos=True), use_tqdm=False)
    tok = plain.get_tokenizer()
    stop = tok.decode(free[0].outputs[0].token_ids[10:12]).strip() or "e"
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = {("r0", 0): plain.generate(["Hello there"], sp, use_tqdm=False)[0].outputs[0]}
    assert want[("r0", 0)].finish_reason == "stop" and want[("r0", 0)].stop_reason == stop
    got, moved = drive(src, dst, ["Hello there"], [sp], lambda i: i.num_output_tokens >= 2,
                       lead=1)
    assert moved == {("r0", 0): "kv"}
    same(got, want)
    assert got[("r0", 0)].stop_reason == stop
    at_baseline(src, dst)


def test_harvested_features_follow_the_sample(target_dir):
    """A ``Harvester`` on the destination gets the moved sample's whole feature history: its
    rollout equals the one harvested from an unmoved run."""
    from specengine.speculative.training.harvest import HiddenBuffer, harvest

    prompt, sp = list(range(3, 30)), SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True)
    ref = make(target_dir)
    harvest(ref, want := HiddenBuffer())
    ref.generate([prompt], sp, use_tqdm=False)
    src, dst = make(target_dir), make(target_dir)
    harvest(src, left := HiddenBuffer())
    harvest(dst, got := HiddenBuffer())
    _, moved = drive(src, dst, [prompt], [sp], lambda i: i.num_output_tokens >= 4, lead=1)
    assert moved == {("r0", 0): "kv"}
    assert len(left) == 0  # the source harvests no truncated rollout of it
    (r,), (w,) = got.snapshot(), want.snapshot()
    assert r.token_ids == w.token_ids
    assert r.hidden.shape == w.hidden.shape and torch.allclose(r.hidden, w.hidden, atol=1e-5)
    at_baseline(src, dst)
