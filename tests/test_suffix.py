"""Suffix drafter over the rollout memory: the index and its sources, weight-version aging, the
byte cap, tree building, and exactness / KV accounting in the engine on a tiny random model."""

import math
import sys

import pytest
from helpers import rand_prompts

from specengine import LLM, SamplingParams
from specengine.ops.extension import ext
from specengine.sampling.params import noise_rows
from specengine.speculative.config import METHODS, SpeculativeConfig
from specengine.speculative.drafters import make_drafter
from specengine.speculative.drafters.rollout_memory import (
    DOC_BYTES,
    GROUP_BYTES,
    KEY_BYTES,
    RolloutMemory,
)
from specengine.speculative.drafters.suffix import SuffixDrafter, build_tree, noise_fn
from specengine.speculative.strategy import Strategy

PROMPT = [11, 12, 13, 14, 15]


# ---- tree building ------------------------------------------------------------------------------
def test_tree_counts_become_conditional_logprobs_best_first():
    conts = [(1.0, [1, 2, 3]), (1.0, [1, 2, 4]), (1.0, [1, 5]), (1.0, [6])]
    tree = build_tree(conts, depth=3, topk=2, budget=10, min_prob=0.0)
    # best-first by path probability: 1 (3/4), 2 (2/4), then the 1/4 nodes in the order they
    # became candidates
    assert tree.tokens == [1, 2, 6, 5, 3, 4]
    assert tree.parents == [-1, 0, -1, 0, 1, 1]
    want = [3 / 4, 2 / 3, 1 / 4, 1 / 3, 1 / 2, 1 / 2]
    assert tree.draft_logprobs == pytest.approx([math.log(p) for p in want])
    assert tree.sources == ["suffix"] * 6
    # the path probability is the product of the conditionals: count(node) / total
    assert math.exp(sum(tree.draft_logprobs[i] for i in tree.path_to(4))) == pytest.approx(1 / 4)


def test_tree_respects_topk_budget_depth_and_min_prob():
    conts = [(1.0, [1, 2, 3]), (1.0, [1, 2, 4]), (1.0, [1, 5]), (1.0, [6])]
    chain = build_tree(conts, depth=3, topk=1, budget=10)
    assert chain.tokens == [1, 2, 3] and chain.parents == [-1, 0, 1]
    assert build_tree(conts, depth=3, topk=2, budget=2).tokens == [1, 2]
    assert build_tree(conts, depth=1, topk=4, budget=10).tokens == [1, 6]
    # min_prob cuts every node whose path probability is below it
    assert build_tree(conts, depth=3, topk=2, budget=10, min_prob=0.3).tokens == [1, 2]
    assert build_tree(conts, depth=3, topk=2, budget=10, min_prob=0.9) is None
    # weights count like repeated continuations: the weighted one wins the chain
    tree = build_tree([(1.0, [7, 8]), (3.0, [7, 9])], depth=2, topk=1, budget=4)
    assert tree.tokens == [7, 9]
    assert tree.draft_logprobs == pytest.approx([0.0, math.log(3 / 4)])
    assert build_tree([], 3, 2, 4) is None


def test_noise_ranks_children_by_perturbed_counts():
    conts = [(1.0, [1, 3]), (1.0, [1, 3]), (1.0, [2]), (1.0, [1, 4])]  # 1: 3/4, 2: 1/4

    def noise(depth, token):  # 2 drew a small E at depth 1: it wins the race
        return {(1, 1): 1.0, (1, 2): 0.05}.get((depth, token), 1.0)

    plain = build_tree(conts, depth=2, topk=1, budget=4)
    coupled = build_tree(conts, depth=2, topk=1, budget=4, noise=noise)
    assert plain.tokens == [1, 3] and coupled.tokens == [2]
    # softmax of log count - log E: 1 -> 3 * 1, 2 -> 1 * 20
    tree = build_tree(conts, depth=2, topk=2, budget=4, noise=noise)
    assert tree.tokens == [2, 1, 3, 4]
    assert tree.draft_logprobs[:2] == pytest.approx([math.log(20 / 23), math.log(3 / 23)])
    # a single child keeps its share (count over its parent's), whatever the noise
    assert tree.draft_logprobs[2:] == pytest.approx([math.log(2 / 3), math.log(1 / 3)])


