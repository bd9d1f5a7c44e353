import math

import pytest
import torch
from reference_sampling import process_logits, sample

from specengine.engine.sequence import Sequence
from specengine.ops.extension import ext
from specengine.sampling.params import SampleNoise, SamplingParams, noise_rows
from specengine.speculative.drafters.coupling import (
    TOP_P_WINDOW,
    coupled_logprobs,
    coupled_topk,
    filter_logits,
)


def test_params_validation_names_the_field():
    for kwargs, name in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                         ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 0},
                         "max_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
                         ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"stop": [""]},
                         "stop"), ({"logprobs": -1}, "logprobs"),
                         ({"temperature": float("nan")}, "temperature"),
                         ({"temperature": float("inf")}, "temperature"),
                         ({"top_p": float("nan")}, "top_p"), ({"n": True}, "n"),
                         ({"max_tokens": 1.5}, "max_tokens"),
                         ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"repetition_penalty": -1.2}, "repetition_penalty"),
                         ({"repetition_penalty": float("inf")}, "repetition_penalty"),
                         ({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"presence_penalty": float("nan")}, "presence_penalty"),
                         ({"frequency_penalty": -2.01}, "frequency_penalty"),
                         ({"frequency_penalty": True}, "frequency_penalty")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="unknown sampling parameter.*bogus"):
        SamplingParams.from_dict({"temperature": 1.0, "bogus": 3})
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_top_k_top_p_min_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keep = lambda p: torch.isfinite(process_logits(logits, [p])[0]).tolist()  # noqa: E731
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False, False]
    # top_p=0.8: 0.5+0.2=0.7 < 0.8 so the third token is needed too
    assert keep(SamplingParams(top_p=0.8)) == [True, True, True, False, False]
    assert keep(SamplingParams(top_p=0.7)) == [True, True, False, False, False]
    assert keep(SamplingParams(top_p=0.01)) == [True, False, False, False, False]
    # min_p=0.3: threshold 0.15
    assert keep(SamplingParams(min_p=0.3)) == [True, True, True, False, False]
    assert keep(SamplingParams()) == [True] * 5
    # temperature divides the logits
    out = process_logits(logits, [SamplingParams(temperature=0.5)])
    assert torch.allclose(out, logits / 0.5)
    # greedy rows are untouched
    assert torch.equal(process_logits(logits, [SamplingParams(temperature=0)]), logits)


def test_sampling_matches_the_distribution_chi_square():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.08, 0.02])
    logits = torch.log(probs).repeat(4, 1)
    params = [SamplingParams(seed=1)] * 4
    noises = [SampleNoise(7, i) for i in range(4)]
    counts = torch.zeros(5)
    draws = 5000
    for j in range(draws):
        for t in sample(logits, params, [n(j, 5) for n in noises]).tolist():
            counts[t] += 1
    expected = probs * draws * 4
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # chi-square, 4 dof, p = 0.001
    # a wrong distribution is detected by the same statistic (the test has power)
    wrong = torch.tensor([0.35, 0.35, 0.2, 0.08, 0.02]) * draws * 4
    assert float(((counts - wrong) ** 2 / wrong).sum()) > 18.5


def test_noise_depends_on_seed_sample_and_position_only():
    a, b = SampleNoise(5, 0), SampleNoise(5, 0)
    assert torch.equal(a(3, 100), b(3, 100))
    b(7, 100)  # other positions drawn in between change nothing
    assert torch.equal(a(3, 100), b(3, 100))
    assert not torch.equal(a(3, 100), a(4, 100))
    assert not torch.equal(a(3, 100), SampleNoise(5, 1)(3, 100))
    assert not torch.equal(a(3, 100), SampleNoise(6, 0)(3, 100))
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0)
    alone = [sample(logits[1:2], [p], [a(j, 100)]).item() for j in range(20)]
    batch = [sample(logits, [p] * 3, [SampleNoise(9, 0)(j, 100), b(j, 100),
                                      SampleNoise(1, 3)(j, 100)])[1].item() for j in range(20)]
    assert batch == alone
    assert len(set(alone)) > 3  # really sampling, not a constant


