"""Batch invariance and trainer replay, bit for bit, in bfloat16 and float32.

A sample's tokens and logprobs (top-k included, compared with ``==``) must not depend on the
other requests in the step, the number of rows, how the prompt's prefill was chunked, the
prefix cache, n samples in one request or in n, preemption, the kernel thread count,
speculation (any drafter or tree shape), sleep/wake, a no-op weight update or the engine's
history; ``LLM.score`` and ``prompt_logprobs`` must equal the logprobs generation returned.
The methods follow vLLM's ``tests/v1/determinism`` (needle among fillers, cold vs hot cache)
and SGLang's deterministic-inference test. ``test_negative_control`` forces the
non-invariant path (torch's GEMM above two rows) and must find a difference, so the
comparisons can fail.

Which kernels run depends on the CPU (AMX, AVX-512, AVX2: ``kernels.active_isa``); every
test holds on each (``SPECENGINE_ISA=avx2`` runs the AVX2 kernels on a bigger CPU).
"""

import os
import random

import pytest
import torch
from helpers import rand_prompts
from safetensors.torch import load_file

from specengine import LLM, SamplingParams
from specengine.kv import kv_bytes_per_block
from specengine.models.loader import load_config, save_random_model
from specengine.ops import kernels

DTYPES = ["bfloat16", "float32"]
BS = 8
# The engine's device: "cpu", or "cuda" to run every test on a GPU (the CUDA attention kernel
# and kernels.CUDA_ROWS-row linear layers): SPECENGINE_TEST_DEVICE=cuda python -m pytest ...
DEVICE = os.environ.get("SPECENGINE_TEST_DEVICE", "cpu")


def make(target_dir, dtype, spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 16 << 20)
    kw.setdefault("device", DEVICE)
    if spec is not None:
        spec = {"policy": "static", **spec}
    return LLM(str(target_dir), dtype=dtype, block_size=BS, speculative_config=spec, **kw)


def params(seed=7, n=1, max_tokens=20):
    """Greedy, seeded T=1 and seeded T=0.8 / top-p / top-k, each with top-3 logprobs."""
    return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens,
                           ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=seed + 1, n=n,
                           max_tokens=max_tokens, ignore_eos=True, logprobs=3)]


def key(out):
    """A request's samples as (token ids, per token the sorted (token, logprob, rank))."""
    return [(tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob, lp.rank)
                                                    for t, lp in e.items()))
                                       for e in c.logprobs)) for c in out.outputs]


def run(llm, prompts, sps):
    """Every prompt with every params of ``sps``: a flat list of ``key``s."""
    outs = llm.generate([p for p in prompts for _ in sps], [sp for _ in prompts for sp in sps],
                        use_tqdm=False)
    return [key(o) for o in outs]


def first_difference(a, b) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"request {i}: {str(x)[:200]} != {str(y)[:200]}"
    return "lengths differ" if len(a) != len(b) else "none"


NEEDLES = rand_prompts(2, lo=30, hi=60, seed=100)


def lower_isas() -> list[str]:
    """Instruction-set caps below this CPU's that it can run (``kernels.set_isa``)."""
    native = kernels.active_isa()
    lower = ["avx512"] if native == "amx" else []  # the AVX-512 BF16 kernels, no AMX tiles
    if native in ("avx512", "amx") and _avx2_under_cap():
        lower.append("avx2")
    return lower


def _avx2_under_cap() -> bool:
    prev = kernels.active_isa()
    try:
        return kernels.set_isa("avx2") == "avx2"
    finally:
        kernels.set_isa(prev)


@pytest.fixture(params=["native", *(lower_isas() if DEVICE == "cpu" else [])])
def isa(request):
    """The CPU's own kernels, then each lower instruction set it can run (the AVX-512 kernels
    on an AMX machine, the AVX2 kernels on an AVX-512 / AMX machine); restored after the
    test."""
    prev = kernels.active_isa()
    if request.param != "native":
        kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(prev)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fillers", [16, 64])