@pytest.mark.skipif(ext() is None, reason="specengine._C is not built")
def test_token_noise_equals_the_samplers_rows():
    key, first, vocab = 987654321, 17, 49152
    f = noise_fn(key, first)
    for depth in (1, 3):
        row = noise_rows(key, [first + depth - 1], vocab)[0]
        for tok in (0, 5, 4000, vocab - 1):
            assert f(depth, tok) == pytest.approx(float(row[tok]), rel=3e-7)


# ---- the index ----------------------------------------------------------------------------------
def test_siblings_are_visible_mid_rollout():
    mem = RolloutMemory()
    a, b = PROMPT + [1, 2, 3], PROMPT + [1]
    mem.start("a", a, len(PROMPT))
    mem.start("b", b, len(PROMPT))
    # [13, 14, 15, 1] spans a's prompt context and output
    assert mem.lookup("b", b[-8:], 4) == (4, [(1.0, [2, 3])])
    a += [4, 5, 6]
    mem.sync("a", a)  # a's new tokens, incrementally
    assert mem.lookup("b", b[-8:], 4) == (4, [(1.0, [2, 3, 4, 5])])
    b += [2, 3, 4]
    mem.sync("b", b)  # b's own continuation has none yet; a's has
    assert mem.lookup("b", b[-8:], 2) == (4, [(1.0, [5, 6])])
    # a separate request with the same prompt is in the same group
    mem.start("c", PROMPT + [9], len(PROMPT))
    assert mem.stats()["rollout_memory_groups"] == 1
    mem.sync("c", PROMPT + [9, 1, 2])
    n, conts = mem.lookup("c", (PROMPT + [9, 1, 2])[-8:], 2)
    assert n == 2 and conts == [(1.0, [3, 4]), (1.0, [3, 4])]  # b's, then a's (recent first)
    # another prompt is another group: nothing of a's is visible there
    mem.start("d", [99, 98, 1, 2], 2)
    assert mem.lookup("d", [99, 98, 1, 2], 2) == (0, [])
    assert mem.stats()["rollout_memory_groups"] == 2


def test_longest_indexed_match_wins_and_own_text_counts():
    mem = RolloutMemory(backoff=0.0)
    toks = PROMPT + [1, 2, 3, 4, 20, 9, 3, 4, 21, 8, 1, 2, 3, 4]
    mem.start("s", toks, len(PROMPT))
    # the 4-gram [1, 2, 3, 4] occurred once before (-> 20, 9); the 2-gram [3, 4] also -> 21
    assert mem.lookup("s", toks[-8:], 2) == (4, [(1.0, [20, 9])])
    # backing off: the shorter match's other occurrence follows, weighted per level
    mem.backoff = 0.5
    assert mem.lookup("s", toks[-8:], 2) == (4, [(1.0, [20, 9]), (0.5, [21, 8])])
    assert mem.lookup("s", [9], 2) == (1, [(1.0, [3, 4])])
    # the prompt is a document too (prompt lookup)
    assert mem.lookup("s", [12, 13], 3) == (2, [(1.0, [14, 15])])


