"""One token tree from several drafters: the merge (shared paths, sources kept, budget,
best-first by calibrated probability), exactness in the engine (greedy, seeded T=1, the
statistical test on merged trees), per-source calibration, metrics, KV back to baseline and
the configuration errors."""

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import test_verify as tv
import torch
import trees
from helpers import rand_prompts
from reference_verify import verify_sampling

from specengine import LLM, SamplingParams
from specengine.kv.block_manager import BlockManager
from specengine.speculative.config import SpeculativeConfig
from specengine.speculative.drafters.base import Drafter, prune_tree
from specengine.speculative.drafters.eagle import EagleDrafter
from specengine.speculative.drafters.merged import MergedDrafter, matched_length, merge_trees
from specengine.speculative.policy import AutoPolicy, StepRecord
from specengine.speculative.policy.calibration import SourceCalibrators, bin_of
from specengine.speculative.policy.cutter import TreeCutter
from specengine.speculative.sources import MergedTree, SourceStats, node_votes
from specengine.speculative.strategy import Strategy
from specengine.speculative.training.harvest import Harvester, HiddenBuffer
from specengine.speculative.tree import DraftTree


def labelled(tokens, parents, lps, source):
    return DraftTree(tokens, parents, [math.log(p) for p in lps], [source] * len(tokens))


def paths(tree):
    """Every node's token path from the root."""
    out = []
    for i in range(tree.num_nodes):
        out.append(tuple(tree.tokens[j] for j in tree.path_to(i)))
    return out


# ---- the merge -----------------------------------------------------------------------------
def test_shared_prefixes_become_one_node_and_keep_every_source():
    a = labelled([5, 6, 7], [-1, 0, 0], [0.8, 0.5, 0.25], "eagle")  # 5 -> {6, 7}
    b = labelled([5, 6, 8], [-1, 0, 1], [0.9, 0.9, 0.5], "ngram")  # 5 -> 6 -> 8
    t = merge_trees([a, b], ["eagle", "ngram"], 10, SourceCalibrators())
    assert isinstance(t, MergedTree) and t.num_nodes == 4
    assert sorted(paths(t)) == [(5,), (5, 6), (5, 6, 8), (5, 7)]
    votes = dict(zip(paths(t), t.votes))
    assert set(votes[(5,)]) == {"eagle", "ngram"} and set(votes[(5, 6)]) == {"eagle", "ngram"}
    assert set(votes[(5, 7)]) == {"eagle"} and set(votes[(5, 6, 8)]) == {"ngram"}
    assert votes[(5, 6)]["eagle"] == pytest.approx(math.log(0.8 * 0.5))
    assert votes[(5, 6)]["ngram"] == pytest.approx(math.log(0.9 * 0.9))
    # the best vote names the node; exp(cumulative draft_logprobs) is its confidence
    src = dict(zip(paths(t), t.sources))
    assert src[(5, 6)] == "ngram" and src[(5, 7)] == "eagle"
    for i, p in enumerate(paths(t)):
        cum = sum(t.draft_logprobs[j] for j in t.path_to(i))
        assert cum == pytest.approx(votes[p][src[p]])
    # parents precede children, children by descending probability
    assert all(par < i for i, par in enumerate(t.parents))
    assert t.tokens[t.children(0)[0]] == 6  # 0.81 (ngram) before 0.2 (eagle)


def test_budget_is_filled_best_first_by_each_sources_calibrated_probability():
    a = labelled([1, 2, 3], [-1, 0, 1], [0.9, 0.9, 0.9], "good")
    b = labelled([4, 5, 6], [-1, 0, 1], [0.9, 0.9, 0.9], "bad")
    cals = SourceCalibrators()
    for _ in range(200):  # "good" nodes are accepted, "bad" ones never
        conf = np.full(8, 0.8)
        cals.observe({"good": ([bin_of(c) for c in conf], [True] * 8),
                      "bad": ([bin_of(c) for c in conf], [False] * 8)})
    t = merge_trees([b, a], ["bad", "good"], 3, cals)
    assert t.tokens == [1, 2, 3] and t.sources == ["good"] * 3
    t = merge_trees([b, a], ["bad", "good"], 4, cals)
    assert sorted(t.tokens) == [1, 2, 3, 4]
    # uncalibrated (the prior = the confidence): equal scores, ties go shallow first
    t = merge_trees([b, a], ["bad", "good"], 4, SourceCalibrators())
    assert sorted(t.tokens) == [1, 2, 4, 5]
    # exploration fills round-robin over the sources whatever the calibration
    t = merge_trees([b, a], ["bad", "good"], 4, cals, explore=True)
    assert sorted(t.tokens) == [1, 2, 4, 5]


