"""Batched sampling (``specengine.sampling.batched``) gives the per-row definitions' results bit for
bit (``reference_sampling.py``): processed logits, drawn tokens, logprob entries, verified
trees, noise rows; and seeded engine outputs are unchanged."""

import random

import pytest
import reference_sampling as ref
import torch
from helpers import rand_prompts
from reference_sampling import process_logits, sample
from reference_verify import verify_tree

from specengine import LLM, SamplingParams
from specengine.engine.sequence import Sequence
from specengine.models.loader import save_random_model
from specengine.ops import kernels
from specengine.ops.extension import ext
from specengine.sampling import batched
from specengine.sampling import sampler as sampler_mod
from specengine.sampling.batched import (
    TOP_P_WINDOW,
    NoiseStreams,
    argmax_rows,
    draw,
    gather_noise,
    noise_batch,
    process_rows,
    race,
    softmax_race,
    softmax_rows,
    store_noise,
)
from specengine.sampling.params import SampleNoise, noise_rows
from specengine.sampling.sampler import Sampler
from specengine.speculative.tree import DraftTree

EOS = 3
PARAMS = [  # greedy, temperatures, top-k, top-p (inside and past the window), min-p, mixes
    dict(temperature=0), dict(temperature=1e-6), dict(), dict(temperature=0.7),
    dict(temperature=1.3), dict(top_k=1), dict(top_k=5), dict(top_k=50, temperature=0.7),
    dict(top_k=-1), dict(top_k=10 ** 6), dict(top_p=0.9), dict(top_p=0.5, temperature=0.7),
    dict(top_p=0.95), dict(top_p=0.999, temperature=1.3), dict(top_p=0.3, top_k=40),
    dict(min_p=0.05), dict(min_p=0.1, temperature=0.7), dict(min_p=0.3, top_p=0.9),
    dict(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02), dict(top_p=0.0999999)]


def mixed_params(rng: random.Random, n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(**rng.choice(PARAMS), **kw) for _ in range(n)]


def logits_rows(g: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Flat (wide nuclei), medium and peaked rows; half rounded to bfloat16 (many exact ties,
    as a bf16 model's logits have), a few entries -inf (masked tokens)."""
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0])[torch.randint(0, 4, (rows, 1), generator=g)]
    x = torch.randn(rows, vocab, generator=g) * scale
    tied = torch.rand(rows, generator=g) < 0.5
    x[tied] = x[tied].bfloat16().float()
    x[torch.rand(rows, vocab, generator=g) < 0.01] = float("-inf")
    return x


def test_process_rows_is_the_per_row_definition_bit_for_bit():
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    wide = tied_cut = 0
    for vocab in [2000] * 30 + [300] * 10 + [49152] * 2:
        params = mixed_params(rng, 24)
        x = logits_rows(g, 24, vocab)
        want = ref.process_logits_per_row(x, params)
        before = x.clone()
        assert torch.equal(process_logits(x, params), want)
        assert torch.equal(process_rows(x, params, copy=False), want)
        assert torch.equal(x, before)  # not modified
        for row, p in zip(x, params):  # how often the hard cases came up
            if p.top_p < 1 and not p.greedy:
                probs = torch.softmax(ref.process_logits_per_row(row[None], [SamplingParams(
                    temperature=p.temperature, top_k=p.top_k)])[0], -1)
                vals = torch.sort(probs, descending=True).values
                before_mass = vals.cumsum(0) - vals
                n = int((before_mass < p.top_p).sum().clamp(min=1))
                wide += n > TOP_P_WINDOW
                tied_cut += n < vocab and bool(vals[n - 1] == vals[n])
    assert wide >= 20 and tied_cut >= 5  # the full sort and ties at the cut were exercised
    # top-p exactly at a reachable mass: the token whose preceding mass equals it is dropped
    for vocab, n in ((2000, 7), (2000, 400), (300, 120)):  # window, full sort, small vocab
        x = torch.randn(1, vocab, generator=g) * 0.2
        vals = torch.sort(torch.softmax(x[0], -1), descending=True).values
        p = [SamplingParams(top_p=float((vals.cumsum(0) - vals)[n]))]
        kept = torch.isfinite(process_rows(x, p)[0])
        assert int(kept.sum()) == n and torch.equal(kept, torch.isfinite(
            ref.process_logits_per_row(x, p)[0]))
    # the comparison sees one-ulp differences: temperature as a product by 1/T is not the same
    x = logits_rows(g, 4, 2000)
    p = [SamplingParams(temperature=0.7)] * 4
    assert not torch.equal(x * (1 / 0.7), ref.process_logits_per_row(x, p))
    # rows at temperature 1 with no filter and greedy rows are left alone (no copy if asked)
    plain = [SamplingParams(), SamplingParams(temperature=0)] * 2
    assert process_rows(x, plain, copy=False) is x
    out = process_rows(x, plain)
    assert out is not x and torch.equal(out, x)
    with pytest.raises(ValueError, match=r"one SamplingParams per row.*\(4, 2000\) and 3"):
        process_rows(x, plain[:3])