def test_history_is_tagged_and_aged_by_weight_version():
    mem = RolloutMemory(decay=0.5, max_age=2)
    mem.start("old", PROMPT + [1, 2, 3], len(PROMPT))
    mem.finish("old", keep=True)  # weight version 0
    mem.set_version(1)
    mem.start("new", PROMPT + [1, 2, 4], len(PROMPT))
    mem.finish("new", keep=True)  # weight version 1
    mem.start("x", PROMPT + [1], len(PROMPT))
    assert mem.lookup("x", [15, 1], 2)[1] == [(1.0, [2, 4]), (0.5, [2, 3])]
    tree = build_tree(mem.lookup("x", [15, 1], 2)[1], depth=2, topk=2, budget=4)
    assert tree.tokens == [2, 4, 3]  # the current version's continuation first
    mem.finish("x", keep=False)  # aborted: not history
    assert mem.stats()["rollout_memory_history"] == 2
    mem.set_version(3)  # old: age 3 > 2, gone; new: age 2, weight 1/4
    assert mem.stats()["rollout_memory_history"] == 1
    mem.start("y", PROMPT + [1], len(PROMPT))
    assert mem.lookup("y", [15, 1], 2)[1] == [(0.25, [2, 4])]
    mem.finish("y", keep=False)
    tokens = mem.stats()["rollout_memory_tokens"]
    mem.set_version(4)  # everything aged out: the group goes with it
    s = mem.stats()
    assert s["rollout_memory_history"] == 0 and s["rollout_memory_groups"] == 0
    assert s["rollout_memory_bytes"] == 0 and tokens > 0


def test_aborted_documents_are_skipped_and_compacted():
    mem = RolloutMemory()
    mem.start("keep", PROMPT + [1, 2, 3], len(PROMPT))
    mem.finish("keep", keep=True)
    before = mem.bytes
    mem.start("gone", PROMPT + [1, 7, 7, 7, 7, 7, 7], len(PROMPT))
    mem.finish("gone", keep=False)  # dead: skipped by lookups, held until compacted
    assert len(mem.group_of(PROMPT).docs) == 3 and mem.bytes > before
    mem.start("q", PROMPT + [1], len(PROMPT))
    assert mem.lookup("q", [15, 1], 2)[1] == [(1.0, [2, 3])]
    mem.finish("q", keep=False)  # now over half of the group's tokens are dead: compacted
    assert len(mem.group_of(PROMPT).docs) == 2 and mem.bytes == before == recount(mem)
    assert mem.stats()["rollout_memory_history"] == 1


def recount(mem):
    """Bytes of ``mem`` recomputed from scratch, as the module docstring defines them."""
    total = 0
    for g in mem.groups.values():
        total += GROUP_BYTES + sum(sys.getsizeof(h) + KEY_BYTES * len(h) for h in g.heads)
        total += sum(d.tokens.nbytes + d.prev.nbytes + DOC_BYTES for d in g.docs)
    return total


def test_memory_cap_under_a_flood_of_distinct_prompts_evicts_lru():
    cap = 200_000
    mem = RolloutMemory(cap_bytes=cap)
    prompts = rand_prompts(400, lo=8, hi=30, vocab=5000, seed=3)
    outs = rand_prompts(400, lo=20, hi=120, vocab=5000, seed=4)
    hot = prompts[0]
    for i, (p, o) in enumerate(zip(prompts, outs)):
        mem.start(i, p + o[:5], len(p))
        mem.sync(i, p + o)
        assert mem.bytes <= cap and mem.bytes == recount(mem)
        mem.finish(i, keep=True)
        assert mem.bytes <= cap
        mem.start(("hot", i), hot + [1], len(hot))  # touching the hot group keeps it
        mem.finish(("hot", i), keep=False)
        assert mem.bytes <= cap
    s = mem.stats()
    assert s["rollout_memory_evictions"] > 100 and 1 < s["rollout_memory_groups"] < 100
    assert mem.group_of(hot) is not None  # recently used: never evicted
    assert mem.group_of(prompts[1]) is None  # least recently used: evicted first
    assert mem.group_of(prompts[-1]) is not None
    # survivors are the most recently used prompts, in order
    held = [i for i, p in enumerate(prompts[1:], 1) if mem.group_of(p) is not None]
    assert held == list(range(held[0], len(prompts)))


def test_an_evicted_live_sample_is_detached():
    mem = RolloutMemory(cap_bytes=30_000)
    mem.start("live", PROMPT + [1, 2], len(PROMPT))
    for i in range(20):
        mem.start(i, [100 + i, 1, 2, 3] + list(range(200)), 4)
        mem.finish(i, keep=True)
    assert not mem.is_tracked("live") and mem.lookup("live", [1, 2], 2) == (0, [])
    mem.sync("live", PROMPT + [1, 2, 3])  # ignored
    assert mem.start("live", PROMPT + [1, 2, 3], len(PROMPT)) is False
    mem.finish("live", keep=True)
    assert mem.bytes <= 30_000