def random_tree(rng, source, vocab=6, depth=4, nodes=8):
    """A random tree of ``source`` (distinct siblings, at most ``depth`` deep)."""
    tokens, parents, lps, depths, frontier = [], [], [], [], [-1]
    while len(tokens) < nodes and frontier:
        par = rng.choice(frontier)
        used = {tokens[i] for i in range(len(tokens)) if parents[i] == par}
        free = [t for t in range(vocab) if t not in used]
        if not free or (par >= 0 and depths[par] >= depth):
            frontier.remove(par)
            continue
        tokens.append(rng.choice(free))
        parents.append(par)
        depths.append(1 if par < 0 else depths[par] + 1)
        lps.append(math.log(rng.uniform(0.05, 1.0)))
        frontier.append(len(tokens) - 1)
    return DraftTree(tokens, parents, lps, [source] * len(tokens)) if tokens else None


def test_random_merges_keep_the_invariants():
    rng = random.Random(0)
    cals = SourceCalibrators()
    for s, slope in [("x", 2.0), ("y", 0.5)]:  # different maps per source
        for _ in range(50):
            conf = [rng.random() for _ in range(32)]
            cals.observe({s: ([bin_of(c) for c in conf],
                              [rng.random() < c ** slope for c in conf])})
    for trial in range(200):
        names = ["x", "y", "z"]
        trees = [random_tree(rng, s) if rng.random() < 0.85 else None for s in names]
        budget = rng.randint(1, 12)
        t = merge_trees(trees, names, budget, cals, explore=trial % 5 == 0)
        if all(x is None for x in trees):
            assert t is None
            continue
        union = {}
        for tree in trees:
            if tree is not None:
                for p, v in zip(paths(tree), node_votes(tree)):
                    union.setdefault(p, {}).update(v)
        assert t.num_nodes == min(budget, len(union))
        assert all(par < i for i, par in enumerate(t.parents))  # DraftTree checks siblings
        for p, v in zip(paths(t), t.votes):
            assert v == union[p]  # every source that proposed the path, its own confidence
        if trial % 5:  # best-first: no node left out beats a kept one on the frontier
            probs = dict(zip(paths(t), cals.node_probs(t)))
            kept = set(probs)
            frontier = [p for p in union if p not in kept and (len(p) == 1 or p[:-1] in kept)]
            left = cals.vote_probs([union[p] for p in frontier])
            if frontier:
                assert max(q for q, _ in left) <= min(probs.values()) + 1e-12
        sub = prune_tree(t, 2, 3)  # the engine's pruning keeps the votes
        assert isinstance(sub, MergedTree) and len(sub.votes) == sub.num_nodes


class FixedDrafter(Drafter):
    """Proposes given trees; records the hooks it receives."""

    wants_hidden = False

    def __init__(self, name, tree, hidden=False):
        super().__init__(Strategy(3))
        self.name, self.tree, self.wants_hidden = name, tree, hidden
        self.calls = []

    def propose(self, seqs, strategy):
        return [self.tree for _ in seqs]

    def observe(self, seq, start, hidden):
        self.calls.append("observe")

    def release(self, seq):
        self.calls.append("release")

    def set_weight_version(self, version):
        self.calls.append(("version", version))