def test_draw_is_the_per_row_exponential_race():
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    for _ in range(40):
        params = mixed_params(rng, 16)
        x = ref.process_logits_per_row(logits_rows(g, 16, 1000), params)
        keys = [SampleNoise(rng.randrange(1 << 30), 0).key for _ in params]
        positions = [rng.randrange(100) for _ in params]
        noise = [noise_rows(k, [q], 1000)[0] for k, q in zip(keys, positions)]
        want = ref.sample_per_row(x, params, noise)
        sampled = torch.stack([e for e, p in zip(noise, params) if not p.greedy])
        assert torch.equal(draw(x, params, sampled), want)
        assert torch.equal(sample(x, params, noise), want)
        streams = NoiseStreams([k for k, p in zip(keys, params) if not p.greedy],
                               [q for q, p in zip(positions, params) if not p.greedy])
        assert torch.equal(draw(x, params, streams), want)
    greedy = [SamplingParams(temperature=0)] * 2
    assert draw(x[:2], greedy, None).tolist() == x[:2].argmax(-1).tolist()
    with pytest.raises(ValueError, match=r"noise must be \[1, 1000\].*got \(2, 1000\)"):
        draw(x[:1], [SamplingParams()], sampled[:2])
    with pytest.raises(ValueError, match="noise streams must be 1 .* 2 keys and 2 positions"):
        draw(x[:1], [SamplingParams()], NoiseStreams([1, 2], [0, 0]))
    with pytest.raises(ValueError, match="noise is None but 1 rows are sampled"):
        draw(x[:1], [SamplingParams()], None)


def race_cases(g: torch.Generator, rng: random.Random):
    """Probability rows of every kind the race meets: dense, peaked, bf16-tied, mostly zero
    (filtered), one-hot, all zero, tiny, NaN (softmax of an all -inf row), odd sizes."""
    for trial in range(40):
        S, V = rng.choice([1, 3, 17]), rng.choice([5, 8, 9, 1000, 8192, 8193, 49152])
        x = torch.randn(S, V, generator=g) * rng.choice([0.3, 1, 3, 10, 100])
        if trial % 3 == 0:
            x = x.bfloat16().float()
        x[torch.rand(S, V, generator=g) < rng.choice([0.0, 0.2, 0.99])] = float("-inf")
        x[:, rng.randrange(V)] = 0.0
        p = torch.softmax(x, -1)
        if trial == 1:
            p[0] = float("nan")
        elif trial == 2:
            p[0, 3:] = float("nan")
        elif trial == 3:
            p[:] = 0.0
        elif trial == 4:
            p[:] = 1e-40
        elif trial == 5:
            p[:] = 0.0
            p[:, -1] = 1.0
        yield p, NoiseStreams([rng.randrange(1 << 62) for _ in range(S)],
                              [rng.randrange(10 ** 6) for _ in range(S)])


