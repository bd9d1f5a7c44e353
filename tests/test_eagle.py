"""EAGLE drafter: lossless in the engine, paged drafting == the dense training forward,
checkpoints and their errors, hot swap."""

import json

import pytest
import torch
from helpers import rand_prompts
from reference_sampling import process_logits

from specengine import LLM, SamplingParams
from specengine.engine.batch import BatchEntry
from specengine.engine.model_runner import ModelRunner
from specengine.engine.sequence import Sequence
from specengine.kv.block_manager import BlockManager
from specengine.models.loader import load_model, save_random_model
from specengine.ops import kernels
from specengine.ops.extension import ext
from specengine.sampling.params import SampleNoise
from specengine.speculative.drafters.eagle import (
    EagleConfig,
    EagleDrafter,
    EagleModel,
    load_drafter,
    save_drafter,
)
from specengine.speculative.policy.base import StaticPolicy
from specengine.speculative.strategy import Strategy


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype=torch.float32)


def make(target_dir, spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    if spec is not None:  # the configured tree every step (no adaptive policy)
        spec = {"policy": "static", **spec}
    return LLM(str(target_dir), dtype="float32", block_size=8, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(target_dir):
    return make(target_dir)


def greedy(n=24, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def samples(outs):
    """Per request output, the token ids of each of its samples."""
    return [[c.token_ids for c in o.outputs] for o in outs]


def eagle(d=3, k=1, m=None):
    return {"method": "eagle", "model": "random", "num_speculative_tokens": d, "topk": k,
            "num_verify_tokens": m}


def features(target, tokens):
    """Target features ``[L, H]`` of ``tokens`` by one prefill."""
    runner = ModelRunner(target.model, 32, 8)
    bm = BlockManager(32, 8, runner.copy_block)
    s = Sequence("x", 0, list(tokens), SamplingParams(), SampleNoise(0, 0))
    bm.allocate_shared([s])
    return runner.run([BatchEntry(s, len(s), [s], True)], bm)[1], s


@pytest.mark.parametrize("d,k,m", [(3, 1, None), (4, 3, 8)])
def test_greedy_equals_plain_and_kv_returns(target_dir, plain, d, k, m):
    prompts = rand_prompts(5, seed=4)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(), use_tqdm=False)]
    llm = make(target_dir, eagle(d, k, m))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert got == want
    met = llm.get_metrics()
    assert met["spec_steps"] > 0 and met["drafted_tokens"] > 0
    assert met["kv_blocks_free"] == met["kv_blocks_total"]
    drafter = llm.engine.drafter
    assert drafter.blocks.num_free == drafter.blocks.num_blocks and not drafter.states


class EveryThird(StaticPolicy):
    """The drafter's strategy on every third step, plain decoding on the others."""

    def __init__(self, strategy: Strategy):
        super().__init__(strategy)
        self.calls = 0

    def choose(self, num_running: int) -> Strategy | None:
        self.calls += 1
        return self.strategy if self.calls % 3 == 0 else None


@pytest.mark.parametrize("caching", [True, False])
def test_features_reach_the_drafter_when_it_drafts(target_dir, plain, caching):
    """The engine keeps the target's features per KV slot and hands EAGLE a sequence's missing
    ones when it drafts for it, so plain steps call nothing on the drafter: drafting on every
    third step, the drafts (drafted and accepted tokens) equal those of a drafter that
    observed every step, and every sample equals plain decoding's."""
    prompts = rand_prompts(3, seed=11)
    params = [SamplingParams(n=2, temperature=1.0, seed=3 + i, max_tokens=20, ignore_eos=True)
              for i in range(3)]
    want = samples(plain.generate(prompts, params, use_tqdm=False))
    runs = {}
    for at_draft in (True, False):
        llm = make(target_dir, eagle(3, 2, 5), enable_prefix_caching=caching)
        drafter = llm.engine.drafter
        llm.engine.policy = EveryThird(drafter.strategy)
        drafter.observes_at_draft = at_draft
        calls = []
        observe = drafter.observe
        drafter.observe = lambda s, start, h, calls=calls, observe=observe: (
            calls.append(start), observe(s, start, h))
        outs = llm.generate(prompts, params, use_tqdm=False)
        met = llm.get_metrics()
        runs[at_draft] = (samples(outs),
                          met["drafted_tokens"], met["accepted_tokens"], len(calls))
        assert met["kv_blocks_free"] == met["kv_blocks_total"] and not drafter.states
    assert runs[True][0] == runs[False][0] == want
    assert runs[True][1:3] == runs[False][1:3] and runs[True][2] > 0
    assert runs[True][3] < runs[False][3]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_drafter_kv_is_built_at_prefill_once_per_prompt(target_dir, plain, dtype):
    """At a prompt's prefill EAGLE computes the drafter KV of the prompt once and shares its
    blocks with each of its samples (``EagleDrafter.prefill``), so the first draft catches up on the
    generated tokens only: with drafting on every third step, the trees drafted (tokens,
    parents, scores) and the drafter KV rows each sample ends with are those of building it
    at the first draft, bit for bit, the samples equal plain decoding's, the prompt rows are
    fed once per prompt instead of once per sample, and the drafter's blocks all come back."""
    prompts = rand_prompts(3, seed=21)
    params = [SamplingParams(n=3, temperature=1.0, seed=5 + i, max_tokens=16, ignore_eos=True)
              for i in range(3)]
    want = samples(plain.generate(prompts, params, use_tqdm=False))
    runs = {}
    for at_prefill in (True, False):
        llm = LLM(str(target_dir), dtype=dtype, block_size=8, kv_cache_memory_bytes=8 << 20,
                  speculative_config={"policy": "static", **eagle(3, 2, 5)})
        drafter = llm.engine.drafter
        llm.engine.policy = EveryThird(drafter.strategy)
        if not at_prefill:
            drafter.prefill = lambda samples: []
        trees, rows, catch_up, kv = [], [], [], {}
        propose, feed, release = drafter.propose, drafter._feed_prefix, drafter.release

        def record_propose(seqs, strategy, propose=propose, trees=trees, catch_up=catch_up):
            catch_up.append(sorted(s.catch_up for s in seqs))
            out = propose(seqs, strategy)
            trees.append([(t.tokens, t.parents, t.draft_logprobs) if t else None for t in out])
            return out

        def record_feed(shadows, prefix, feed=feed, rows=rows):
            rows.append(len(prefix.ids))
            return feed(shadows, prefix)

        def record_release(seq, drafter=drafter, release=release, kv=kv):
            st = drafter.states.get(seq.seq_id)
            if st is not None:  # the KV rows of the sample's committed prefix
                sh = st.shadow
                slots = [sh.block_table[j // 8] * 8 + j % 8 for j in range(sh.num_cached)]
                kv[(seq.request_id, seq.index)] = drafter.kv.flatten(1, 2)[:, slots].clone()
            return release(seq)

        drafter.propose, drafter._feed_prefix = record_propose, record_feed
        drafter.release = record_release
        outs = llm.generate(prompts, params, use_tqdm=False)
        met = llm.get_metrics()
        assert met["kv_blocks_free"] == met["kv_blocks_total"] and not drafter.states
        assert drafter.blocks.num_free == drafter.blocks.num_blocks
        runs[at_prefill] = (samples(outs), trees, rows,
                            catch_up, {k: kv[k] for k in sorted(kv)}, met["accepted_tokens"])
    on, off = runs[True], runs[False]
    if dtype == "float32":  # plain is a float32 engine
        assert on[0] == want
    assert on[0] == off[0]
    assert on[1] == off[1] and on[5] == off[5] > 0
    assert on[4].keys() == off[4].keys() and len(on[4]) == 9
    assert all(torch.equal(on[4][k], off[4][k]) for k in on[4])
    prompt_rows = sum(len(p) - 1 for p in prompts)
    assert on[2][:3] == [len(p) - 1 for p in prompts]  # one feed per prompt at its prefill
    assert sum(off[2]) - sum(on[2]) == 2 * prompt_rows  # the other two samples' feeds
    assert max(on[3][0]) <= 3 < min(off[3][0])  # the first draft: generated tokens only


def test_sampling_seeds_reproduce(target_dir):
    llm = make(target_dir, eagle(3, 2, 5))
    prompts = rand_prompts(4, seed=9)
    sp = [SamplingParams(temperature=0.9, seed=i, max_tokens=16, ignore_eos=True)
          for i in range(4)]
    batch = llm.generate(prompts, sp, use_tqdm=False)
    alone = llm.generate([prompts[2]], sp[2], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == batch[2].outputs[0].token_ids
    assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


def test_seeded_sampling_equals_plain_sampling(target_dir, target, plain, tmp_path):
    """Coupled EAGLE drafting (full and permuted reduced draft vocabulary) commits exactly the
    tokens plain sampling draws, at T=1 with top-p / top-k / min-p and mixed with greedy."""
    em = EagleModel(EagleConfig.for_target(target, 200), target.model, torch.float32,
                    torch.randperm(512, generator=torch.Generator().manual_seed(2))[:200])
    save_drafter(em.random_init(7), tmp_path / "ck")
    prompts = rand_prompts(6, seed=13)
    sp = [SamplingParams(temperature=t, top_p=tp, top_k=k, min_p=mp, seed=i, max_tokens=20,
                         ignore_eos=True)
          for i, (t, tp, k, mp) in enumerate([(1.0, 1.0, 0, 0.0), (1.0, 0.9, 0, 0.0),
                                              (1.0, 1.0, 8, 0.0), (1.0, 0.8, 30, 0.0),
                                              (0.7, 1.0, 0, 0.05), (0.0, 1.0, 0, 0.0)])]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    for spec in (eagle(3, 2, 5), {"method": "eagle", "model": str(tmp_path / "ck"),
                                  "num_speculative_tokens": 3}):
        llm = make(target_dir, spec)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want
        assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


def test_paged_drafting_equals_dense_unroll(target):
    """The engine-side drafter (paged KV, tree attention) and the training forward
    (``EagleModel.unroll``) compute the same distributions for every tree node, in one batch:
    a greedy sequence drafts by the plain draft log-probabilities; a sampled one (7 tokens into
    its output) by the noise-coupled ones, ``log_softmax(process(logits) - log E)`` with E its
    noise at the child's output position (7 + depth - 1), read through ``vocab_map``."""
    tokens = torch.randint(0, 512, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    hidden, _ = features(target, tokens)
    vmap = torch.randperm(512, generator=torch.Generator().manual_seed(1))[:300]
    em = EagleModel(EagleConfig.for_target(target, 300), target.model, torch.float32,
                    vmap).random_init(3)
    drafter = EagleDrafter(Strategy(4), em, 64, 8)
    n = len(tokens)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, top_k=100)
    seqs = [Sequence("g", 0, tokens[:12], greedy(), SampleNoise(0, 0)),
            Sequence("s", 0, tokens[:12], sampled, SampleNoise(3, 0))]
    for s in seqs:
        s.token_ids = list(tokens)
        drafter.observe(s, 0, hidden[:n - 1])

    def dense_logprobs(seq, path):
        """Log-probabilities over the draft vocabulary of the children of node ``path``."""
        d = len(path) + 1
        toks = torch.tensor([tokens + path])
        feats = torch.zeros(1, toks.shape[1], 64)
        feats[0, :n - 1] = hidden[:n - 1]
        logits = em.draft_logits(em.unroll(toks, feats, d)[d - 1][0, n - 2][None])
        if seq.params.greedy:
            return torch.log_softmax(logits, -1)[0]
        noise = seq.noise(seq.num_output_tokens + d - 1, 512)[vmap]
        return torch.log_softmax(process_logits(logits, [seq.params]) - noise.log(), -1)[0]

    strategy = Strategy(4, 3, 12)
    for _ in range(2):  # the second call reuses the cached drafter KV
        for seq, tree in zip(seqs, drafter.propose(seqs, strategy)):
            assert tree.num_nodes == 12 and tree.max_depth <= 4
            assert set(tree.tokens) <= set(vmap.tolist())
            for i in range(tree.num_nodes):
                path = [tree.tokens[j] for j in tree.path_to(i)]
                logp = dense_logprobs(seq, path[:-1])
                got = logp[(vmap == path[-1]).nonzero()[0, 0]]
                assert abs(float(got) - tree.draft_logprobs[i]) < 1e-4
                assert int((logp > got).sum()) < 3  # among the top-k of its parent's row
    # a chain is the greedy path: of the draft scores, or of the perturbed ones when sampled
    for seq in seqs:
        chain = drafter.propose([seq], Strategy(3))[0]
        assert chain.parents == [-1, 0, 1]
        for i, tok in enumerate(chain.tokens):
            assert vmap[dense_logprobs(seq, chain.tokens[:i]).argmax()] == tok


def _propose_rounds(target, dtype, in_extension: bool, whole_layer: bool = False):
    """Three ``propose`` rounds (a chain and two trees) over five sequences of different
    lengths (greedy, T = 1, T = 0.7): the whole prefix fed first, then three rows per sequence
    (two committed tokens and the last row again). ``in_extension``: let ``eagle_draft`` run;
    ``whole_layer``: the prefix feed runs the whole drafter layer over every row and keeps
    each sequence's last (as before catch-up rows only wrote their K/V). Returns the trees,
    the drafter KV and, per round, whether the extension loop ran."""
    vmap = torch.randperm(512, generator=torch.Generator().manual_seed(1))[:300]
    em = EagleModel(EagleConfig.for_target(target, 300), target.model, dtype,
                    vmap).random_init(5)
    if whole_layer:
        forward = em.forward

        def whole(ids, feats, pos, kv, meta, backend, out_rows=None):
            f = forward(ids, feats, pos, kv, meta, backend)
            return f if out_rows is None else f[out_rows]

        em.forward = whole
    drafter = EagleDrafter(Strategy(4), em, 128, 8)
    grow, ran = drafter._draft_in_extension, []

    def spy(*args):
        cands = grow(*args) if in_extension else None
        ran.append(cands is not None)
        return cands

    drafter._draft_in_extension = spy
    g = torch.Generator().manual_seed(2)
    seqs, trees = [], []
    for i, t in enumerate([0.0, 1.0, 0.7, 1.0, 0.0]):
        tokens = torch.randint(0, 512, (9 + 4 * i,), generator=g).tolist()
        seq = Sequence("r", i, tokens[:5], SamplingParams(temperature=t, seed=i),
                       SampleNoise(i, 0))
        seq.token_ids = tokens
        drafter.observe(seq, 0, torch.randn(len(tokens), 64, generator=g).to(dtype))
        seqs.append(seq)
    for strategy in [Strategy(4), Strategy(4, 3, 12), Strategy(5, 2, 10)]:
        trees += drafter.propose(seqs, strategy)
        for seq in seqs:  # two tokens committed: the next prefix feed has 3 rows
            seq.token_ids += torch.randint(0, 512, (2,), generator=g).tolist()
            drafter.observe(seq, len(seq.token_ids) - 2,
                            torch.randn(2, 64, generator=g).to(dtype))
    return [(t.tokens, t.parents, t.draft_logprobs) for t in trees], drafter.kv.clone(), ran


@pytest.mark.skipif(ext() is None or not hasattr(ext(), "eagle_draft"),
                    reason="needs the C++ extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["native", "avx512", "avx2"])
def test_draft_loop_in_extension_equals_the_python_loop(target_dir, dtype, isa):
    """``eagle_draft`` (a step's drafting in one extension call: the prefix feed and the loop
    over depths) gives the trees and drafter KV the Python loop gives, bit for bit
    (``_propose_rounds``), under the CPU's own kernels and the AVX-512 and AVX2 caps (the
    generic cap packs nothing, so the Python loop runs there)."""
    prev = kernels.ISAS[ext().isa_cap()]
    if isa != "native" and kernels.set_isa(isa) != isa:
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    try:
        target = load_model(target_dir, dtype=dtype)
        if kernels.prepack(torch.zeros(64, 64, dtype=dtype)).kind is None:
            pytest.skip("no packed kernel for this dtype here: the extension loop does not apply")
        fast, kv_fast, ran = _propose_rounds(target, dtype, True)
        assert ran == [True] * 3  # every propose took the extension loop
        slow, kv_slow, _ = _propose_rounds(target, dtype, False)
        assert len(fast) == 15 and all(len(t[0]) > 0 for t in fast)
        assert fast == slow
        assert torch.equal(kv_fast, kv_slow)
    finally:
        kernels.set_isa(prev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["native", "generic"])
def test_catch_up_rows_only_write_their_kv(target_dir, dtype, isa):
    """A prefix feed runs attention, ``o_proj`` and the MLP only for each sequence's last row
    (the others are a catch-up: only their K/V is needed); the trees and the drafter KV are
    those of running the whole layer over every row and keeping the last, bit for bit, in the
    Python loop and in the extension's (``_propose_rounds``: prefix feeds of 1 to 29 rows per
    sequence). Under the generic cap (no packed kernels: torch's) the Python loop runs."""
    prev = kernels.ISAS[ext().isa_cap()] if ext() is not None else None
    if isa != "native" and (ext() is None or kernels.set_isa(isa) != isa):
        pytest.skip(f"cannot cap the kernels at {isa} here")
    try:
        target = load_model(target_dir, dtype=dtype)
        want, kv_want, _ = _propose_rounds(target, dtype, False, whole_layer=True)
        assert len(want) == 15 and all(len(t[0]) > 0 for t in want)
        for in_extension in (False, True):
            got, kv_got, _ = _propose_rounds(target, dtype, in_extension)
            assert got == want
            assert torch.equal(kv_got, kv_want)
    finally:
        if prev is not None:
            kernels.set_isa(prev)


def test_checkpoint_round_trip(target, tmp_path):
    em = EagleModel(EagleConfig.for_target(target, 100), target.model, torch.float32,
                    torch.arange(100)).random_init(5)
    save_drafter(em, tmp_path / "ck")
    back = load_drafter(tmp_path / "ck", target, torch.float32)
    for (a, p), (b, q) in zip(em.named_parameters(), back.named_parameters()):
        assert a == b and torch.equal(p, q)
    assert torch.equal(back.vocab_map, em.vocab_map)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["target"]["hidden_size"] == 64 and cfg["draft_vocab_size"] == 100


def test_checkpoint_in_the_engine(target_dir, target, plain, tmp_path):
    em = EagleModel(EagleConfig.for_target(target, 256), target.model, torch.float32,
                    torch.arange(256)).random_init(6)
    save_drafter(em, tmp_path / "ck")
    llm = make(target_dir, {"method": "eagle", "model": str(tmp_path / "ck"),
                            "num_speculative_tokens": 3, "topk": 2})
    prompts = rand_prompts(3, seed=11)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert got == [o.outputs[0].token_ids
                   for o in plain.generate(prompts, greedy(), use_tqdm=False)]


def test_wrong_target_and_corrupt_checkpoints(target_dir, target, tmp_path):
    other = load_model(save_random_model(tmp_path / "o", {"hidden_size": 32, "head_dim": 8}),
                       dtype=torch.float32)
    em = EagleModel(EagleConfig.for_target(other), other.model, torch.float32).random_init()
    save_drafter(em, tmp_path / "h")
    with pytest.raises(ValueError, match="hidden_size=32"):
        load_drafter(tmp_path / "h", target)
    with pytest.raises(ValueError, match="hidden_size"):  # through the LLM too
        make(target_dir, {"method": "eagle", "model": str(tmp_path / "h")})
    other = load_model(save_random_model(tmp_path / "v", {"vocab_size": 256}), torch.float32)
    save_drafter(EagleModel(EagleConfig.for_target(other), other.model).random_init(),
                 tmp_path / "v_ck")
    with pytest.raises(ValueError, match="vocab_size=256"):
        load_drafter(tmp_path / "v_ck", target)
    # tokenizer: same sizes, another vocabulary hash
    good = EagleModel(EagleConfig.for_target(target), target.model).random_init()
    save_drafter(good, tmp_path / "tok")
    cfg = json.loads((tmp_path / "tok" / "config.json").read_text())
    cfg["target"]["tokenizer_sha256"] = "ab" * 32

    class Tok:
        def get_vocab(self):
            return {f"t{i}": i for i in range(512)}

    (tmp_path / "tok" / "config.json").write_text(json.dumps(cfg))
    target_with_tok = type(target)(target.model, target.config, Tok(), target.model_dir)
    with pytest.raises(ValueError, match="different tokenizer"):
        load_drafter(tmp_path / "tok", target_with_tok)
    # corrupt weights, corrupt config, missing files, missing tensor
    save_drafter(good, tmp_path / "c")
    w = tmp_path / "c" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt"):
        load_drafter(tmp_path / "c", target)
    (tmp_path / "c" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt config.json"):
        load_drafter(tmp_path / "c", target)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path / "nothing", target)
    from safetensors.torch import save_file
    save_drafter(good, tmp_path / "m")
    save_file({"fc": good.fc.detach()}, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights"):
        load_drafter(tmp_path / "m", target)


def test_no_shipped_drafter_is_a_clear_error(target_dir):
    with pytest.raises(ValueError, match="no drafter is shipped.*smollm2-135m-instruct"):
        make(target_dir, {"method": "eagle"})


def test_hot_swap_between_steps_keeps_output(target_dir, target, plain):
    llm = make(target_dir, eagle(3, 2, 6))
    drafter = llm.engine.drafter
    prompts = rand_prompts(3, seed=12)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(30), use_tqdm=False)]
    ids = [llm.engine.add_request(p, greedy(30)) for p in prompts]
    done, step = {}, 0
    while llm.engine.has_unfinished():
        if step % 3 == 1:  # new weights every few steps
            fresh = EagleModel(drafter.model.config, target.model).random_init(step)
            drafter.publish(fresh.state_dict(), drafter.version + 1)
        for out in llm.engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [done[i] for i in ids] == want
    assert drafter.version >= 3
    assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


def test_common_prefix_equals_the_token_by_token_scan():
    """``common_prefix`` (slice comparisons, binary search on a mismatch) gives what a scan
    token by token gives: for every mismatch position, no mismatch, and limits under both
    lengths."""
    from specengine.speculative.drafters.shadow import common_prefix

    def scan(a, b, n):
        c = 0
        while c < n and a[c] == b[c]:
            c += 1
        return c

    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 50, (300,), generator=g).tolist()
    for n in (0, 1, 2, 7, 64, 299, 300):
        assert common_prefix(base, list(base), n) == n
        for at in range(n):
            b = list(base)
            b[at] += 1  # first mismatch at ``at``
            if at + 3 < n:
                b[at + 3] += 1  # later mismatches do not matter
            assert common_prefix(base, b, n) == scan(base, b, n) == at
    assert common_prefix([], [1], 0) == 0 and common_prefix([1], [2], -1) == 0