def test_merged_drafter_forwards_hooks_and_names_itself():
    a = FixedDrafter("a", labelled([1, 2], [-1, 0], [0.5, 0.5], "a"))
    b = FixedDrafter("b", labelled([1, 3], [-1, 0], [0.9, 0.5], "b"), hidden=True)
    m = MergedDrafter([a, b])
    assert m.name == "a+b" and m.wants_hidden and m.part("b") is b
    seqs = [SimpleNamespace(seq_id=i, token_ids=[0]) for i in range(2)]
    out = m.propose(seqs, Strategy(2, 2, 2))
    assert all(t.num_nodes == 2 and t.tokens[0] == 1 for t in out)
    m.observe(None, 0, torch.zeros(1, 4))
    m.release(seqs[0])
    m.discard(seqs[1])  # a moved sample: each part drops it (the base discard releases)
    assert a.calls == ["release"] * 2 and b.calls == ["observe", "release", "release"]
    m.set_weight_version(3)  # every part hears of the target's new weights
    assert a.calls[-1] == b.calls[-1] == ("version", 3)
    assert m.features(None) is None
    assert m.stats()["merged_nodes_proposed"] == {"a": 4, "b": 4}
    with pytest.raises(ValueError, match="empty"):
        MergedDrafter([])
    with pytest.raises(ValueError, match="repeat"):
        MergedDrafter([a, FixedDrafter("a", None)])
    with pytest.raises(AttributeError):  # nothing of a part is forwarded
        m.tree  # noqa: B018


def test_matched_length_is_the_longest_path_the_committed_tokens_follow():
    t = DraftTree([5, 6, 7, 8], [-1, 0, 0, 2])  # 5 -> {6, 7 -> 8}
    assert matched_length(t, [5, 7, 8, 1]) == 3
    assert matched_length(t, [5, 6, 9]) == 2
    assert matched_length(t, [5, 7]) == 2  # no more committed than that
    assert matched_length(t, [4, 5]) == 0 and matched_length(t, []) == 0
    assert matched_length(None, [5]) == 0


def test_the_base_tree_enters_whole_whatever_the_calibration_says():
    """``base`` keeps a source's tree whole, even against a calibration that prefers the
    other's nodes, and the rest of the budget is filled from the others (also when exploring)."""
    good = labelled([1, 2, 3], [-1, 0, 1], [0.5, 0.5, 0.5], "good")
    bad = labelled([4, 5, 6], [-1, 0, 1], [0.99, 0.99, 0.99], "bad")
    cals = SourceCalibrators()
    for _ in range(200):  # the calibration believes "bad" and not "good"
        cals.observe({"bad": ([bin_of(0.95)] * 8, [True] * 8),
                      "good": ([bin_of(0.4)] * 8, [False] * 8)})
    assert merge_trees([bad, good], ["bad", "good"], 3, cals).tokens == [4, 5, 6]
    for explore in (False, True):
        t = merge_trees([bad, good], ["bad", "good"], 4, cals, explore=explore, base="good")
        assert {(1,), (1, 2), (1, 2, 3)} <= set(paths(t)) and t.num_nodes == 4
        assert (4,) in paths(t)  # the one node of budget left: the other source's best
    t = merge_trees([bad, good], ["bad", "good"], 2, cals, base="good")  # base over budget
    assert paths(t) == [(1,), (1, 2)]