def test_race_is_argmax_of_probs_over_the_noise_rows(monkeypatch):
    """``race`` with streams (``exponential_race``: the noise never stored, most logarithms
    skipped) gives ``argmax(p / E)`` of the materialized noise, NaN and ties as torch."""
    rng, g = random.Random(5), torch.Generator().manual_seed(5)
    cases = list(race_cases(g, rng))
    for p, streams in cases:
        want = (p / noise_batch(streams.keys, streams.positions, p.shape[1])).argmax(-1)
        assert torch.equal(race(p, streams), want)
        assert torch.equal(race(p, noise_batch(streams.keys, streams.positions, p.shape[1])),
                           want)
    nan_rows = [race(p, s)[0].item() for p, s in cases[1:3]]
    assert nan_rows == [0, 3]  # the first NaN, as torch.argmax
    mod = ext()
    if mod is None:
        return
    # an extension without exponential_race (built before it): noise_batch and a division
    old = type("OldExt", (), {"exponential_noise_batch": staticmethod(mod.exponential_noise_batch),
                              "exponential_noise": staticmethod(mod.exponential_noise)})
    p, streams = cases[10]
    want = race(p, streams)
    monkeypatch.setattr(batched, "ext", lambda: old)
    assert torch.equal(race(p, streams), want)
    with pytest.raises(ValueError, match=r"probs must be a \[S, V >= 1\] float32"):
        mod.exponential_race(p.double(), torch.tensor(streams.keys),
                             torch.tensor(streams.positions))
    with pytest.raises(ValueError, match="probs must have one row per key"):
        mod.exponential_race(p, torch.tensor(streams.keys + [1]),
                             torch.tensor(streams.positions + [1]))


