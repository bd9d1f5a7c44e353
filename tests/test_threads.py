"""The adaptive thread count (specengine.ops.threads.ThreadTuner) with an injected clock, and the
kernels' thread-count invariance it relies on (outputs must not depend on the count)."""

import pytest
import torch

from specengine import LLM, SamplingParams
from specengine.models.loader import save_random_model
from specengine.ops import kernels
from specengine.ops.extension import ext
from specengine.ops.threads import ThreadTuner, adaptive_from_env
from tests.helpers import rand_prompts


class FakeClock:
    """A clock the test advances: ``cost(threads)`` seconds per timed step."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_steps(tuner, clock, n, cost, rows=1):
    """Run ``n`` steps of ``rows`` tokens whose time is ``cost(threads)``; returns the counts."""
    used = []
    for _ in range(n):
        threads = tuner.choose(rows)
        with tuner.timed(rows, threads):
            clock.now += cost(threads)
        used.append(threads)
    return used


def quiet(threads):  # 2 threads faster
    return {1: 10e-3, 2: 6e-3}[threads]


def busy(threads):  # a neighbour on the second core: 2 threads wait for descheduled helpers
    return {1: 12e-3, 2: 30e-3}[threads]


def test_quiet_keeps_all_threads_and_busy_switches_to_one():
    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, probe_every=64, samples=4, min_gap=16, max_backoff=1)
    used = run_steps(t, clock, 300, quiet)
    assert t.buckets[1].current == 2 and t.switches == 0
    assert t.probes >= 3  # it did try 1 thread, and kept 2
    assert used.count(1) == 4 * t.probes  # the probes' steps, and nothing else, ran at 1
    run_steps(t, clock, 100, busy)
    assert t.buckets[1].current == 1 and t.switches == 1
    assert t.stats()["kernel_threads"] == {"1-1": 1}


def test_switches_back_when_the_neighbour_leaves():
    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, probe_every=64, samples=4, min_gap=16)
    run_steps(t, clock, 20, busy)  # warm-up + the first probe (due at once)
    assert t.buckets[1].current == 1
    # at 1 thread the neighbour costs little (12 -> 10 ms, within drift): the periodic probe
    used = run_steps(t, clock, 64 + 8 + 10, quiet)
    assert t.buckets[1].current == 2 and t.switches == 2
    assert used[-10:] == [2] * 10


def test_a_neighbour_arriving_starts_a_probe_early():
    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, probe_every=256, samples=4, min_gap=16)
    run_steps(t, clock, 20, quiet)
    assert t.buckets[1].current == 2 and t.probes == 1
    used = run_steps(t, clock, 40, busy)  # 6 -> 30 ms at 2 threads: beyond drift
    assert t.buckets[1].current == 1 and t.probes == 2
    assert used[-10:] == [1] * 10


def test_no_switch_within_margin():
    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, probe_every=32, samples=4, min_gap=8, margin=0.05)
    run_steps(t, clock, 200, lambda n: {1: 10e-3, 2: 10.2e-3}[n])  # 1 thread 2% faster
    assert t.buckets[1].current == 2 and t.switches == 0 and t.probes >= 5


def test_probes_at_a_bounded_rate():
    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, probe_every=100, samples=4, min_gap=30, warmup=2,
                    max_backoff=1)
    run_steps(t, clock, 1002, quiet)  # steady: one probe per 100 steps at the current count
    assert 8 <= t.probes <= 10
    # step times that jump around every step: early probes, but never closer than min_gap
    t2 = ThreadTuner(2, clock=clock, probe_every=100, samples=4, min_gap=30, warmup=0)
    starts, i = [], [0]

    def erratic(n):
        i[0] += 1
        return (1e-3 if i[0] % 2 else 50e-3) * (1 if n == 2 else 1.5)

    for step in range(600):
        before = t2.buckets[1].candidate if 1 in t2.buckets else None
        run_steps(t2, clock, 1, erratic)
        if before is None and t2.buckets[1].candidate is not None:
            starts.append(step)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 5 and min(gaps) >= 30 + 8  # min_gap steps + the probe's own steps


def test_buckets_are_separate_and_new_ones_start_from_the_nearest():
    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, probe_every=64, samples=2, min_gap=8)
    run_steps(t, clock, 20, busy, rows=1)
    run_steps(t, clock, 20, quiet, rows=64)
    assert t.buckets[t.bucket_of(1)].current == 1
    assert t.buckets[t.bucket_of(64)].current == 2
    assert t.choose(2) == 1  # bucket 2-3 starts from 1-1's count (nearest)
    assert t.bucket_of(64) == t.bucket_of(127) != t.bucket_of(128)


def test_more_threads_are_probed_too():
    clock = FakeClock()
    t = ThreadTuner(4, clock=clock, probe_every=16, samples=2, min_gap=4)
    run_steps(t, clock, 400, lambda n: 0.01 * abs(n - 2) + 0.01)  # 2 threads best
    assert t.buckets[1].current == 2
    t.buckets[1].current = 1
    run_steps(t, clock, 100, lambda n: 0.01 * abs(n - 3) + 0.01)  # now 3 best: climbs
    assert t.buckets[1].current == 3


def test_disabled_or_one_thread_always_full_count():
    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, enabled=False)
    assert set(run_steps(t, clock, 100, busy)) == {2} and t.probes == 0
    t1 = ThreadTuner(1, clock=clock)
    assert set(run_steps(t1, clock, 100, lambda n: 1.0)) == {1} and t1.probes == 0


def test_bad_arguments_and_env(monkeypatch):
    with pytest.raises(ValueError, match="max_threads"):
        ThreadTuner(0)
    with pytest.raises(ValueError, match="min_gap"):
        ThreadTuner(2, probe_every=8, min_gap=16)
    with pytest.raises(ValueError, match="samples"):
        ThreadTuner(2, samples=0)
    with pytest.raises(ValueError, match="max_backoff"):
        ThreadTuner(2, max_backoff=0)
    monkeypatch.setenv("SPECENGINE_ADAPTIVE_THREADS", "0")
    assert adaptive_from_env() is False
    monkeypatch.setenv("SPECENGINE_ADAPTIVE_THREADS", "")
    assert adaptive_from_env() is True
    monkeypatch.setenv("SPECENGINE_ADAPTIVE_THREADS", "sometimes")
    with pytest.raises(ValueError, match="SPECENGINE_ADAPTIVE_THREADS"):
        adaptive_from_env()


needs_ext = pytest.mark.skipif(ext() is None, reason="the C++ extension is not built")


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_do_not_depend_on_the_thread_count(two_threads, dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3000, 576, generator=g) * 0.05).to(dtype)
    x = torch.randn(5, 576, generator=g).to(dtype)
    pw, glu = kernels.prepack(w), kernels.prepack(w[:2048], glu=True)
    outs = []
    for threads in (1, 2):
        with kernels.kernel_threads(True, threads):
            assert ext().pool_threads() == threads
            outs.append((kernels.linear(x, pw), kernels.linear(x, w),
                         kernels.linear_glu(x, glu), kernels.rms_norm(x, w[0], 1e-6)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def mid_dir(tmp_path_factory):
    """A random Llama large enough that every kernel splits its work into several chunks."""
    return save_random_model(tmp_path_factory.mktemp("mid_llama"), {
        "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_hidden_layers": 2}, seed=3)


@needs_ext
def test_outputs_do_not_depend_on_the_thread_count(two_threads, mid_dir):
    if not kernels.packed_covers(1):  # e.g. SPECENGINE_ISA=generic: torch's threads only
        pytest.skip("no packed kernels under this instruction-set cap: the tuner is not used")
    llm = LLM(str(mid_dir), dtype="bfloat16", kv_cache_memory_bytes=16 << 20, block_size=8)
    prompts = [{"prompt_token_ids": p} for p in rand_prompts(6, vocab=4096, seed=1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=2)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=12, min_tokens=12, logprobs=2)
    t = llm.engine.threads
    results = []
    for threads in (1, 2, "adaptive"):
        if threads == "adaptive":  # switches mid-run: probes every few steps
            t.enabled, t.max_threads, t.probe_every, t.min_gap, t.samples, t.warmup = \
                True, 2, 2, 1, 1, 0
        else:
            t.enabled, t.max_threads = False, threads
        outs = llm.generate(prompts, greedy, use_tqdm=False) + \
            llm.generate(prompts, sampled, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert t.probes > 0  # the adaptive run did try the other count
    assert results[0] == results[1] == results[2]
    m = llm.get_metrics()
    assert m["kernel_threads_max"] == 2 and set(m["kernel_threads"].values()) <= {1, 2}


@needs_ext
def test_pool_many_calls_beside_a_busy_process(two_threads):
    """Thousands of short pool jobs while another process spins: the caller sleeps while a
    descheduled helper holds a chunk, late helpers stop spinning; every result stays exact and
    nothing hangs (a lost wake-up would)."""
    import subprocess
    import sys

    g = torch.Generator().manual_seed(1)
    w = torch.randn(1024, 256, generator=g).bfloat16()
    pw = kernels.prepack(w)
    xs = [torch.randn(m, 256, generator=g).bfloat16() for m in (1, 3, 8)]
    with kernels.kernel_threads(True, 1):
        want = [kernels.linear(x, pw) for x in xs]
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with kernels.kernel_threads(True, 2):
            for i in range(3000):
                assert torch.equal(kernels.linear(xs[i % 3], pw), want[i % 3])
    finally:
        proc.kill()
        proc.wait()


@needs_ext
def test_pool_counters(two_threads):
    w = kernels.prepack(torch.randn(2048, 256).bfloat16())
    x = torch.randn(2, 256).bfloat16()
    ext().pool_stats(True)
    with kernels.kernel_threads(True, 1):
        kernels.linear(x, w)
    assert ext().pool_stats()["jobs"] == 0  # one thread: inline, no pool job
    with kernels.kernel_threads(True, 2):
        for _ in range(10):
            kernels.linear(x, w)
    s = ext().pool_stats(True)
    assert s["jobs"] == 10 and 0 <= s["sleeps"] <= s["waits"] <= 10
    assert ext().pool_stats() == dict.fromkeys(s, 0)


def test_a_new_bucket_probes_after_min_gap_steps_and_flags_its_probe_steps(monkeypatch):
    """The first bucket probes at once; a bucket that starts from a neighbour's count runs
    ``warmup + min_gap`` steps at that count first (a policy's first steps at a new draft size
    are not a probe's) when the neighbour's last probe was close; when it lost big, the new
    bucket takes the neighbour's verdict and interval (no probe for ``backoff * probe_every``
    steps). Inside ``step``, ``probe_step`` is True exactly on the steps run at the probed
    count."""
    monkeypatch.setattr(kernels, "packed_covers", lambda rows: True)

    def close(threads):  # 1 thread 5% slower: within drift
        return {1: 6.3e-3, 2: 6e-3}[threads]

    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, probe_every=64, samples=2, min_gap=8, warmup=2)
    first = run_steps(t, clock, 6, close, rows=1)
    assert first[2:] == [1, 2, 1, 2]  # after warm-up, the first bucket's probe at once
    assert t.buckets[1].backoff == 1
    used = run_steps(t, clock, 2 + 8, close, rows=4)  # new bucket 4-7: no probe yet
    assert used == [2] * 10 and t.buckets[t.bucket_of(4)].candidate is None
    probe = []
    for _ in range(4):
        with t.step(4):
            probe.append(t.probe_step)
            clock.now += close(1 if t.probe_step else 2)
    assert probe == [True, False, True, False] and t.probe_step is False
    lost = ThreadTuner(2, clock=clock, probe_every=64, samples=2, min_gap=8, warmup=2)
    run_steps(lost, clock, 6, quiet, rows=1)  # 1 thread 1.67x slower: lost big
    assert lost.buckets[1].backoff == 2
    used = run_steps(lost, clock, 2 + 2 * 64, quiet, rows=4)
    assert used == [2] * (2 + 2 * 64) and lost.buckets[lost.bucket_of(4)].backoff == 2
    assert run_steps(lost, clock, 1, quiet, rows=4) == [1]  # the interval's probe


def test_a_faster_step_at_the_full_count_rebases_and_a_slower_one_probes():
    """Steps getting faster (a neighbour left, a shorter context) at the full count start no
    probe (no count above it to try): the reference moves to the new times, and a slowdown
    beyond ``drift`` from there starts one early; below the full count a speedup does."""
    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, probe_every=1000, samples=4, min_gap=16, warmup=0)
    run_steps(t, clock, 8, lambda n: {1: 20e-3, 2: 12e-3}[n])  # the first probe: 2 stays
    assert t.probes == 1 and t.buckets[1].ref == pytest.approx(12e-3)
    used = run_steps(t, clock, 100, lambda n: {1: 12e-3, 2: 6e-3}[n])  # 2x faster
    assert used == [2] * 100 and t.probes == 1 and t.buckets[1].ref == pytest.approx(6e-3)
    run_steps(t, clock, 40, lambda n: {1: 7e-3, 2: 9e-3}[n])  # 1.5x slower than 6 ms
    assert t.probes == 2 and t.buckets[1].current == 1
    used = run_steps(t, clock, 40, lambda n: {1: 4e-3, 2: 2e-3}[n])  # faster at 1 thread
    assert t.probes == 3 and t.buckets[1].current == 2 and used[-10:] == [2] * 10


def test_probes_that_lose_big_back_off_and_a_change_still_starts_one():
    """1 thread 1.67x slower (beyond ``drift``): the periodic probe's interval doubles after
    each, up to ``max_backoff`` x ``probe_every`` (probes after 0, 100, 200, 400, 800, 800
    steps); a neighbour arriving still starts one within ``min_gap`` steps and the switch
    resets the interval; a close call keeps it at ``probe_every``."""
    clock = FakeClock()
    t = ThreadTuner(2, clock=clock, probe_every=100, samples=4, min_gap=30, warmup=2,
                    max_backoff=8)
    used = run_steps(t, clock, 2 + 8 + 100 + 8 + 200 + 8 + 400 + 8 + 800 + 8 + 700, quiet)
    assert t.probes == 5 and t.buckets[1].backoff == 8 and used.count(1) == 4 * 5
    used = run_steps(t, clock, 60, busy)  # 6 -> 30 ms at 2 threads: beyond drift
    assert t.buckets[1].current == 1 and t.switches == 1 and t.buckets[1].backoff == 1
    assert used[-10:] == [1] * 10
    close = ThreadTuner(2, clock=clock, probe_every=50, samples=2, min_gap=10, max_backoff=8)
    run_steps(close, clock, 600, lambda n: {1: 10.3e-3, 2: 10e-3}[n])  # 3% apart
    assert close.buckets[1].backoff == 1 and close.probes >= 10