def test_merged_drafter_bases_each_merge_on_the_source_that_matched_best():
    """The parts' trees are scored against what the target committed next; the part that
    would have had more accepted becomes the base of the following merges (per sequence,
    starting from the all-sequence average), so its tree is kept whole although the
    uncalibrated fill prefers the other's confident nodes."""
    good = FixedDrafter("good", labelled([1, 2, 3], [-1, 0, 1], [0.3, 0.3, 0.3], "good"))
    bad = FixedDrafter("bad", labelled([4, 5, 6, 7], [-1, 0, 1, 2], [0.99] * 4, "bad"))
    m = MergedDrafter([bad, good], explore_every=0)
    seq = SimpleNamespace(seq_id=7, token_ids=[0])
    strategy = Strategy(4, 1, 4)
    assert m.propose([seq], strategy)[0].tokens == [4, 5, 6, 7]  # no scores yet
    seq.token_ids += [1, 2, 3, 9]  # the target's own tokens follow "good"'s path
    t = m.propose([seq], strategy)[0]
    assert m.base_of(seq) == "good" and {(1,), (1, 2), (1, 2, 3)} <= set(paths(t))
    assert t.num_nodes == 4 and (4,) in paths(t)
    stats = m.stats()
    assert stats["merged_matched_per_draft"] == {"bad": 0.0, "good": 3.0}
    assert stats["merged_base"] == {"good": 1}
    fresh = SimpleNamespace(seq_id=8, token_ids=[0])
    assert m.base_of(fresh) == "good"  # the all-sequence average
    m.release(seq)
    assert seq.seq_id not in m._drafted and seq.seq_id not in m._seq_matched



def test_a_sequence_takes_another_base_only_on_a_clear_lead():
    """The overall best part is every merge's base; a sequence switches to another part only
    when that part's paired lead on its own drafts is ``Z`` standard errors above zero: a
    noisy lead (it matches 3 tokens, then the base matches 1, in turns) keeps the overall best,
    a steady one (3 tokens every draft) switches after two drafts."""
    a = FixedDrafter("a", labelled([1, 2, 3], [-1, 0, 1], [0.5] * 3, "a"))
    b = FixedDrafter("b", labelled([4, 5, 6], [-1, 0, 1], [0.5] * 3, "b"))
    m = MergedDrafter([a, b], explore_every=0)
    strategy = Strategy(3, 1, 3)

    def draft(seq, committed):
        m.propose([seq], strategy)
        seq.token_ids += committed

    x = SimpleNamespace(seq_id=1, token_ids=[0])
    for _ in range(5):
        draft(x, [1, 2, 3, 9])  # "a" matches 3, "b" 0
    y = SimpleNamespace(seq_id=2, token_ids=[0])
    for i in range(6):
        draft(y, [4, 5, 6, 9] if i % 2 == 0 else [1, 8])  # "b" leads by 3, then trails by 1
    m.propose([y], strategy)
    assert m.base_of(y) == "a"  # its own mean favours "b", but the lead 1.0 +- 0.89 is not clear
    z = SimpleNamespace(seq_id=3, token_ids=[0])
    draft(z, [4, 5, 6, 9])
    m.propose([z], strategy)
    assert m.base_of(z) == "a"  # one draft: no standard error yet
    z.token_ids += [4, 5, 6, 9]
    m.propose([z], strategy)
    assert m.base_of(z) == "b"  # 3 tokens ahead on both drafts
    assert m.base_of(SimpleNamespace(seq_id=4, token_ids=[0])) == "a"  # overall best