def argmax_cases(g: torch.Generator):
    """``[R, V]`` float32 rows for an argmax: widths below, at and past a 16-lane vector and a
    16k-value chunk; repeated maxima within a lane, across lanes and across chunks; NaN first,
    late, in a tail and in a later chunk; rows of -inf, of +inf, of equal values."""
    for V in (1, 5, 15, 16, 17, 31, 33, 1003, 16384, 16385, 40000, 49152):
        for R in (1, 3):
            yield torch.randn(R, V, generator=g)
        x = torch.randint(-3, 3, (4, V), generator=g).float()  # many ties of the maximum
        yield x
        if V > 1:
            y = torch.randn(5, V, generator=g)
            y[0, :] = float("-inf")
            y[1, :] = 2.0
            y[2, V // 2] = float("inf")
            y[2, V - 1] = float("inf")
            y[3, V - 1] = float("nan")
            y[4, V // 3] = float("nan")
            y[4, V - 1] = float("nan")
            yield y
    z = torch.randn(3, 49152, generator=g)
    z[:, 20000] = z[:, 40000] = 9.0  # the maximum in two later chunks
    z[1, 70 % 49152] = 9.0  # and in the first one
    yield z
    yield torch.randn(64, 49152, generator=g)[:, ::2]  # a strided view
    yield torch.randn(0, 7, generator=g)


def test_argmax_rows_across_lanes_chunks_and_views(monkeypatch):
    """``argmax_rows`` (the extension's ``argmax_rows`` on the CPU: 16 lanes, 16k-value chunks
    in parallel) gives ``torch.argmax``'s index in every row where a tie or a NaN falls across
    a lane, a vector tail or a chunk boundary, and of a strided view; without the extension,
    ``max(-1).indices``."""
    cases = list(argmax_cases(torch.Generator().manual_seed(3)))
    for x in cases:
        assert torch.equal(argmax_rows(x), x.argmax(-1)), tuple(x.shape)
    mod = ext()
    if mod is None:
        return
    with pytest.raises(ValueError, match=r"x must be a \[R, V >= 1\] float32 CPU tensor"):
        mod.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must be a \[R, V >= 1\] float32 CPU tensor"):
        mod.argmax_rows(torch.zeros(2, 0))
    monkeypatch.setattr(batched, "ext", lambda: None)
    for x in cases[:8]:
        assert torch.equal(argmax_rows(x), x.argmax(-1))


def softmax_cases(g: torch.Generator):
    """Logit rows of every kind a sampled step meets, as one batch per vocabulary size:
    dense at several scales, bf16-tied, mostly ``-inf`` (filtered), a single finite entry, a NaN,
    all ``-inf`` and ``+inf`` rows, across vector tails and 8192-value chunk boundaries."""
    for V in (1, 5, 16, 17, 8191, 8192, 8193, 20000, 49152):
        x = torch.randn(10, V, generator=g) * torch.tensor([[0.3], [1], [3], [10], [100], [1],
                                                             [1], [1], [1], [1]])
        x[5] = x[5].bfloat16().float()
        x[6, torch.rand(V, generator=g) < 0.9] = float("-inf")
        x[6, 0] = 0.0
        x[7] = float("-inf")
        x[7, V // 2] = 2.0
        x[8, V - 1] = float("nan")
        x[9] = float("-inf")
        yield x, torch.cat([x[:1], x[:1].clone().fill_(float("inf"))])


def test_softmax_rows_one_definition_for_every_batch_and_thread_count():
    """``softmax_rows`` gives each row the same bits alone as in any batch and on one thread as
    on all (its sum runs over fixed 8192-value chunks in order); a ``-inf`` logit gets
    probability 0, a row with a NaN or an infinite max is all NaN as torch.softmax gives; the
    values are torch.softmax's to float32 precision; without the extension, torch.softmax."""
    for x, inf_rows in softmax_cases(torch.Generator().manual_seed(5)):
        got = softmax_rows(x)
        bits = got.view(torch.int32)
        for r in range(len(x)):
            assert torch.equal(softmax_rows(x[r:r + 1]).view(torch.int32), bits[r:r + 1])
        assert torch.equal(softmax_rows(x[3:8]).view(torch.int32), bits[3:8])
        with kernels.kernel_threads(True, threads=1):
            assert torch.equal(softmax_rows(x).view(torch.int32), bits)
        want = torch.softmax(x, -1)
        finite = slice(0, 8)
        assert torch.allclose(got[finite], want[finite], rtol=2e-5, atol=1e-30)
        assert bool((got[finite][x[finite] == float("-inf")] == 0).all())
        assert torch.allclose(got[finite].double().sum(-1), torch.ones(8, dtype=torch.float64),
                              atol=1e-5)
        assert bool(got[8:].isnan().all()) and bool(want[8:].isnan().all())
        assert bool(softmax_rows(inf_rows)[1].isnan().all())
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(6))
    x[0, 0] = -100.0  # exp(-100 - max) is below exp(-87.3): 0
    assert softmax_rows(x)[0, 0] == 0.0
    with pytest.raises(ValueError, match=r"softmax_rows takes \[R, V\] logits"):
        softmax_rows(torch.zeros(5))
    mod = ext()
    if mod is not None:
        with pytest.raises(ValueError, match=r"x must be a \[R, V >= 1\] float32 CPU tensor"):
            mod.softmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    import specengine.sampling.batched as b
    real = b.ext
    try:
        b.ext = lambda: None
        assert torch.equal(softmax_rows(x), torch.softmax(x, -1))
    finally:
        b.ext = real


def test_softmax_race_is_the_race_of_softmax_rows(monkeypatch):
    """``softmax_race`` (the softmax and race of a row on one thread, probabilities never
    stored) draws ``race(softmax_rows(x))``'s tokens on every kind of row, for batches that
    take either path (fewer than two rows per thread: the two kernels) and any thread count;
    without the extension call, the two calls."""
    g, rng = torch.Generator().manual_seed(7), random.Random(7)
    cases = [x for pair in softmax_cases(g) for x in pair]
    cases.append(torch.randn(9, 151936, generator=g) * 3)  # Qwen2.5's vocabulary
    for x in cases:
        streams = NoiseStreams([rng.randrange(1 << 62) for _ in x],
                               [rng.randrange(10 ** 6) for _ in x])
        want = race(softmax_rows(x), streams)
        assert torch.equal(softmax_race(x, streams), want)
        with kernels.kernel_threads(True, threads=1):
            assert torch.equal(softmax_race(x, streams), want)
        for rows in ([0], [len(x) - 1, 0], list(range(1, len(x)))):
            sub = NoiseStreams([streams.keys[r] for r in rows],
                               [streams.positions[r] for r in rows])
            assert torch.equal(softmax_race(x[rows], sub), want[rows])
            assert torch.equal(softmax_race(x, sub, rows), want[rows])  # in place, no gather
            with kernels.kernel_threads(True, threads=1):
                assert torch.equal(softmax_race(x, sub, rows), want[rows])
        twice = [len(x) - 1] * 5  # one row raced under five streams
        sub = NoiseStreams([rng.randrange(1 << 62) for _ in twice], [3] * 5)
        assert torch.equal(softmax_race(x, sub, twice), race(softmax_rows(x[twice]), sub))
    with pytest.raises(ValueError, match=r"rows must index the 9 rows of x"):
        softmax_race(x, NoiseStreams([1], [0]), [9])
    with pytest.raises(ValueError, match="noise streams must be 2 .* 1 keys"):
        softmax_race(x, NoiseStreams([1], [0]), [0, 1])
    with pytest.raises(ValueError, match=r"softmax_race takes \[S, V\] logits"):
        softmax_race(torch.zeros(5), NoiseStreams([1], [0]))
    with pytest.raises(ValueError, match="noise streams must be 2 .* 1 keys and 1 positions"):
        softmax_race(x[:2], NoiseStreams([1], [0]))
    mod = ext()
    if mod is not None:
        with pytest.raises(ValueError, match="x must have one row per key"):
            mod.softmax_race(x[:2], torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]))
        with pytest.raises(ValueError, match=r"rows\[1\]=2 is not a row of x"):
            mod.softmax_race(x[:2], torch.tensor([1, 2]), torch.tensor([0, 0]),
                             torch.tensor([0, 2]))
    streams = NoiseStreams([5, 6], [0, 1])
    monkeypatch.setattr(batched, "ext", lambda: None)
    assert torch.equal(softmax_race(x[:2], streams), race(torch.softmax(x[:2], -1), streams))
    assert torch.equal(softmax_race(x, streams, [3, 1]),
                       race(torch.softmax(x[[3, 1]], -1), streams))


