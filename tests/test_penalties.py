"""Repetition / presence / frequency penalties (``specengine.sampling.penalties``): the vectorised
implementation against a per-token reference, greedy decoding against transformers with the
same penalties, and token-identical outputs with and without speculation (each tree node
penalised by its own path)."""

import dataclasses
from collections import Counter

import pytest
import torch
from helpers import rand_prompts
from trees import from_paths

from specengine import LLM, SamplingParams
from specengine.engine.sequence import Sequence
from specengine.sampling.params import SampleNoise
from specengine.sampling.penalties import PenaltyCounts, committed_counts, penalize, tree_paths
from specengine.speculative.drafters.coupling import coupled_logprobs

V = 512  # the tiny models' vocabulary


def ref_penalize(row: torch.Tensor, prompt: list[int], output: list[int],
                 p: SamplingParams) -> torch.Tensor:
    """The reference: one token of the context at a time, in Python floats (vLLM's order:
    repetition on prompt + output, then frequency and presence on the output)."""
    out = row.clone()
    count = Counter(output)
    for t in set(prompt) | set(output):
        x = float(row[t])
        x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * count[t]
        x -= p.presence_penalty * (count[t] > 0)
        out[t] = x
    return out


def make_seq(prompt, output, params, index=0):
    s = Sequence("r", index, list(prompt), params, SampleNoise(0, index))
    s.token_ids += list(output)
    return s


# ---- parameters ------------------------------------------------------------------------------
def test_params_defaults_and_errors():
    p = SamplingParams()
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not p.has_penalties
    assert SamplingParams(repetition_penalty=0.9).has_penalties
    assert SamplingParams(presence_penalty=-2).has_penalties
    assert SamplingParams(frequency_penalty=2).has_penalties
    assert SamplingParams.from_dict({"repetition_penalty": 1.3}).repetition_penalty == 1.3
    for kw, msg in [({"repetition_penalty": 0},
                     "SamplingParams.repetition_penalty=0: must be > 0 (1 disables it)"),
                    ({"presence_penalty": 2.5},
                     "SamplingParams.presence_penalty=2.5: must be in [-2, 2] (0 disables it)"),
                    ({"frequency_penalty": -3},
                     "SamplingParams.frequency_penalty=-3: must be in [-2, 2] (0 disables it)"),
                    ({"repetition_penalty": "1.3"},
                     "SamplingParams.repetition_penalty='1.3': must be a finite number")]:
        with pytest.raises(ValueError) as e:
            SamplingParams(**kw)
        assert str(e.value) == msg


# ---- the vectorised function -----------------------------------------------------------------
PARAMS = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7),
          SamplingParams(presence_penalty=1.5), SamplingParams(frequency_penalty=-0.8),
          SamplingParams(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.7),
          SamplingParams()]


def test_plain_rows_equal_the_reference():
    g = torch.Generator().manual_seed(0)
    seqs, want = [], []
    logits = torch.randn(12, V, generator=g) * 4
    for r in range(12):
        prompt = torch.randint(0, 40, (int(torch.randint(1, 30, (1,), generator=g)),),
                               generator=g).tolist()
        output = torch.randint(20, 60, (r * 3,), generator=g).tolist()  # overlaps the prompt
        seqs.append(make_seq(prompt, output, PARAMS[r % len(PARAMS)], r))
        want.append(ref_penalize(logits[r], prompt, output, seqs[-1].params))
    before = logits.clone()
    got = penalize(logits, seqs)
    assert torch.equal(logits, before)  # not modified
    assert torch.allclose(got, torch.stack(want), atol=1e-5, rtol=0)
    assert not torch.allclose(got, logits)
    assert torch.equal(got[5], logits[5]) and torch.equal(got[11], logits[11])  # no penalty
    # a batch without penalties is returned as is
    two = logits[:2]
    assert penalize(two, [make_seq([1, 2], [3], SamplingParams())] * 2) is two


def test_tree_rows_use_their_own_path():
    """Row 0 follows the root (committed context only); row 1 + i follows node i, whose context
    adds the tokens on the path to node i (repeats of committed tokens and of each other), not
    its siblings'."""
    g = torch.Generator().manual_seed(1)
    prompt, output = [5, 6, 7, 8, 5], [9, 6, 9, 10]
    # paths reuse committed tokens (6, 9), repeat along a path (11 twice), and siblings differ
    tree = from_paths([[9, 11, 11, 6], [9, 12, 5], [6, 9, 13], [11, 11]])
    paths = tree_paths(tree)
    assert paths[0] == [] and paths[1:] == [[tree.tokens[j] for j in tree.path_to(i)]
                                            for i in range(tree.num_nodes)]
    for p in PARAMS[:5]:
        seq = make_seq(prompt, output, p)
        logits = torch.randn(1 + tree.num_nodes, V, generator=g) * 3
        got = penalize(logits, [seq] * len(paths), paths=paths)
        want = torch.stack([ref_penalize(logits[r], prompt, output + paths[r], p)
                            for r in range(len(paths))])
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
    # the sequence itself is untouched: its committed counts know nothing of the drafts
    pc = seq.penalty_counts
    assert pc.counts[11] == 0 and pc.counts[9] == 2 and not pc.seen[13] and pc.seen[5]