# ---- exactness in the engine ---------------------------------------------------------------
def make(target_dir, spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(str(target_dir), dtype="float32", block_size=8, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(target_dir):
    return make(target_dir)


def merged(d=3, k=2, m=6, policy="static", methods=("ngram", "eagle")):
    # auto without its loss guard: these runs are too short for the guard to let it speculate
    # (tests/test_guard.py), and what is tested here is speculation through merged trees
    return {"method": list(methods), "model": "random", "num_speculative_tokens": d,
            "topk": k, "num_verify_tokens": m, "policy": policy, "policy_max_loss": None}


def check_clean(llm):
    met = llm.get_metrics()
    assert met["kv_blocks_free"] == met["kv_blocks_total"]
    eagle = llm.engine.drafter.part("eagle")
    assert eagle.blocks.num_free == eagle.blocks.num_blocks and not eagle.states
    assert not llm.engine.drafter.part("ngram").ngram._histories
    return met


@pytest.mark.parametrize("policy", ["static", "auto"])
def test_greedy_merged_equals_plain_and_kv_returns(target_dir, plain, policy):
    prompts = rand_prompts(5, seed=4)
    prompts[0] = [7, 8, 9, 10] * 6  # repeats: n-gram matches from the first step
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    llm = make(target_dir, merged(policy=policy))
    assert llm.engine.drafter.name == "ngram+eagle"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    met = check_clean(llm)
    src = met["source_stats"]
    assert src["ngram"]["nodes_verified"] > 0 and src["eagle"]["nodes_verified"] > 0
    assert src["ngram"]["nodes_accepted"] > 0  # the repeated prompt is predicted
    for s in src.values():
        assert sum(s["verified_per_depth"]) == s["nodes_verified"]
        assert len(s["acceptance_per_depth"]) <= 3
    assert met["merged_nodes_kept"]["ngram"] <= met["merged_nodes_proposed"]["ngram"]
    assert max(met["drafted_tokens"], 1) <= 6 * met["spec_steps"]  # one budget per tree
    # the budget is filled with calibrators the policy trains (its cutter's, or a learner's)
    assert set(met["policy_calibration_per_source"]) >= {"ngram", "eagle"}
    assert len(src["eagle"]["calibration"]) == 16
    pol = llm.engine.policy
    learner = pol.cutter if policy == "auto" else pol.calibration_learner
    assert llm.engine.drafter.scorer is learner.sources
    assert learner.sources.get("eagle").tried.sum() > 0


def test_seeded_sampling_merged_equals_plain(target_dir, plain):
    prompts = rand_prompts(6, seed=13)
    prompts[1] = [3, 4, 5] * 8
    sp = [SamplingParams(temperature=t, top_p=tp, top_k=k, seed=i, max_tokens=20,
                         ignore_eos=True)
          for i, (t, tp, k) in enumerate([(1.0, 1.0, 0), (1.0, 1.0, 0), (1.0, 0.9, 0),
                                          (1.0, 1.0, 8), (0.7, 1.0, 0), (0.0, 1.0, 0)])]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    for spec in (merged(), merged(4, 1, 4, "auto")):
        llm = make(target_dir, spec)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want
        met = check_clean(llm)
        assert met["spec_steps"] > 0 and met["drafted_tokens"] > 0


def test_suffix_and_eagle_merged_equal_plain_across_calls(target_dir, plain):
    """The rollout memory (history of the first call, siblings of n = 3) merged with EAGLE:
    greedy and seeded T = 1 outputs equal plain decoding in every call; suffix nodes verified."""
    prompts = rand_prompts(3, seed=21)
    sps = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2),
           SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, n=3)]
    llm = make(target_dir, merged(4, 2, 8, "static", methods=("suffix", "eagle")))
    assert llm.engine.drafter.name == "suffix+eagle"
    for sp in sps + sps:  # the second round finds the first round's responses in history
        want = [[c.token_ids for c in o.outputs]
                for o in plain.generate(prompts, sp, use_tqdm=False)]
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want
    met = llm.get_metrics()
    assert met["kv_blocks_free"] == met["kv_blocks_total"]
    assert met["source_stats"]["suffix"]["nodes_accepted"] > 0
    assert met["rollout_memory_groups"] == 3


# ---- the statistical test on merged trees ----------------------------------------------------
_g = torch.Generator().manual_seed(99)
OTHER = torch.randn(tv.V, tv.V, tv.V, generator=_g).argsort(-1, descending=True).tolist()


def merged_tree(seq, budget, scorer):
    """A top-2 tree of the draft Q (source "q", depth 2) and a depth-3 chain of another
    deterministic guess (source "g", n-gram-like confidence 1/2 per step), merged."""
    a, b = seq[-2], seq[-1]
    tokens, parents, lps = [], [], []
    for t in tv.QTOP[a][b][:2]:
        tokens.append(t)
        parents.append(-1)
        lps.append(math.log(tv.QL[a][b][t]))
        node = len(tokens) - 1
        for u in tv.QTOP[b][t][:2]:
            tokens.append(u)
            parents.append(node)
            lps.append(math.log(tv.QL[b][t][u]))
    q = DraftTree(tokens, parents, lps, ["q"] * len(tokens))
    chain, x, y = [], a, b
    for _ in range(3):
        x, y = y, OTHER[x][y][0]
        chain.append(y)
    g = trees.chain(chain, [math.log(0.5)] * 3)
    g.sources = ["g"] * 3
    return merge_trees([q, g], ["q", "g"], budget, scorer)