@pytest.mark.skipif(ext() is None, reason="specengine._C is not built")
def test_noise_batch_is_the_per_row_call_bit_for_bit():
    rng = random.Random(2)
    keys = [rng.randrange(1 << 62) for _ in range(6)]
    rows = [(rng.choice(keys), rng.randrange(10 ** 6)) for _ in range(20)]
    rows += [rows[3], (keys[0], 0), (keys[0], 10 ** 12)]  # a repeated row, extreme positions
    for vocab in (49152, 1003, 5):
        got = noise_batch([k for k, _ in rows], [p for _, p in rows], vocab)
        assert got.shape == (len(rows), vocab) and got.dtype == torch.float32
        for r, (k, p) in enumerate(rows):
            assert torch.equal(got[r], ext().exponential_noise(k, torch.tensor([p]), vocab)[0])
        assert torch.equal(got[3], got[20])
    mod = ext()
    with pytest.raises(ValueError, match="keys and positions must have the same length"):
        mod.exponential_noise_batch(torch.tensor([1, 2]), torch.tensor([1]), 10)
    with pytest.raises(ValueError, match="keys must be a 1-D int64 tensor"):
        mod.exponential_noise_batch(torch.tensor([1.0]), torch.tensor([1]), 10)
    with pytest.raises(ValueError, match="vocab must be >= 1"):
        mod.exponential_noise_batch(torch.tensor([1]), torch.tensor([1]), 0)


def test_gather_noise_uses_the_cache_draws_the_rest_once_and_stores_copies():
    a, b = SampleNoise(11, 0), SampleNoise(11, 1)
    held = a(5, 300)
    noises, positions = [a, b, a, b, a], [5, 5, 6, 5, 7]
    got, drawn = gather_noise(noises, positions, 300)
    assert drawn == [1, 2, 3, 4]
    for r, (n, p) in enumerate(zip(noises, positions)):
        assert torch.equal(got[r], noise_rows(n.key, [p], 300)[0])
    got[0].zero_()  # a new tensor: the cached row is not touched
    assert held.min() > 0 and a.cached(6, 300) is None  # gather_noise stores nothing
    store_noise(noises, positions, 300, got, [2])
    kept = a.cached(6, 300)
    assert torch.equal(kept, got[2]) and kept.data_ptr() != got[2].data_ptr()
    assert kept.untyped_storage().nbytes() == 300 * 4  # its own copy, not a view of the batch
    alone, drawn = gather_noise([a], [6], 300)
    assert drawn == [] and torch.equal(alone[0], kept)