def test_noise_cache_keeps_the_last_positions():
    a = SampleNoise(5, 0)
    first = a(3, 100)
    for j in range(4, 4 + SampleNoise.CACHE_SIZE - 1):
        a(j, 100)
    assert a(3, 100) is first  # still cached (and now the most recent)
    assert a(4, 200) is not a(4, 100)  # keyed by the vocabulary size too
    for j in range(100, 100 + SampleNoise.CACHE_SIZE):
        a(j, 100)
    again = a(3, 100)
    assert again is not first and torch.equal(again, first)  # evicted, drawn again


def _noise_reference(key: int, pos: int, vocab: int) -> torch.Tensor:
    """csrc/noise.cpp's formula in Python integers and float64."""
    import math

    import numpy as np

    mask = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & mask
        z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & mask
        return z ^ (z >> 31)

    row = mix((key + 0xd1b54a32d192ed03 * (pos + 1)) & mask)
    out = []
    for i in range(vocab):
        h = mix((row + 0x9e3779b97f4a7c15 * (i + 1)) & mask) | 1
        v = min(float(np.float32(h)) * 2.0 ** -64, float(np.float32(0.99999994)))
        out.append(-math.log1p(-v))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.skipif(ext() is None, reason="specengine._C is not built")
def test_noise_kernel_matches_formula_and_is_exponential():
    rows = noise_rows(12345, [0, 7, 7, 10 ** 9], 49152)
    assert rows.dtype == torch.float32 and rows.shape == (4, 49152)
    assert torch.equal(rows[1], rows[2])  # a row depends only on (key, position)
    assert not torch.equal(rows[0], rows[1])
    assert torch.equal(noise_rows(12345, [7], 49152)[0], rows[1])
    for r, pos in ((1, 7), (3, 10 ** 9)):
        ref = _noise_reference(12345, pos, 300)
        torch.testing.assert_close(rows[r, :300].double(), ref, rtol=3e-7, atol=0)
    # Exp(1): mean 1, variance 1, P(E > 2) = e^-2; all positive and finite
    e = rows.double()
    assert (e > 0).all() and torch.isfinite(e).all()
    assert abs(e.mean() - 1) < 0.01 and abs(e.var() - 1) < 0.03
    assert abs((e > 2).double().mean() - math.exp(-2)) < 0.003


def test_batched_draft_filter_is_process_logits_within_the_window():
    """``filter_logits`` keeps what ``process_logits`` keeps, except that a top-p nucleus
    (without top-k) is cut at the ``TOP_P_WINDOW`` most likely tokens."""
    g = torch.Generator().manual_seed(0)
    V = 1000
    scale = torch.tensor([0.5, 2.0, 8.0]).repeat_interleave(4)[:, None]  # flat .. peaked rows
    logits = torch.randn(12, V, generator=g) * scale
    cut_rows = 0
    for params in [[p] * 12 for p in [
            SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=5),
            SamplingParams(top_k=400, temperature=1.3), SamplingParams(top_p=0.9),
            SamplingParams(top_p=0.5, top_k=50), SamplingParams(min_p=0.1),
            SamplingParams(temperature=0.8, top_p=0.95, min_p=0.02),
            SamplingParams(top_p=0.99, top_k=300)]] + [
            [SamplingParams(top_p=0.5), SamplingParams(top_k=3), SamplingParams(min_p=0.2),
             SamplingParams(top_k=400, top_p=0.9)] * 3]:
        want = process_logits(logits, params)
        for row, p in zip(want, params):
            if p.top_p < 1 and not p.top_k and torch.isfinite(row).sum() > TOP_P_WINDOW:
                row[row < torch.topk(row, TOP_P_WINDOW).values[-1]] = -torch.inf
                cut_rows += 1
        assert torch.allclose(filter_logits(logits, params), want)
    assert cut_rows >= 4