def test_counts_follow_appended_tokens_incrementally():
    p = SamplingParams(frequency_penalty=1.0)
    seq = make_seq([3, 4, 3], [], p)
    pc = committed_counts(seq, V)
    assert pc.counts.sum() == 0 and pc.ids.tolist() == [3, 4]
    for t in [4, 8, 8, 3]:
        seq.token_ids.append(t)
        assert committed_counts(seq, V) is pc
    fresh = PenaltyCounts(V).update(seq)
    assert torch.equal(pc.counts, fresh.counts) and torch.equal(pc.seen, fresh.seen)
    assert pc.counts[8] == 2 and pc.counts[4] == 1 and pc.counts[3] == 1
    assert pc.ids.tolist() == [3, 4, 8]
    bad = make_seq([3, V], [], p)
    with pytest.raises(ValueError, match=f"token id {V} is outside the vocabulary"):
        committed_counts(bad, V)
    with pytest.raises(ValueError, match="2 rows but 1 sequences"):
        penalize(torch.zeros(2, V), [seq])
    with pytest.raises(ValueError, match=f"a draft token {V + 1} is outside the vocabulary"):
        penalize(torch.zeros(1, V), [seq], paths=[[3, V + 1]])


def test_mixed_rows_and_reduced_draft_vocabulary_and_coupled_drafting():
    """Rows of several sequences, some with several rows (a drafter's frontier), one without
    penalties, with draft paths, equal the reference; through a drafter's ``vocab_map`` the
    penalties land on the mapped columns (tokens without a column are skipped);
    ``coupled_logprobs`` ranks the penalised scores, so with the draft equal to the target its
    best child is the penalised target's argmax."""
    g = torch.Generator().manual_seed(2)
    a = make_seq([1, 2, 3], [7, 7, 40], PARAMS[0], 0)
    b = make_seq([9, 9, 4], [40, 5], PARAMS[4], 1)
    c = make_seq([1], [2, 2, 2], PARAMS[2], 2)
    d = make_seq([1, 2], [3], PARAMS[5], 3)  # no penalty
    seqs = [a, b, a, c, b, b, d, a]
    paths = [[], [40], [7], [41, 41], [40, 5, 6], [], [1], [2, 2]]
    full = torch.randn(len(seqs), V, generator=g) * 3
    want = penalize(full, seqs, paths=paths)
    ref = torch.stack([ref_penalize(full[r], s.prompt_token_ids, s.output_token_ids + paths[r],
                                    s.params) for r, s in enumerate(seqs)])
    assert torch.allclose(want, ref, atol=1e-5, rtol=0)
    assert torch.equal(want[6], full[6])
    vmap = torch.randperm(V, generator=g)[:300]
    got = penalize(full[:, vmap], seqs, V, paths, vmap)
    assert torch.equal(got, want[:, vmap])
    greedy = [make_seq([1, 2, 3], [7, 7, 40], SamplingParams(temperature=0, **kw), i)
              for i, kw in enumerate([{"repetition_penalty": 3.0}, {"presence_penalty": 2.0},
                                      {"frequency_penalty": 2.0}])]
    logits = torch.randn(3, V, generator=g)
    logits[:, 7] = logits.max() + 0.5  # token 7 leads, unpenalised
    lp = coupled_logprobs(logits, greedy, [3, 3, 3], V)
    assert torch.equal(lp.argmax(-1), penalize(logits, greedy).argmax(-1))
    assert (lp.argmax(-1) != 7).all()