def make_seqs(rng: random.Random, n_requests: int, **kw) -> list[Sequence]:
    """Requests with 1-3 samples each (sample i of a request: its own noise stream), mixed
    parameters, some with min_tokens and logprobs, at various output positions."""
    seqs = []
    for r in range(n_requests):
        params = SamplingParams(**rng.choice(PARAMS), seed=rng.randrange(1000),
                                min_tokens=rng.choice([0, 0, 3]), max_tokens=50,
                                logprobs=rng.choice([None, None, 0, 2]), **kw)
        prompt = [1] * rng.randrange(1, 5)
        for i in range(rng.choice([1, 1, 3])):
            s = Sequence(f"r{r}", i, prompt, params, SampleNoise(params.seed, i))
            s.token_ids += [7] * rng.randrange(5)
            seqs.append(s)
    return seqs


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampler_sample_matches_the_per_row_sampler(mode):
    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    sampler = Sampler(None, mode, lambda s: [EOS])
    for vocab, steps in ((800, 25), (49152, 2)):
        seqs = make_seqs(rng, 12)
        for step in range(steps):
            x = logits_rows(g, len(seqs), vocab)
            x[:, EOS] = x.max() + 1  # EOS would win wherever it is not masked
            if step % 2:  # some rows' noise was drawn before (a drafter's), the rest is not
                for s in seqs[::3]:
                    s.noise(s.num_output_tokens, vocab)
            want = ref.sampler_sample(sampler, x, seqs)
            got = sampler.sample(x, seqs)
            assert got == want
            for s, t in zip(seqs, got[0]):
                s.token_ids.append(t)
    assert any(lp is not None for lp in got[1])


def test_sampler_masks_stop_ids_in_place_and_puts_them_back_when_no_row_wants_logprobs(
        monkeypatch):
    """Without logprobs the ``min_tokens`` mask is written into the logits themselves (no
    [R, V] copy) for the draw only: the tokens are the per-row sampler's, no masked row draws
    a stop id, and the logits are as they came, also after an error in the draw."""
    rng, g = random.Random(5), torch.Generator().manual_seed(5)
    sampler = Sampler(None, "raw_logprobs", lambda s: [EOS, EOS + 1])
    seqs = []
    for r in range(10):
        params = SamplingParams(**rng.choice(PARAMS), seed=r, min_tokens=rng.choice([0, 3]),
                                max_tokens=50)
        s = Sequence(f"r{r}", 0, [1, 2], params, SampleNoise(params.seed, 0))
        s.token_ids += [7] * rng.randrange(5)
        seqs.append(s)
    masked_rows = [r for r, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
    assert masked_rows and len(masked_rows) < len(seqs)
    x = logits_rows(g, len(seqs), 900)
    x[:, EOS] = x.max() + 1  # a stop id would win wherever it is not masked
    before = x.clone()
    want = ref.sampler_sample(sampler, x.clone(), seqs)
    assert torch.equal(x, before)
    got = sampler.sample(x, seqs)
    assert got == want and got[1] == [None] * len(seqs)
    assert all(got[0][r] not in (EOS, EOS + 1) for r in masked_rows)
    assert torch.equal(x, before)

    def fail(*a, **k):
        assert (x[masked_rows, EOS] == float("-inf")).all()  # masked while drawing
        raise RuntimeError("draw failed")
    monkeypatch.setattr(sampler_mod, "draw", fail)
    with pytest.raises(RuntimeError, match="draw failed"):
        sampler.sample(x, seqs)
    assert torch.equal(x, before)


def random_tree(rng: random.Random, root_row: torch.Tensor, vocab: int) -> DraftTree:
    """Up to 8 nodes; children carry likely tokens of the root's row so that some are
    accepted, siblings distinct."""
    likely = torch.topk(root_row, 4).indices.tolist()
    tokens, parents = [], []
    for i in range(rng.randrange(0, 9)):
        parent = rng.randrange(-1, i)
        taken = {tokens[c] for c in range(i) if parents[c] == parent}
        free = [t for t in likely + [rng.randrange(vocab)] if t not in taken]
        tokens.append(rng.choice(free))
        parents.append(parent)
    return DraftTree(tokens, parents)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_verify_trees_matches_the_per_tree_verification(mode, monkeypatch):
    rng, g = random.Random(4), torch.Generator().manual_seed(4)
    sampler = Sampler(None, mode, lambda s: [EOS])
    vocab, accepted = 600, 0
    raced = []  # rows per softmax_race call: only the rows the walks reach are drawn
    real_race = sampler_mod.softmax_race
    monkeypatch.setattr(sampler_mod, "softmax_race",
                        lambda x, noise, rows=None: raced.append(
                            x.shape[0] if rows is None else len(rows))
                        or in_place.append(rows is not None) or real_race(x, noise, rows))
    in_place = []  # per call: raced in the forward's logits (no gather)
    for _ in range(12):
        seqs = make_seqs(rng, 8)
        rows = torch.randn(len(seqs), vocab, generator=g) * 6  # peaked: drafts get accepted
        trees = [random_tree(rng, rows[i], vocab) for i in range(len(seqs))]
        logits = [rows[i:i + 1].repeat(t.num_nodes + 1, 1) for i, t in enumerate(trees)]
        logits = [lg + torch.randn(lg.shape, generator=g) * 0.5 for lg in logits]
        want = [ref.sampler_verify(sampler, s, t, lg) for s, t, lg in zip(seqs, trees, logits)]
        raced.clear()
        got = sampler.verify_trees(seqs, trees, logits)
        assert got == want
        accepted += sum(len(a) for a, _, _ in got)
        walked = [1 + len(a) for (a, _, _), s in zip(got, seqs) if not s.params.greedy]
        assert sum(raced) == sum(walked) and len(raced) == max(walked, default=0)
        # the noise was raced, never stored: no SampleNoise cache holds a row
        assert all(s.noise.cached(s.num_output_tokens + d, vocab) is None
                   for s, t in zip(seqs, trees) for d in range(t.max_depth + 1))
        assert verify_tree(sampler, seqs[0], trees[0], logits[0]) == want[0]
        # as the engine hands them: views of one forward's [R, V] logits
        views = list(torch.cat(logits).split([t.num_nodes + 1 for t in trees]))
        assert sampler.verify_trees(seqs, trees, views) == want
    assert accepted >= 20 and any(in_place) and not all(in_place)
    with pytest.raises(ValueError, match=r"logits\[0\] must be \[m \+ 1 = 2, V\]"):
        sampler.verify_trees(seqs[:1], [DraftTree([1], [-1])], [torch.zeros(3, vocab)])
    with pytest.raises(ValueError, match="tree 0: a draft token 600 is outside the vocabulary"):
        sampler.verify_trees(seqs[:1], [DraftTree([600], [-1])], [torch.zeros(2, vocab)])
    with pytest.raises(ValueError, match="one entry per tree, got 2, 1 and 1"):
        sampler.verify_trees(seqs[:2], trees[:1], logits[:1])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("tiny"), {"num_hidden_layers": 2}, seed=1)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "topk": 2, "policy": "static"}])