def test_needle_alone_equals_needle_among_fillers(target_dir, dtype, fillers, isa):
    """vLLM's needle test: the needle prompts alone, then at random positions among
    ``fillers`` other prompts of random lengths (prefill rows up to ~2,500, decode rows up
    to ~200 per step), on the same engine (its history differs) and on a fresh one."""
    llm = make(target_dir, dtype)
    alone = run(llm, NEEDLES, params())
    rng = random.Random(fillers)
    batch = rand_prompts(fillers, lo=4, hi=80, seed=fillers)
    where = sorted(rng.sample(range(fillers + len(NEEDLES)), len(NEEDLES)))
    for w, needle in zip(where, NEEDLES):
        batch.insert(w, needle)
    sps = params()
    for engine in (llm, make(target_dir, dtype)):
        got = run(engine, batch, sps)
        among = [x for i in where for x in got[i * len(sps):(i + 1) * len(sps)]]
        assert among == alone, first_difference(among, alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [16, 64, 256])
def test_prefill_chunks_equal_one_prefill(target_dir, dtype, chunk):
    """The prompt's prefill run in chunks of ``chunk`` tokens (each chunk one request whose
    leading blocks come from the prefix cache) gives what one whole prefill gives."""
    prompt = rand_prompts(1, lo=300, hi=301, seed=5)[0]
    whole = run(make(target_dir, dtype, enable_prefix_caching=False), [prompt], params())
    llm = make(target_dir, dtype)
    for end in range(chunk, len(prompt), chunk):
        llm.generate([prompt[:end]], SamplingParams(max_tokens=1), use_tqdm=False)
    hits = llm.get_metrics()["prefix_cache_hit_tokens"]
    assert run(llm, [prompt], params()) == whole
    assert llm.get_metrics()["prefix_cache_hit_tokens"] - hits >= len(prompt) - chunk - BS


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_cache_cold_warm_off_and_a_second_call(target_dir, dtype):
    prompts = rand_prompts(12, lo=10, hi=70, seed=3)
    llm = make(target_dir, dtype)
    cold = run(llm, prompts, params())
    warm = run(llm, prompts, params())
    assert llm.get_metrics()["prefix_cache_hit_tokens"] > 0
    off = run(make(target_dir, dtype, enable_prefix_caching=False), prompts, params())
    assert cold == warm == off


@pytest.mark.parametrize("dtype", DTYPES)
def test_n_samples_in_one_request_equal_separate_requests(target_dir, dtype):
    """n=8 shares one prefill; sample 0 of it equals each of 8 one-sample requests with the
    same seed (sample index 0 each: same noise), which the scheduler groups or not."""
    prompt = rand_prompts(1, lo=40, hi=41, seed=9)[0]
    for caching in (True, False):
        llm = make(target_dir, dtype, enable_prefix_caching=caching)
        sp8, sp1 = params(seed=4, n=8)[1], params(seed=4)[1]
        grouped = key(llm.generate([prompt], sp8, use_tqdm=False)[0])
        single = [key(o)[0] for o in llm.generate([prompt] * 8, sp1, use_tqdm=False)]
        assert single == [grouped[0]] * 8
        assert len(set(grouped)) > 1  # the samples do differ from each other


@pytest.mark.parametrize("dtype", DTYPES)
def test_preemption_under_kv_pressure(target_dir, dtype):
    prompts = rand_prompts(10, lo=20, hi=40, seed=11)
    sps = params(max_tokens=40)
    roomy = run(make(target_dir, dtype), prompts, sps)
    cfg = load_config(target_dir)
    per_block = kv_bytes_per_block(cfg, BS, getattr(torch, dtype))
    tight = make(target_dir, dtype, kv_cache_memory_bytes=24 * per_block)
    assert run(tight, prompts, sps) == roomy
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_threads_one_and_two(target_dir, dtype):
    prompts = rand_prompts(6, lo=10, hi=50, seed=13)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(make(target_dir, dtype), prompts, params())
        torch.set_num_threads(2)
        two = run(make(target_dir, dtype), prompts, params())
    finally:
        torch.set_num_threads(before)
    assert one == two


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3,
                    "topk": 2},
    "eagle-chain": {"method": "eagle", "model": "random", "num_speculative_tokens": 4},
    "eagle-tree": {"method": "eagle", "model": "random", "num_speculative_tokens": 3,
                   "topk": 2, "num_verify_tokens": 6},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "suffix+eagle": {"method": ["suffix", "eagle"], "model": "random",
                     "num_speculative_tokens": 3, "topk": 2, "num_verify_tokens": 6},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SPECS))