def test_bad_memory_arguments_are_named():
    for kw, name in [({"cap_bytes": 0}, "cap_bytes"), ({"decay": 0.0}, "decay"),
                     ({"decay": 1.5}, "decay"), ({"max_age": -1}, "max_age"),
                     ({"max_matches": 0}, "max_matches"), ({"backoff": -0.1}, "backoff")]:
        with pytest.raises(ValueError, match=name):
            RolloutMemory(**kw)


# ---- config -------------------------------------------------------------------------------------
def test_config_keys_are_validated_by_name():
    assert "suffix" in METHODS
    cfg = SpeculativeConfig.from_dict({"method": "suffix", "suffix_memory_bytes": 1 << 20,
                                       "suffix_decoding_min_token_prob": 0.2,
                                       "suffix_history_max_age": 0})
    d = make_drafter(cfg, None, 0, 16)
    assert isinstance(d, SuffixDrafter) and d.memory.cap_bytes == 1 << 20
    assert d.min_token_prob == 0.2 and d.memory.max_age == 0
    bad = [("suffix_decoding_max_tree_depth", 0), ("suffix_decoding_max_tree_depth", 2.5),
           ("suffix_decoding_min_token_prob", 1.5), ("suffix_decoding_min_token_prob", "x"),
           ("suffix_memory_bytes", 0), ("suffix_memory_bytes", True),
           ("suffix_history_decay", 0), ("suffix_history_decay", 1.01),
           ("suffix_history_max_age", -1), ("suffix_max_matches", 0),
           ("suffix_backoff", 1.5)]
    for key, value in bad:
        with pytest.raises(ValueError, match=key):
            SpeculativeConfig.from_dict({"method": "suffix", key: value})
    with pytest.raises(ValueError, match="suffix_bogus"):
        SpeculativeConfig.from_dict({"method": "suffix", "suffix_bogus": 1})


def test_drafter_depth_is_capped_and_timers_use_the_clock():
    ticks = iter(range(1000))
    d = SuffixDrafter(Strategy(8), max_tree_depth=2, min_token_prob=0.0,
                      clock=lambda: float(next(ticks)))

    class Seq:
        def __init__(self, sid, toks):
            self.seq_id, self.token_ids, self.num_prompt_tokens = sid, toks, len(PROMPT)
            self.finish_reason, self.params = "stop", SamplingParams(temperature=0)

    a = Seq(1, PROMPT + [1, 2, 3, 4, 5])
    b = Seq(2, PROMPT + [1])
    trees = d.propose([a, b], Strategy(8))
    assert trees[0] is None and trees[1].tokens == [2, 3]  # depth 2, not 8
    s = d.stats()
    assert s["suffix_update_seconds"] == 1.0 and s["suffix_lookup_seconds"] == 1.0
    assert s["suffix_steps"] == 1 and s["suffix_lookups"] == 2
    assert s["suffix_lookup_seconds_per_sequence"] == 0.5
    d.release(a)
    d.release(b)
    assert d.stats()["rollout_memory_history"] == 2 and d.stats()["rollout_memory_live"] == 0


# ---- in the engine ------------------------------------------------------------------------------
def make(target_dir, spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    if spec is not None:
        spec = {"method": "suffix", "policy": "static", **spec}
    return LLM(str(target_dir), dtype="float32", block_size=8, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(target_dir):
    return make(target_dir)


def ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("shape", [{"num_speculative_tokens": 4},
                                   {"num_speculative_tokens": 4, "topk": 2,
                                    "num_verify_tokens": 8}], ids=["chain", "tree"])
def test_greedy_and_seeded_sampling_equal_plain(target_dir, plain, shape):
    prompts = rand_prompts(3, seed=3) * 2  # repeated prompts share groups
    llm = make(target_dir, {**shape, "suffix_decoding_min_token_prob": 0.0})
    for params in [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2),
                   SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, n=3, seed=5),
                   SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, n=3, seed=6)]:
        want = ids(plain.generate(prompts, params, use_tqdm=False))
        for _ in range(2):  # the second call drafts from the first's history
            assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
    m = llm.get_metrics()
    assert m["acceptance_length"] > 1.5  # repeated seeded outputs: history drafts are accepted
    assert m["kv_blocks_free"] == m["kv_blocks_total"]
    assert m["rollout_memory_live"] == 0 and m["rollout_memory_history"] > 0
    assert 0 < m["rollout_memory_bytes"] <= m["rollout_memory_cap_bytes"]
    assert m["suffix_steps"] > 0 and m["suffix_update_seconds"] >= 0.0