def merged_counts(P, budget, n, seed, verifier):
    g = torch.Generator().manual_seed(seed)
    scorer = SourceCalibrators()
    counts = torch.zeros(tv.V ** 3, dtype=torch.float64)
    for _ in range(n):
        seq = list(tv.PROMPT)
        while len(seq) < len(tv.PROMPT) + 3:
            tree = merged_tree(seq, budget, scorer)
            accepted, bonus = verifier(tree, tv.node_rows(P, seq, tree), g)
            seq += tv.committed_tokens(tree, accepted, bonus)
        a, b, c = seq[2:5]
        counts[(a * tv.V + b) * tv.V + c] += 1
    return counts.view(tv.V, tv.V, tv.V)


@pytest.mark.parametrize("verifier", ["coupled", "reference"])
@pytest.mark.parametrize("budget", [3, 7])
def test_sampling_through_merged_trees_is_lossless(verifier, budget):
    P = tv.target_probs(1.0)
    fn = tv.coupled if verifier == "coupled" else verify_sampling
    counts = merged_counts(P, budget, 10_000, seed=budget, verifier=fn)
    stat, crit = tv.chi_square(counts, tv.exact_joint(P))
    assert stat < crit, (stat, crit)


def test_merged_statistical_test_has_power():
    """The same test on merged trees rejects a biased verifier (tries only the first child,
    and draws the bonus from the row without removing the rejected token)."""
    P = tv.target_probs(1.0)

    def first_child_only(tree, probs, g):
        def step(tree, p, kids, g):
            return tv.no_renormalisation(tree, p, kids[:1], g)
        return tv.walk(tree, probs, g, step)

    counts = merged_counts(P, 7, 3_000, seed=5, verifier=first_child_only)
    stat, crit = tv.chi_square(counts, tv.exact_joint(P))
    assert stat > crit, (stat, crit)


# ---- per-source calibration ----------------------------------------------------------------
def synthetic_records(rng, steps=400):
    """Steps whose verified trees hold chains from two sources with the same confidences but
    different true acceptance: "sure" nodes are accepted with probability sqrt(confidence),
    "shaky" ones with confidence squared."""
    seqs = [SimpleNamespace(calib_accepted=0, calib_predicted=0.0) for _ in range(4)]
    truth = {"sure": lambda c: c ** 0.5, "shaky": lambda c: c ** 2}
    out = []
    for _ in range(steps):
        verified = []
        for seq in seqs:
            src = str(rng.choice(["sure", "shaky"]))
            step_p = rng.uniform(0.3, 0.95, size=3)
            tree = DraftTree([1, 2, 3], [-1, 0, 1], np.log(step_p).tolist(), [src] * 3)
            conf = np.cumprod(step_p)
            acc = []
            for i, c in enumerate(conf):  # accepted along the path while each node holds
                if rng.random() < truth[src](c) / (truth[src](conf[i - 1]) if i else 1.0):
                    acc.append(i)
                else:
                    break
            verified.append((seq, tree, acc))
        out.append(StepRecord(strategy=Strategy(3), num_decode=4, num_prefill_tokens=0,
                              num_forward_tokens=16, context_tokens=400, num_drafted=12,
                              num_committed=4 + sum(len(a) for _, _, a in verified),
                              accepted_per_seq=[len(a) for _, _, a in verified],
                              draft_time=0.0, forward_time=0.01, other_time=0.0,
                              verified=verified))
    return out, truth