def test_seeded_outputs_are_those_of_the_per_row_sampler(tiny_dir, spec, monkeypatch):
    """Whole generations (plain and speculative) with mixed parameters and n > 1: the same
    tokens and logprobs as with the per-row ``Sampler.sample`` / ``Sampler.verify``."""
    llm = LLM(str(tiny_dir), dtype="float32", block_size=8, speculative_config=spec)
    rng = random.Random(5)
    prompts = [p * 3 for p in rand_prompts(12, lo=3, hi=12, seed=6)]  # repeats: n-gram drafts
    params = [SamplingParams(**rng.choice(PARAMS), seed=100 + i, n=rng.choice([1, 3]),
                             max_tokens=24, ignore_eos=True, logprobs=rng.choice([None, 1]))
              for i in range(len(prompts))]

    def run():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(o.token_ids, o.logprobs) for o in r.outputs] for r in outs]

    got = run()
    monkeypatch.setattr(Sampler, "sample", ref.sampler_sample)
    monkeypatch.setattr(Sampler, "verify_trees", lambda self, seqs, trees, logits: [
        ref.sampler_verify(self, s, t, lg) for s, t, lg in zip(seqs, trees, logits)])
    assert run() == got
    assert len({tuple(t) for r in got for t, _ in r}) > 10  # varied samples, not a constant
    if spec is not None:
        assert llm.get_metrics()["accepted_tokens"] > 0


def test_argmax_rows_is_torch_argmax_with_ties_nan_and_inf():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        r, v = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 3000, (1,),
                                                                               generator=g))
        x = torch.randint(-2, 3, (r, v), generator=g).float()  # many tied maxima
        if trial % 3 == 0:
            x[torch.rand(r, v, generator=g) < 0.01] = float("nan")
        if trial % 4 == 0:
            x[torch.rand(r, v, generator=g) < 0.3] = float("-inf")
        if trial % 7 == 0:
            x[0] = float("-inf")
        assert torch.equal(argmax_rows(x), x.argmax(-1)), trial