def test_a_later_sample_drafts_an_earlier_siblings_tokens(target_dir):
    llm = make(target_dir, {"num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 0.0})
    eng = llm.engine
    seen = []
    propose = eng.drafter.propose

    def spy(seqs, strategy):
        trees = propose(seqs, strategy)
        seen.extend((s.request_id, s.num_output_tokens, t) for s, t in zip(seqs, trees))
        return trees

    eng.drafter.propose = spy
    prompt = rand_prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = eng.add_request(prompt, params)
    for _ in range(4):
        eng.step()
    ahead = list(eng.requests[first].seqs[0].output_token_ids)
    second = eng.add_request(prompt, params)  # same prompt, separate request: same group
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    drafts = [(n, t) for r, n, t in seen if r == second]
    n, tree = drafts[0]  # its first draft continues from the first request's tokens
    assert n == 1 and tree is not None and tree.tokens == ahead[1:4]
    by_id = {o.request_id: o.outputs[0].token_ids for o in outs}
    assert by_id[first] == by_id[second]
    assert eng.requests == {} and eng.blocks.num_free == eng.blocks.num_blocks


def test_abort_adds_no_history_and_weight_updates_age_it(target_dir):
    llm = make(target_dir, {"num_speculative_tokens": 2, "suffix_history_max_age": 1})
    eng = llm.engine
    prompt = rand_prompts(1, seed=11)[0]
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, n=2))
    for _ in range(3):
        eng.step()
    eng.abort_request(rid)
    m = llm.get_metrics()
    assert m["rollout_memory_history"] == 0 and m["rollout_memory_live"] == 0
    assert m["rollout_memory_groups"] == 0 and m["rollout_memory_bytes"] == 0
    assert m["kv_blocks_free"] == m["kv_blocks_total"]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, n=2), use_tqdm=False)
    assert llm.get_metrics()["rollout_memory_history"] == 2
    params = dict(eng.runner.model.hf_parameters())
    llm.update_weights(params)  # weight version 1: the history weighs 1/2
    mem = eng.drafter.memory
    assert mem.version == 1 == llm.weight_version
    weights = [d.weight for d in mem.group_of(prompt).docs if d.version is not None
               and d.version >= 0]
    assert weights == [0.5, 0.5]
    llm.update_weights(params)  # version 2: age 2 > max_age 1, dropped
    assert llm.get_metrics()["rollout_memory_history"] == 0
    assert mem.group_of(prompt) is None


@pytest.mark.integration
def test_repeated_prompts_accept_history_drafts_on_the_default_model():
    llm = LLM(speculative_config={"method": "suffix", "policy": "static",
                                  "num_speculative_tokens": 4, "topk": 2,
                                  "num_verify_tokens": 8})
    prompt = [{"role": "user", "content": "List the first ten prime numbers, one per line."}]
    params = SamplingParams(temperature=1.0, max_tokens=48, n=4)
    llm.chat(prompt, params, use_tqdm=False)
    first = llm.get_metrics()
    llm.chat(prompt, params, use_tqdm=False)  # new seeds: other samples of the same prompt
    second = llm.get_metrics()
    steps = second["spec_steps"] - first["spec_steps"]
    accepted = second["accepted_tokens"] - first["accepted_tokens"]
    assert steps > 0 and (accepted + steps) / steps > 1.0
    assert second["rollout_memory_history"] == 8