def test_per_source_calibration_learns_each_sources_acceptance():
    rng = np.random.default_rng(0)
    cutter = TreeCutter()
    recs, truth = synthetic_records(rng)
    cutter.learn(recs)
    maps = cutter.sources.maps()
    assert set(maps) == {"sure", "shaky"}
    seen = {"sure": [], "shaky": []}
    for rec in recs:
        for _, tree, _ in rec.verified:
            seen[tree.sources[0]] += np.exp(np.cumsum(tree.draft_logprobs)).tolist()
    for c in (0.15, 0.3, 0.6):
        b = bin_of(c)
        for s in ("sure", "shaky"):  # the mean true acceptance of the bin's nodes
            want = np.mean([truth[s](x) for x in seen[s] if bin_of(x) == b])
            assert maps[s][b] == pytest.approx(want, abs=0.08), (s, c)
        assert maps["sure"][b] > maps["shaky"][b] + 0.2
    # the cut keeps the nodes that pay whichever source proposed them: at the same confidence
    # a "sure" node clears a bar of 0.45 and a "shaky" one does not
    cutter.verify_whole_every = 0
    seqs = [SimpleNamespace(calib_accepted=0, calib_predicted=0.0) for _ in range(2)]
    trees = [DraftTree([1], [-1], [math.log(0.3)], [s]) for s in ("sure", "shaky")]
    out = cutter.cut(seqs, trees, [0, 1], bar=0.45)
    assert out[0] is trees[0] and out[1] is None
    # a merged node both proposed is worth its best source's estimate, and teaches both
    both = MergedTree([1], [-1], [math.log(0.3)], ["sure"],
                      votes=[{"shaky": math.log(0.3), "sure": math.log(0.3)}])
    sure = cutter.sources.get("sure").rate_per_bin()[bin_of(0.3)]
    assert cutter.sources.node_probs(both) == [sure]
    tried = {s: cutter.sources.get(s).tried.sum() for s in ("sure", "shaky")}
    cutter.learn([StepRecord(Strategy(1), 1, 0, 2, 10, 1, 2, [1], 0.0, 0.01, 0.0,
                             verified=[(seqs[0], both, [0])])])
    for s in ("sure", "shaky"):
        assert cutter.sources.get(s).tried.sum() > tried[s] * cutter.sources.get(s).decay


def test_source_stats_count_each_source_per_depth():
    st = SourceStats()
    t = MergedTree([1, 2, 3], [-1, 0, -1], [0.0, 0.0, 0.0], ["a", "a", "b"],
                   votes=[{"a": 0.0, "b": 0.0}, {"a": 0.0}, {"b": 0.0}])
    st.record(t, [0, 1])
    st.record(DraftTree([4], [-1]), [])  # unnamed: the default source
    d = st.as_dict()
    assert d["a"]["verified_per_depth"] == [1, 1] and d["a"]["accepted_per_depth"] == [1, 1]
    assert d["b"]["nodes_verified"] == 2 and d["b"]["nodes_accepted"] == 1
    assert d["b"]["acceptance_per_depth"] == [0.5]
    assert d["draft"]["nodes_verified"] == 1 and d["draft"]["acceptance"] == 0.0


def test_auto_policy_reports_calibration_per_source():
    pol = AutoPolicy([Strategy(3)])
    recs, _ = synthetic_records(np.random.default_rng(1), steps=20)
    for r in recs:
        pol.record(r)
    stats = pol.stats()
    assert set(stats["policy_calibration_per_source"]) == {"sure", "shaky"}
    assert stats["policy_calibration_per_source"]["sure"] != \
        stats["policy_calibration_per_source"]["shaky"]