def test_coupled_draft_argmax_is_the_targets_sample():
    """With the draft equal to the target, the coupled draft's best token is exactly the token
    sampling draws (also through a permuted draft vocabulary); greedy rows keep the plain
    draft log-probabilities."""
    g = torch.Generator().manual_seed(1)
    V = 300
    logits = torch.randn(40, V, generator=g) * 3
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k, seed=0)
              for t, tp, k in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 10), (0.0, 1.0, 0)]]
    seqs = [Sequence("r", i % 3, [1], params[i % 4], SampleNoise(7, i % 3)) for i in range(40)]
    positions = [i // 4 for i in range(40)]
    noise = [s.noise(j, V) for s, j in zip(seqs, positions)]
    want = sample(process_logits(logits, [s.params for s in seqs]), [s.params for s in seqs],
                  noise)
    lp = coupled_logprobs(logits, seqs, positions, V)
    assert torch.equal(lp.argmax(-1), want)
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    assert torch.equal(lp[greedy], torch.log_softmax(logits[greedy], -1))
    vmap = torch.randperm(V, generator=g)
    lp = coupled_logprobs(logits[:, vmap], seqs, positions, V, vmap)
    assert torch.equal(vmap[lp.argmax(-1)], want)


@pytest.mark.parametrize("mapped", [False, True])
def test_coupled_topk_equals_topk_of_coupled_logprobs(mapped):
    """``coupled_topk`` (one extension call for the rows without filters or penalties, torch
    for the others) gives the children ``torch.topk(coupled_logprobs)`` gives: the same
    indices, log-probabilities within a few ulp, over a batch mixing greedy, temperature-only,
    filtered and penalised rows, with and without a draft vocabulary map."""
    g = torch.Generator().manual_seed(3)
    V, Vd, k = 5000, 1200, 4
    vmap = torch.randperm(V, generator=g)[:Vd] if mapped else None
    logits = torch.randn(48, Vd if mapped else V, generator=g) * 4
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.6),
             dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, top_k=20),
             dict(temperature=1.0, min_p=0.05), dict(temperature=1.0, presence_penalty=1.0),
             dict(temperature=0.0, repetition_penalty=1.3)]
    seqs = [Sequence("r", i, [1, 2, 3] + list(range(10, 10 + i)),
                     SamplingParams(seed=i, **kinds[i % len(kinds)]), SampleNoise(11, i))
            for i in range(48)]
    positions = [i % 7 for i in range(48)]
    paths = [[5 + i % 3] for i in range(48)]
    want = torch.topk(coupled_logprobs(logits, seqs, positions, V, vmap, paths), k, dim=-1)
    values, indices = coupled_topk(logits, k, seqs, positions, V, vmap, paths)
    assert torch.equal(indices, want.indices)
    assert torch.allclose(values, want.values, rtol=0, atol=1e-5)
    if ext() is not None:  # the extension call itself: greedy and temperature-only rows
        plain = [r for r, s in enumerate(seqs) if r % len(kinds) < 3]
        v, i = ext().coupled_topk(
            logits[plain], k, torch.tensor([seqs[r].params.temperature for r in plain]),
            torch.tensor([seqs[r].noise.key for r in plain]),
            torch.tensor([positions[r] for r in plain]), vmap)
        assert torch.equal(i, want.indices[plain])
        assert torch.allclose(v, want.values[plain], rtol=0, atol=1e-5)


@pytest.mark.skipif(ext() is None, reason="needs the C++ extension")
def test_coupled_topk_rejects_bad_input():
    mod, x = ext(), torch.randn(2, 8)
    keys, pos = torch.tensor([1, 2]), torch.tensor([0, 0])
    for args, kwargs, what in [
            ((x, 3, torch.tensor([1.0, -1.0]), keys, pos), {}, "temperature must be >= 0"),
            ((x, 9, torch.tensor([1.0, 1.0]), keys, pos), {}, "k must be in"),
            ((x, 2, torch.tensor([1.0]), keys, pos), {}, "temperature must be a"),
            ((x, 2, torch.tensor([1.0, 1.0]), keys[:1], pos), {}, "keys and positions"),
            ((x.double(), 2, torch.tensor([1.0, 1.0]), keys, pos), {}, "logits must be"),
            ((x, 2, torch.tensor([1.0, 1.0]), keys, pos), {"vocab_map": torch.arange(7)},
             "vocab_map must be"),
            ((x, 2, torch.tensor([1.0, 1.0]), keys, pos),
             {"vocab_map": torch.arange(8) - 1}, "token ids >= 0")]:
        with pytest.raises(ValueError, match=what):
            mod.coupled_topk(*args, **kwargs)
