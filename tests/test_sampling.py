import pytest
import torch

from specengine.sampling import SampleNoise, SamplingParams, process_logits, sample


def test_params_validation_names_the_field():
    for kwargs, name in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                         ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 0},
                         "max_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
                         ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"stop": [""]},
                         "stop"), ({"logprobs": -1}, "logprobs")]:
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