# ---- configuration -------------------------------------------------------------------------
@pytest.mark.parametrize("method,match", [
    ([], "list at least one"),
    (["ngram", "ngram"], "more than once"),
    (["ngram", "medusa"], "unknown method"),
    (["ngram", 3], "unknown method"),
    (["draft_model", "eagle"], "cannot be combined"),
    ({"ngram"}, "use one of"),
])
def test_method_list_errors(method, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict({"method": method, "model": "x"})


def test_method_list_forms():
    cfg = SpeculativeConfig.from_dict({"method": ["eagle"]})
    assert cfg.method == "eagle" and cfg.methods == ("eagle",)
    cfg = SpeculativeConfig.from_dict({"method": ("ngram", "eagle")})
    assert cfg.method == ["ngram", "eagle"] and cfg.methods == ("ngram", "eagle")
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.from_dict({"method": ["ngram", "draft_model"]})


def test_sleep_releases_the_merged_drafters_kv_and_wakes_to_the_same_outputs(target_dir):
    """The memory manager finds the EAGLE part's KV pool and LM-head copies through the merged
    drafter (``Drafter.walk`` and each part's ``kv_pools`` / ``packed_weights``)."""
    llm = make(target_dir, merged())
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = rand_prompts(3, seed=2)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    eagle = llm.engine.drafter.part("eagle")
    assert [t for d in llm.engine.drafter.walk() for t in d.kv_pools()] == [eagle.kv]
    assert llm.engine.drafter.find(EagleDrafter) is eagle and not hasattr(llm.engine.drafter, "kv")
    released = llm.sleep(level=1)
    assert released["kv_cache"] == (8 << 20) + eagle.kv.numel() * 4
    assert eagle.kv.untyped_storage().nbytes() == 0
    llm.wake_up()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert after == before
    check_clean(llm)


def test_ngram_with_a_self_draft_model_learns_which_source_pays(target_dir, plain):
    """``["ngram", "draft_model"]`` with the target as its own draft model: outputs equal
    plain decoding (greedy and seeded), the draft model's trees would have had far more
    accepted than the n-gram ones, so the merge is based on them, and the per-source
    calibration learns what each source's nodes are worth."""
    prompts = rand_prompts(4, seed=21)
    prompts[0] = [9, 10, 11] * 8
    sp = [SamplingParams(temperature=t, seed=i, max_tokens=20, ignore_eos=True)
          for i, t in enumerate([0.0, 0.0, 1.0, 1.0])]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    spec = {"method": ["ngram", "draft_model"], "model": str(target_dir),
            "num_speculative_tokens": 3, "topk": 2, "num_verify_tokens": 6, "policy": "static"}
    llm = make(target_dir, spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    met = llm.get_metrics()
    assert met["kv_blocks_free"] == met["kv_blocks_total"]
    src = met["source_stats"]
    assert src["draft_model"]["acceptance"] > 0.3
    # each source's own tree against the target's tokens: the draft model's would have had far
    # more accepted, so it is the base of the merges and the n-gram nodes only fill what is left
    matched = met["merged_matched_per_draft"]
    assert matched["draft_model"] > 1.0 > 0.5 > matched["ngram"]
    assert set(met["merged_base"]) == {"draft_model"}
    assert met["merged_nodes_kept"]["ngram"] < met["merged_nodes_proposed"]["ngram"]
    cal = llm.engine.policy.calibration_learner.sources
    b = bin_of(0.5)  # the draft model's well-calibrated confidence bins pay more
    assert cal.get("draft_model").rate_per_bin()[b:].mean() > \
        cal.get("ngram").rate_per_bin()[b:].mean()


def test_drafters_inside_drafters_are_found_without_forwarding():
    """``wrapped`` / ``walk`` / ``find`` see through a Harvester and a MergedDrafter; nothing of
    a part is reached as an attribute of the merged drafter."""
    a, b = FixedDrafter("a", None), FixedDrafter("b", None)
    merged = MergedDrafter([a, b])
    blocks = BlockManager(4, 8, lambda src, dst: None)
    outer = Harvester(merged, HiddenBuffer(), blocks)
    assert outer.wrapped() == [merged] and merged.wrapped() == [a, b] and a.wrapped() == []
    assert list(outer.walk()) == [outer, merged, a, b]
    assert outer.find(MergedDrafter) is merged and outer.find(FixedDrafter) is a
    assert a.find(MergedDrafter) is None and Harvester(None, HiddenBuffer(), blocks).wrapped() == []
    assert a.kv_pools() == [] and a.trainable_model() is None
    with pytest.raises(ValueError, match=r"no part of 'a\+b' takes published weights"):
        merged.publish({}, 1)
    with pytest.raises(ValueError, match="takes no published weights"):
        a.publish({}, 1)