def test_speculation_equals_plain_decoding(target_dir, draft_dir, dtype, name, isa):
    """Every drafter and tree shape commits the tokens plain decoding samples, with the same
    logprob bits (a verified tree node's row equals the decode row at that position)."""
    spec = dict(SPECS[name])
    if spec.get("model") == "DRAFT":
        spec["model"] = str(draft_dir)
    # repetitive prompts so the n-gram and suffix drafters find matches
    prompts = [p * 3 for p in rand_prompts(4, lo=5, hi=12, seed=17)]
    sps = params(n=2, max_tokens=24)
    plain = run(make(target_dir, dtype), prompts, sps)
    llm = make(target_dir, dtype, spec)
    assert run(llm, prompts, sps) == plain
    assert llm.get_metrics()["drafted_tokens"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_sleep_wake_and_a_noop_weight_update(target_dir, dtype):
    prompts = rand_prompts(4, lo=10, hi=40, seed=19)
    llm = make(target_dir, dtype)
    first = run(llm, prompts, params())
    llm.sleep(1)
    llm.wake_up()
    assert run(llm, prompts, params()) == first
    llm.update_weights(load_file(str(target_dir / "model.safetensors")))
    assert run(llm, prompts, params()) == first


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("spec", [None, "eagle-tree"])
def test_score_equals_generation_logprobs(target_dir, dtype, mode, spec):
    """Trainer replay: ``LLM.score`` of sampled completions gives, bit for bit, the
    logprobs generation returned (raw and processed, top-k entries too), with penalties and
    ``min_tokens`` in the params; ``prompt_logprobs`` over prompt + completion gives the raw
    ones too."""
    llm = make(target_dir, dtype, SPECS[spec] if spec else None, logprobs_mode=mode)
    prompts = rand_prompts(5, lo=5, hi=60, seed=23)
    sp = SamplingParams(n=3, temperature=0.9, top_p=0.95, top_k=50, seed=5, max_tokens=30,
                        min_tokens=5, repetition_penalty=1.2, presence_penalty=0.3,
                        logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    samples = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
    scored = llm.score([p for p, _ in samples], [c.token_ids for _, c in samples], sp,
                       logprobs=2)
    for (p, c), s in zip(samples, scored):
        assert s.token_ids == c.token_ids and s.prompt_token_ids == p
        want = c.sampled_logprobs
        assert (s.logprobs if mode == "raw_logprobs" else s.processed_logprobs) == want
        assert s.top_logprobs == c.logprobs
    if mode == "raw_logprobs":
        p, c = samples[0]
        o = llm.generate([p + c.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=2),
                         use_tqdm=False)[0]
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p) + len(c.token_ids)
        tail = [e[t].logprob for e, t in zip(o.prompt_logprobs[len(p):], c.token_ids)]
        assert tail == c.sampled_logprobs
    assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


def test_score_input_errors(target_dir):
    llm = make(target_dir, "float32", max_model_len=64)
    with pytest.raises(ValueError, match="completions"):
        llm.score([[1, 2]], [[3], [4]])
    with pytest.raises(ValueError, match=r"completions\[0\]"):
        llm.score([[1, 2]], ["abc"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.score([[1, 2]], [[3, 10**6, 4]])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.score([[1, 2]], [[3] * 70])
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.score([[1, 2]], [[3]], logprobs=1000)
    assert llm.score([[1, 2]], [[]])[0].logprobs == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dtype_float32(target_dir, dtype):
    """``head_dtype="float32"``: logits from a float32 copy of the head (a float32 model is
    unchanged); replay still exact; the copy follows weight updates."""
    prompts = rand_prompts(4, lo=10, hi=40, seed=29)
    base = run(make(target_dir, dtype), prompts, params())
    llm = make(target_dir, dtype, head_dtype="float32")
    got = run(llm, prompts, params())
    assert (got == base) == (dtype == "float32")
    sp = params()[1]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sc = llm.score([o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs], sp)
    assert [s.logprobs for s in sc] == [o.outputs[0].sampled_logprobs for o in outs]
    with pytest.raises(ValueError, match="head_dtype"):
        make(target_dir, dtype, head_dtype="float16")


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A random model with the default model's widths (hidden 512, FFN 1536), 2 layers: on
    the 64-wide tiny model torch's small GEMMs happen to sum in the kernels' order."""
    return save_random_model(tmp_path_factory.mktemp("wide"), {
        "hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8,
        "num_key_value_heads": 4, "num_hidden_layers": 2}, seed=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control(wide_dir, dtype, monkeypatch):
    """With invariance off and every kernel's row limit at 2, calls of more rows go to
    torch's GEMM: the needle's outputs must then differ (else the comparisons above could
    not fail); with invariance on, the same model and batch give equal outputs."""
    on_alone = run(make(wide_dir, dtype), NEEDLES, params())
    batch = rand_prompts(16, lo=4, hi=80, seed=16) + NEEDLES
    on_among = run(make(wide_dir, dtype), batch, params())[-len(on_alone):]
    assert on_among == on_alone
    for name in ("AMX_MAX_M", "AVX512_MAX_M"):
        monkeypatch.setattr(kernels, name, 2)
    monkeypatch.setattr(kernels, "AVX2_MAX_M", {torch.bfloat16: 2, torch.float32: 2})
    monkeypatch.setattr(kernels, "LINEAR_MAX_M", {torch.bfloat16: 2, torch.float32: 2})
    with kernels.batch_invariance(False):
        llm = make(wide_dir, dtype)
        alone = run(llm, NEEDLES, params())
        among = run(llm, batch, params())[-len(alone):]
    if among == alone and torch_gemm_is_row_invariant(getattr(torch, dtype)):
        pytest.skip("torch's own GEMM gives a row the same bits alone and among 64 rows on "
                    "this CPU and cap, so nothing here can differ")
    assert among != alone


def torch_gemm_is_row_invariant(dtype: torch.dtype) -> bool:
    """Whether ``F.linear`` of the model's widths gives each row the same bits whatever the
    other rows (then the negative control cannot fail: seen on an AMD EPYC Zen 4 under
    ``SPECENGINE_ISA=generic``)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 512, generator=g).to(dtype)
    x = torch.randn(64, 512, generator=g).to(dtype)
    full = torch.nn.functional.linear(x, w)
    return all(torch.equal(torch.nn.functional.linear(x[i:i + 1], w)[0], full[i])
               for i in range(0, 64, 7))


def test_server_answers_the_same_chat_twice_in_bfloat16(tiny_llama_tok_dir):
    """``specengine serve`` in bfloat16: the same T=0 chat asked again (alone, then beside
    other requests, with the prefix cache warm) gives the same tokens and logprobs."""
    pytest.importorskip("fastapi")
    requests = pytest.importorskip("requests")
    from concurrent.futures import ThreadPoolExecutor

    from test_server import Server

    from specengine.server.app import build_app

    llm = LLM(str(tiny_llama_tok_dir), dtype="bfloat16", kv_cache_memory_bytes=16 << 20,
              max_model_len=256)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Name three colours."}],
            "temperature": 0, "max_tokens": 24, "logprobs": True, "top_logprobs": 3,
            "ignore_eos": True}
    other = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 40,
             "temperature": 1.0, "seed": 3, "ignore_eos": True}
    with Server(build_app(llm, "tiny")) as s:
        def chat():
            r = requests.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            return c["message"]["content"], c["logprobs"]

        def complete(_):
            r = requests.post(f"{s.url}/v1/completions", json=other, timeout=60)
            assert r.status_code == 200, r.text

        first = chat()
        assert chat() == first
        with ThreadPoolExecutor(6) as pool:
            busy = [pool.submit(complete, i) for i in range(5)]
            again = pool.submit(chat)
            assert again.result() == first
            for f in busy:
                f.result()