# ---- the engine --------------------------------------------------------------------------------
def make(target_dir, spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    if spec is not None:  # the configured tree every step
        spec = {"policy": "static", **spec}
    return LLM(str(target_dir), dtype="float32", block_size=8, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(target_dir):
    return make(target_dir)


@pytest.fixture(scope="module")
def hf(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def hf_greedy(hf, prompt, p, max_tokens, **kw):
    """transformers' greedy ``generate`` with the reference penalties as a logits processor."""
    n = len(prompt)

    def processor(input_ids, scores):
        ids = input_ids[0].tolist()
        return ref_penalize(scores[0], ids[:n], ids[n:], p)[None]

    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                      min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0,
                      logits_processor=[processor], **kw)
    return out[0, n:].tolist()


LOOP_PROMPT = rand_prompts(8, seed=5)[2]  # greedy falls into a loop on one token


@pytest.mark.parametrize("kw", [{"repetition_penalty": 1.5}, {"presence_penalty": 1.0},
                                {"frequency_penalty": 0.5},
                                {"repetition_penalty": 1.1, "presence_penalty": 0.3,
                                 "frequency_penalty": 0.3}])
def test_penalties_break_a_greedy_loop_as_transformers_does(plain, hf, kw):
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = plain.generate([LOOP_PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
    tok, reps = Counter(base).most_common(1)[0]
    assert reps >= 10  # the repeated token dominates without penalties
    p = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, **kw)
    got = plain.generate([LOOP_PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    assert got != base and Counter(got)[tok] < reps
    assert got == hf_greedy(hf, LOOP_PROMPT, p, 48)
    if set(kw) == {"repetition_penalty"}:  # transformers' own repetition penalty agrees
        assert got == hf.generate(torch.tensor([LOOP_PROMPT]), max_new_tokens=48,
                                  do_sample=False, min_new_tokens=48, eos_token_id=None,
                                  pad_token_id=0, repetition_penalty=kw["repetition_penalty"]
                                  )[0, len(LOOP_PROMPT):].tolist()


def mixed_params(logprobs=None):
    """Greedy and seeded sampled requests (n = 2) with every penalty, and one without."""
    kws = [dict(temperature=0, repetition_penalty=1.3),
           dict(temperature=0, presence_penalty=1.0, frequency_penalty=0.5, n=2),
           dict(temperature=1.0, repetition_penalty=1.2, seed=1, n=2),
           dict(temperature=0.8, top_p=0.9, presence_penalty=-0.5, frequency_penalty=1.0,
                seed=2, n=2),
           dict(temperature=1.0, top_k=20, repetition_penalty=0.8, presence_penalty=2.0,
                seed=3),
           # favouring repeats makes loops the n-gram drafts follow; every path token counts
           dict(temperature=0, frequency_penalty=-0.5),
           dict(temperature=0, presence_penalty=-1.0, frequency_penalty=0.4, n=2),
           dict(temperature=1.0, seed=4, n=2)]
    return [SamplingParams(max_tokens=32, ignore_eos=True, logprobs=logprobs, **kw)
            for kw in kws]


def run(llm, prompts, params):
    return [[o.token_ids for o in out.outputs]
            for out in llm.generate(prompts, params, use_tqdm=False)]


SPECS = {
    "ngram-chain": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram-tree": {"method": "ngram", "num_speculative_tokens": 3, "topk": 3},
    "self-draft-tree": {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 3,
                        "topk": 2, "num_verify_tokens": 6},
    "draft-tree": {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3,
                   "topk": 2},
    "eagle-tree": {"method": "eagle", "model": "random", "num_speculative_tokens": 3,
                   "topk": 2, "num_verify_tokens": 5},
}


def spec_of(name, target_dir, draft_dir):
    spec = dict(SPECS[name])
    if spec.get("model") in ("SELF", "DRAFT"):
        spec["model"] = str(target_dir if spec["model"] == "SELF" else draft_dir)
    return spec


@pytest.mark.parametrize("name", list(SPECS))
def test_speculation_is_token_identical_with_penalties(target_dir, draft_dir, plain, name):
    prompts = rand_prompts(8, seed=21)
    params = mixed_params()
    want = run(plain, prompts, params)
    llm = make(target_dir, spec_of(name, target_dir, draft_dir))
    assert run(llm, prompts, params) == want
    m = llm.get_metrics()
    assert m["spec_steps"] > 0 and m["drafted_tokens"] > 0
    assert m["kv_blocks_free"] == m["kv_blocks_total"]
    off = [dataclasses.replace(p, repetition_penalty=1.0, presence_penalty=0.0,
                               frequency_penalty=0.0) for p in params]
    assert want != run(plain, prompts, off)  # the penalties matter here


def test_verification_without_the_path_context_is_not_exact(target_dir, plain, monkeypatch):
    """The equality above depends on each node's own path: penalising every tree row with the
    committed context only (the bug this guards against) changes the output."""
    prompts = rand_prompts(8, seed=21)
    params = mixed_params()
    want = run(plain, prompts, params)
    import specengine.sampling.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "tree_paths", lambda tree: [[]] * (tree.num_nodes + 1))
    llm = make(target_dir, SPECS["ngram-tree"])
    assert run(llm, prompts, params) != want


def test_self_draft_penalised_by_its_path_accepts_everything(target_dir, monkeypatch):
    """A draft equal to the target, penalised with each node's path (``coupled_logprobs``),
    proposes exactly the target's penalised greedy tokens: every draft is accepted. Drafting
    without the penalties proposes the unpenalised argmax and loses acceptance (same output)."""
    d = 4
    prompts = [LOOP_PROMPT] + rand_prompts(3, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=1 + (d + 1) * 8, ignore_eos=True,
                        repetition_penalty=1.5, frequency_penalty=0.5)
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": d}

    def go():
        llm = make(target_dir, spec)
        return run(llm, prompts, sp), llm.get_metrics()["acceptance_length"]

    want, tau = go()
    assert tau == d + 1
    from specengine.speculative.drafters import coupling

    monkeypatch.setattr(coupling, "penalize", lambda logits, *a, **k: logits)
    got, tau_unpenalised = go()
    assert got == want
    assert tau_unpenalised < d


def test_eagle_drafts_each_node_with_its_path(target_dir, monkeypatch):
    """EAGLE's drafting rows are penalised with the path of the node they expand: every tree
    node that has children was drafted from exactly its root-to-node token path."""
    from specengine.speculative.drafters.eagle import drafter as eagle_mod

    seen: dict[int, list[list[int]]] = {}
    real = eagle_mod.coupled_topk

    def spy(logits, k, seqs, positions, vocab, vocab_map=None, paths=None):
        for r, s in enumerate(seqs):
            seen.setdefault(s.seq_id, []).append([] if paths is None else paths[r])
        return real(logits, k, seqs, positions, vocab, vocab_map, paths)

    monkeypatch.setattr(eagle_mod, "coupled_topk", spy)
    llm = make(target_dir, SPECS["eagle-tree"] | {"num_speculative_tokens": 4, "topk": 3,
                                                  "num_verify_tokens": 12})
    trees = []
    propose = llm.engine.drafter.propose

    def record(seqs, strategy):
        seen.clear()
        out = propose(seqs, strategy)
        for s, t in zip(seqs, out):
            if t is not None:
                trees.append((t, [list(p) for p in seen.get(s.seq_id, [])]))
        return out

    monkeypatch.setattr(llm.engine.drafter, "propose", record)
    llm.generate(rand_prompts(2, seed=3), SamplingParams(temperature=0, max_tokens=12,
                                                         ignore_eos=True,
                                                         repetition_penalty=1.3),
                 use_tqdm=False)
    checked = 0
    for tree, drafted in trees:
        paths = tree_paths(tree)
        for i in range(tree.num_nodes):
            if tree.children(i):
                assert paths[1 + i] in drafted
                checked += 1
    assert checked >= 5


@pytest.mark.parametrize("name", ["ngram-tree", "self-draft-tree"])
def test_processed_logprobs_with_penalties_equal_plain(target_dir, draft_dir, name):
    prompts = rand_prompts(8, seed=31)
    params = mixed_params(logprobs=3)
    kw = dict(logprobs_mode="processed_logprobs")
    a = make(target_dir, **kw).generate(prompts, params, use_tqdm=False)
    b = make(target_dir, spec_of(name, target_dir, draft_dir), **kw).generate(
        prompts, params, use_tqdm=False)
    n = 0
    for x, y in zip(a, b):
        for ox, oy in zip(x.outputs, y.outputs):
            assert ox.token_ids == oy.token_ids
            for ex, ey in zip(ox.logprobs, oy.logprobs):
                assert set(ex) == set(ey)
                for k in ex:
                    assert abs(ex[k].logprob - ey[k].logprob) < 1e-5
                    n += 1
            assert abs(ox.cumulative_logprob - oy.cumulative_logprob) < 1e-4
    assert n > 500


def test_processed_logprobs_include_the_penalties(target_dir, hf):
    """``processed_logprobs`` are the log-softmax of the penalised logits (vLLM's); raw ones of
    the model's."""
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0,
                       repetition_penalty=1.5, presence_penalty=0.5)
    out = {m: make(target_dir, logprobs_mode=m).generate([LOOP_PROMPT], p, use_tqdm=False)[0]
           .outputs[0] for m in ("processed_logprobs", "raw_logprobs")}
    toks = out["raw_logprobs"].token_ids
    n = len(LOOP_PROMPT)
    with torch.no_grad():
        logits = hf(torch.tensor([LOOP_PROMPT + toks])).logits[0, n - 1:-1].float()
    for j, t in enumerate(toks):
        ctx = LOOP_PROMPT + toks[:j]
        processed = torch.log_softmax(ref_penalize(logits[j], ctx[:n], ctx[n:], p), -1)[t]
        raw = torch.log_softmax(logits[j], -1)[t]
        assert abs(out["processed_logprobs"].logprobs[j][t].logprob - processed) < 1e-4
        assert abs(out["raw_logprobs"].logprobs[j][t].logprob - raw) < 1e-4
        assert abs(processed - raw) > 1e-3
