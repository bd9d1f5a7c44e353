"""Automatic prefix caching: hashes, LRU eviction, hits that skip prefill work, outputs identical
with caching on and off (plain, ngram, EAGLE), invalidation, KV accounting, failures."""

import pytest
import torch
from helpers import rand_prompts
from safetensors.torch import load_file

from specengine import LLM, SamplingParams
from specengine.engine.batch import BatchEntry
from specengine.engine.model_runner import ModelRunner
from specengine.engine.sequence import Sequence
from specengine.kv.block_manager import BlockManager
from specengine.kv.prefix_cache import PrefixCache, chain_hashes, hash_block, hash_partial
from specengine.models.loader import save_random_model
from specengine.sampling.params import SampleNoise
from specengine.speculative.training.harvest import HiddenBuffer, harvest

BS = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("tiny"), {"num_hidden_layers": 2}, seed=1)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """Same architecture, other weights (a "trained" policy)."""
    return save_random_model(tmp_path_factory.mktemp("other"), {"num_hidden_layers": 2}, seed=7)


def make(d, caching=True, spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    if spec is not None:
        spec = {"policy": "static", **spec}  # speculate every step
    return LLM(str(d), dtype="float32", block_size=BS, enable_prefix_caching=caching,
               speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def off(tiny_dir):
    return make(tiny_dir, caching=False)


def greedy(n=12, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_baseline(llm):
    """No request holds a block: every block is free or cached-and-evictable."""
    b = llm.engine.blocks
    assert b.allocator.num_free + b.num_evictable == b.num_blocks
    assert b.num_evictable == b.num_cached_blocks
    assert b.num_free == b.num_blocks
    for blk in b.cache.blocks():
        assert b.allocator.refcount(blk) == 1  # the cache's own reference, not on the free list


def hashes(llm, tokens, n):
    """Chain hashes of the first ``n`` blocks of ``tokens`` in the engine's namespace."""
    return chain_hashes(tokens, BS, n, root=llm.engine.blocks.salt)


def cached_block(llm, tokens, i):
    """The cached block holding block ``i`` of ``tokens`` (None if not cached)."""
    return llm.engine.blocks.cache.lookup(hashes(llm, tokens, i + 1)[i])


def reference_kv(model, tokens):
    """K/V ``[layers, 2, n_blocks, BS, heads, dim]`` of ``tokens`` by one prefill in a private
    pool."""
    n = -(-len(tokens) // BS)
    runner = ModelRunner(model, n, BS)
    bm = BlockManager(n, BS, runner.copy_block)
    s = Sequence("ref", 0, list(tokens), SamplingParams(), SampleNoise(0, 0))
    bm.allocate_shared([s])
    runner.run([BatchEntry(s, len(s), [s], True)], bm)
    return runner.kv_cache[:, :, s.block_table]


# ---- the bookkeeping ---------------------------------------------------------------------------
def test_chain_hash_covers_everything_before():
    a, b = list(range(16)), list(range(16))
    b[3] = 99  # differs in block 0 only
    ha, hb = chain_hashes(a, 8, 2), chain_hashes(b, 8, 2)
    assert ha[0] != hb[0] and ha[1] != hb[1]  # block 1 has equal tokens but another prefix
    assert ha == chain_hashes(a, 8, 2, known=ha[:1]) and len(ha[0]) == 16
    assert hash_block(b"", a[:8]) == ha[0] and hash_block(b"", a[1:9]) != ha[0]
    with pytest.raises(ValueError, match="3 blocks of 8 tokens need 24 tokens, got 16"):
        chain_hashes(a, 8, 3)


def test_prefix_cache_lru_order_and_errors():
    c = PrefixCache()
    for blk in range(3):
        c.register(bytes([blk]), blk)
    with pytest.raises(ValueError, match="registered already"):
        c.register(bytes([0]), 5)
    with pytest.raises(ValueError, match="block 1 is registered already"):
        c.register(b"new", 1)
    c.release(2)
    c.release(0)
    c.release(1)
    c.acquire(0)  # in use again: not evictable
    assert (len(c), c.num_evictable) == (3, 2)
    assert c.pop_lru() == 2 and c.lookup(bytes([2])) is None
    c.release(0)
    assert [c.pop_lru(), c.pop_lru()] == [1, 0] and len(c) == 0
    with pytest.raises(RuntimeError, match="no evictable block"):
        c.pop_lru()
    with pytest.raises(KeyError):
        c.release(7)


def test_block_manager_keeps_cached_blocks_off_the_free_list_until_evicted():
    copies = []
    bm = BlockManager(6, 4, lambda s, d: copies.append((s, d)), enable_prefix_caching=True)
    s = Sequence("a", 0, list(range(10)), SamplingParams(), SampleNoise(0, 0))
    assert bm.match(s) == []
    bm.allocate_shared([s])  # 3 blocks: the 2 full ones and the partial one registered
    s.num_cached = 10  # the prefill ran
    bm.commit(s)
    first = list(s.block_table)
    bm.free(s)
    assert (bm.allocator.num_free, bm.num_evictable, bm.num_free) == (3, 3, 6)
    assert [bm.allocator.refcount(b) for b in first] == [1, 1, 1]
    # the same prompt again: all 3 blocks hit; the last token runs again, into a copy
    t = Sequence("b", 0, list(range(10)), SamplingParams(), SampleNoise(0, 0))
    hit = bm.match(t)
    assert hit == first and bm.admission_cost(t, hit) == 3 + 1  # 3 revived, 1 copy
    bm.allocate_shared([t], hit)
    assert t.num_cached == 9 and t.block_table[:2] == first[:2]
    assert copies == [(first[2], t.block_table[2])] and t.block_table[2] not in first
    assert bm.num_evictable == 1  # the cached partial block, copied, nobody uses it
    assert (bm.cache.hit_tokens, bm.cache.queried_tokens, bm.cache.rerun_tokens) == (10, 20, 1)
    # a longer prompt shares the full blocks only (the partial hash is of the exact tokens)
    w = Sequence("w", 0, list(range(11)), SamplingParams(), SampleNoise(0, 0))
    assert bm.match(w) == first[:2]
    t.num_cached = 10
    bm.free(t)
    assert bm.num_cached_blocks == 3 and bm.allocator.num_free == 3
    # a new prompt needing all 6 blocks evicts the cached ones, tail block first
    u = Sequence("c", 0, list(range(100, 124)), SamplingParams(), SampleNoise(0, 0))
    assert bm.match(u) == [] and bm.admission_cost(u, []) == 6
    v = Sequence("d", 0, list(range(200, 217)), SamplingParams(), SampleNoise(0, 0))
    bm.allocate_shared([v])  # 5 blocks: 3 free + the 2 LRU cached ones (blocks 2, 1 of "a")
    assert bm.num_cached_blocks == 1 + 5  # block 0 of "a" and v's 4 full + 1 partial blocks
    assert cached_lookup(bm, list(range(10)), 0) == first[0]
    assert cached_lookup(bm, list(range(10)), 1) is None
    assert bm.match(Sequence("e", 0, list(range(10)), SamplingParams(),
                             SampleNoise(0, 0))) == first[:1]


def cached_lookup(bm, tokens, i):
    return bm.cache.lookup(chain_hashes(tokens, bm.block_size, i + 1, root=bm.salt)[i])


def test_shared_blocks_are_copied_before_a_write_and_all_come_back():
    """``BlockPool.share`` (how EAGLE's samples of one prompt hold its drafter KV): the second
    sequence reads the first's blocks, one more reference each; growing it copies the partly
    filled last block before writing there while the full one stays shared; freeing both
    returns every block; sharing into a sequence that holds blocks is an error."""
    copies = []
    bm = BlockManager(8, BS, lambda s, d: copies.append((s, d)))
    a = Sequence("a", 0, list(range(13)), SamplingParams(), SampleNoise(0, 0))
    bm.grow(a, 13)  # positions 0-12: a full block and 5 slots of the next
    a.num_cached = 13
    b = Sequence("a", 1, list(range(13)), SamplingParams(), SampleNoise(0, 0))
    bm.share(a, b)
    assert (b.block_table, b.num_cached, bm.num_free) == (a.block_table, 13, 6)
    assert [bm.allocator.refcount(x) for x in a.block_table] == [2, 2]
    bm.grow(b, 2)  # positions 13-14 go into the shared partial block: b gets a copy
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert copies == [(a.block_table[1], b.block_table[1])] and bm.num_free == 5
    assert [bm.allocator.refcount(x) for x in a.block_table] == [2, 1]
    with pytest.raises(ValueError, match="holds 2 blocks"):
        bm.share(a, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 8


def test_unconfirmed_blocks_are_dropped_when_the_prefill_never_ran():
    bm = BlockManager(8, 4, lambda s, d: None, enable_prefix_caching=True)
    a = Sequence("a", 0, list(range(9)), SamplingParams(), SampleNoise(0, 0))
    b = Sequence("b", 0, list(range(9)), SamplingParams(), SampleNoise(0, 0))
    bm.allocate_shared([a])
    hit = bm.match(b)  # same step: shares a's blocks, whose K/V the coming forward writes
    assert hit == a.block_table[:2]
    bm.allocate_shared([b], hit)
    for s in (a, b):  # the forward failed: both aborted before their prefill completed
        bm.commit(s)
        bm.free(s)
    assert bm.num_cached_blocks == 0 and bm.allocator.num_free == 8


# ---- in the engine -----------------------------------------------------------------------------
@pytest.mark.parametrize("length", [41, 40, 45])  # partial last block of 1 / none / 5 tokens
def test_verl_style_repeated_prompts_hit_and_skip_prefill(tiny_dir, off, length):
    n = 4
    prompts = rand_prompts(3, lo=length, hi=length + 1, seed=21)
    reqs = [p for p in prompts for _ in range(n)]  # each prompt sent as n separate requests
    total = len(reqs) * length
    llm = make(tiny_dir)
    first = llm.generate(reqs, greedy(), use_tqdm=False)  # all at once
    m1 = llm.get_metrics()
    # copies 2..n of a prompt are admitted with the first: one prefill, every block shared
    assert m1["prefix_cache_queried_tokens"] == total
    assert m1["prefix_cache_hit_tokens"] == (n - 1) * len(prompts) * length
    assert m1["prefix_cache_hit_rate"] == pytest.approx((n - 1) / n)
    assert m1["prefill_tokens"] == len(prompts) * length and m1["prefix_cache_rerun_tokens"] == 0
    assert_baseline(llm)
    second = llm.generate(reqs, greedy(), use_tqdm=False)  # a later call: every copy hits
    m2 = llm.get_metrics()
    assert m2["prefix_cache_hit_tokens"] - m1["prefix_cache_hit_tokens"] == total
    # the first copy of each prompt runs its last token again (for its logits), no more
    assert m2["prefill_tokens"] - m1["prefill_tokens"] == len(prompts)
    assert m2["prefix_cache_rerun_tokens"] == len(prompts)
    assert m2["prefix_cache_hit_rate"] == pytest.approx(
        m2["prefix_cache_hit_tokens"] / m2["prefix_cache_queried_tokens"])
    want = ids(off.generate(reqs, greedy(), use_tqdm=False))
    assert ids(first) == ids(second) == want
    assert_baseline(llm)


@pytest.mark.parametrize("length", [41, 40])
def test_repeated_prompts_one_after_another_hit_all_but_the_first(tiny_dir, off, length):
    n = 5
    prompt = rand_prompts(1, lo=length, hi=length + 1, seed=22)[0]
    llm = make(tiny_dir)
    sampled = [SamplingParams(temperature=1.0, seed=70 + i, max_tokens=12, ignore_eos=True)
               for i in range(n)]
    got = [ids(llm.generate([prompt], sp, use_tqdm=False))[0] for sp in sampled]
    m = llm.get_metrics()
    assert m["prefix_cache_hit_rate"] == pytest.approx((n - 1) / n)
    assert m["prefill_tokens"] == length + (n - 1)  # then one rerun last token per request
    assert got == [ids(off.generate([prompt], sp, use_tqdm=False))[0] for sp in sampled]
    assert_baseline(llm)


def shared_prefix_prompts(seed):
    """A system-prompt style mix: a common 19-token head, varied tails, and repeats."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 512, (19,), generator=g).tolist()
    tails = rand_prompts(4, lo=1, hi=30, seed=seed)
    prompts = [head + t for t in tails] + rand_prompts(2, lo=9, hi=40, seed=seed + 1)
    return prompts + prompts[:3]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_outputs_identical_with_caching_on_and_off(tiny_dir, spec):
    prompts = shared_prefix_prompts(3)
    on, off = make(tiny_dir, True, spec), make(tiny_dir, False, spec)
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i, max_tokens=14,
                              ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    for params in (greedy(14, logprobs=1), sampled, SamplingParams(
            n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)):
        for _ in range(2):  # the second round hits on everything the first one cached
            a = on.generate(prompts, params, use_tqdm=False)
            b = off.generate(prompts, params, use_tqdm=False)
            assert [[o.token_ids for o in r.outputs] for r in a] == \
                   [[o.token_ids for o in r.outputs] for r in b]
            for ra, rb in zip(a, b):
                for oa, ob in zip(ra.outputs, rb.outputs):
                    if oa.logprobs is not None:
                        assert [e[t].logprob for t, e in zip(oa.token_ids, oa.logprobs)] == \
                            pytest.approx([e[t].logprob for t, e in
                                           zip(ob.token_ids, ob.logprobs)], abs=1e-4)
            assert_baseline(on)
    m = on.get_metrics()
    assert m["prefix_cache_hit_tokens"] > 0.5 * m["prefix_cache_queried_tokens"]
    assert m["prefill_tokens"] < 0.5 * off.get_metrics()["prefill_tokens"]
    if spec is not None:
        assert m["spec_steps"] > 0 and m["drafted_tokens"] > m["accepted_tokens"]


def test_cached_blocks_hold_exactly_their_tokens_kv_after_rejected_drafts(tiny_dir):
    """ngram drafts on a repetitive prompt are mostly rejected; their K/V are written into the
    sequence's blocks and must never end up in a cached block."""
    llm = make(tiny_dir, True, {"method": "ngram", "num_speculative_tokens": 4,
                                "prompt_lookup_min": 1})
    g = torch.Generator().manual_seed(5)
    unit = torch.randint(0, 512, (5,), generator=g).tolist()
    prompts = [unit * 5, unit * 3 + [7, 8, 9]]
    outs = llm.generate(prompts, greedy(40), use_tqdm=False)
    m = llm.get_metrics()
    assert m["drafted_tokens"] > m["accepted_tokens"]  # rejected draft K/V were written
    model = llm.engine.runner.model
    checked = 0
    for p, o in zip(prompts, outs):
        tokens = p + o.outputs[0].token_ids
        ref = reference_kv(model, tokens)
        for i in range((len(tokens) - 1) // BS):  # every block of committed tokens is cached
            b = cached_block(llm, tokens, i)
            assert b is not None
            torch.testing.assert_close(llm.engine.runner.kv_cache[:, :, b], ref[:, :, i],
                                       atol=1e-4, rtol=1e-4)
            checked += 1
        # the prompt's partial last block, written past by its owner's decode (drafts too):
        # cached as the prompt left it, so only the prompt's slots are compared
        k = len(p) // BS
        b = llm.engine.blocks.cache.lookup(hash_partial(hashes(llm, p, k)[k - 1], p[k * BS:]))
        assert b is not None and b != cached_block(llm, tokens, k)
        torch.testing.assert_close(llm.engine.runner.kv_cache[:, :, b, :len(p) % BS],
                                   ref[:, :, k, :len(p) % BS], atol=1e-4, rtol=1e-4)
    assert checked >= 2 * (len(prompts[1]) + 40 - 1) // BS
    # a follow-up turn (prompt + answer + more) hits the generated blocks too, same output
    follow = [tokens + [1, 2, 3]]
    before = llm.get_metrics()["prefix_cache_hit_tokens"]
    got = ids(llm.generate(follow, greedy(8), use_tqdm=False))
    assert llm.get_metrics()["prefix_cache_hit_tokens"] - before == (len(tokens) + 2) // BS * BS
    assert got == ids(make(llm.model_dir, False).generate(follow, greedy(8), use_tqdm=False))


def test_lru_eviction_under_a_small_pool(tiny_dir, off):
    per_block = make(tiny_dir, False, kv_cache_memory_bytes=1 << 20).engine.runner.kv_cache[
        :, :, 0].numel() * 4
    llm = make(tiny_dir, kv_cache_memory_bytes=12 * per_block)
    assert llm.engine.blocks.num_blocks == 12
    a, b = rand_prompts(1, lo=41, hi=42, seed=8)[0], rand_prompts(1, lo=57, hi=58, seed=9)[0]
    out_a = llm.generate([a], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    ta = a + out_a  # 49 tokens, K/V of 48: 6 full blocks cached
    assert [cached_block(llm, ta, i) is not None for i in range(6)] == [True] * 6
    partial = llm.engine.blocks.cache.lookup(hash_partial(hashes(llm, a, 5)[4], a[40:]))
    assert partial is not None  # a's prompt's last block, as the prompt left it
    assert llm.engine.blocks.allocator.num_free == 12 - 7
    out_b = llm.generate([b], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    # b needed 8 blocks with 5 free: the 3 least recently released of a's went: the partial
    # block (released when a's first decode copied it), then a's tail (b's partial block is
    # copied at its first decode too: one more block)
    assert llm.engine.blocks.cache.lookup(
        hash_partial(hashes(llm, a, 5)[4], a[40:])) is None
    assert [cached_block(llm, ta, i) is not None for i in range(6)] == [True] * 3 + [False] * 3
    assert_baseline(llm)
    h = llm.get_metrics()["prefix_cache_hit_tokens"]
    again = llm.generate([a], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.get_metrics()["prefix_cache_hit_tokens"] - h == 3 * BS  # the surviving head
    assert [out_a, out_b, again] == ids(off.generate([a, b, a], greedy(8), use_tqdm=False))
    assert_baseline(llm)


def test_preemption_under_pressure_keeps_outputs(tiny_dir, off):
    prompts = shared_prefix_prompts(11)[:6]
    prompts = prompts + prompts[:2]
    per_block = off.engine.runner.kv_cache[:, :, 0].numel() * 4
    small = make(tiny_dir, kv_cache_memory_bytes=14 * per_block)
    for params in (greedy(30), SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                                              ignore_eos=True)):
        want = ids(off.generate(prompts, params, use_tqdm=False))
        assert ids(small.generate(prompts, params, use_tqdm=False)) == want
        assert_baseline(small)
    m = small.get_metrics()
    assert m["preemptions"] > 0
    # recomputed sequences are looked up again (their prompt and output so far)
    assert m["prefix_cache_queried_tokens"] > 2 * sum(map(len, prompts))
    assert m["prefix_cache_hit_tokens"] > 0


def test_update_weights_invalidates(tiny_dir, other_dir):
    prompts = rand_prompts(4, lo=20, hi=40, seed=12)
    llm = make(tiny_dir)
    llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_blocks"] > 0
    llm.update_weights(load_file(str(other_dir / "model.safetensors")))
    assert llm.get_metrics()["prefix_cache_blocks"] == 0
    assert llm.engine.blocks.allocator.num_free == llm.engine.blocks.num_blocks
    h = llm.get_metrics()["prefix_cache_hit_tokens"]
    got = ids(llm.generate(prompts, greedy(), use_tqdm=False))
    assert llm.get_metrics()["prefix_cache_hit_tokens"] == h  # nothing stale was reused
    assert got == ids(make(other_dir, False).generate(prompts, greedy(), use_tqdm=False))


def test_reset_prefix_cache(tiny_dir):
    llm = make(tiny_dir)
    p = rand_prompts(1, lo=30, hi=31, seed=13)[0]
    llm.generate([p], greedy(), use_tqdm=False)
    blocks = llm.engine.blocks
    assert blocks.num_cached_blocks == (30 + 12 - 1) // BS + 1  # + the prompt's partial block
    it = llm.generate_iter([p, p[:20]], [greedy(), greedy(40)], use_tqdm=False)
    next(it)  # the first request is done, the second one is still in flight
    assert llm.reset_prefix_cache() is True  # works while requests run
    assert blocks.num_cached_blocks == 0
    list(it)  # the running one's later blocks go to its old namespace
    assert blocks.allocator.num_free + blocks.num_evictable == blocks.num_blocks
    assert llm.reset_prefix_cache() is True
    assert blocks.num_cached_blocks == 0 and blocks.allocator.num_free == blocks.num_blocks
    h = llm.get_metrics()["prefix_cache_hit_tokens"]
    llm.generate([p], greedy(), use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hit_tokens"] == h
    assert make(tiny_dir, False).reset_prefix_cache() is True  # nothing to reset: still True


def test_a_failed_forward_leaves_no_cache_entry(tiny_dir, off, monkeypatch):
    llm = make(tiny_dir)
    p = rand_prompts(1, lo=25, hi=26, seed=14)[0]
    real = llm.engine.runner.run

    def boom(entries, blocks):
        raise RuntimeError("injected")

    monkeypatch.setattr(llm.engine.runner, "run", boom)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([p, p], greedy(), use_tqdm=False)  # the 2nd shares the 1st's blocks
    assert llm.engine.blocks.num_cached_blocks == 0  # their K/V were never written
    assert llm.engine.blocks.allocator.num_free == llm.engine.blocks.num_blocks
    monkeypatch.setattr(llm.engine.runner, "run", real)
    assert ids(llm.generate([p, p], greedy(), use_tqdm=False)) == \
        ids(off.generate([p, p], greedy(), use_tqdm=False))


def test_eagle_and_harvested_features_after_hits_equal_recomputed(tiny_dir):
    """A prefix hit skips the target forward of the cached tokens; drafters that read target
    features (EAGLE, the training harvester) still get every position's, from the cache."""
    prompts = rand_prompts(2, lo=3 * BS + 2, hi=4 * BS, seed=15)
    reqs = [p for p in prompts for _ in range(3)]
    rollouts = {}
    for caching in (True, False):
        llm = make(tiny_dir, caching, {"method": "eagle", "model": "random",
                                       "num_speculative_tokens": 3})
        buf = HiddenBuffer()
        harvest(llm, buf)
        outs = [ids(llm.generate(reqs, greedy(), use_tqdm=False))]
        # copies admitted with the first one share its prefill (and its features)
        total = sum(map(len, prompts))
        assert llm.get_metrics()["prefix_cache_hit_tokens"] == caching * 2 * total
        outs.append(ids(llm.generate(reqs, greedy(), use_tqdm=False)))
        assert outs[0] == outs[1]
        m = llm.get_metrics()
        assert m["spec_steps"] > 0
        assert m["prefix_cache_hit_tokens"] == caching * (2 + 3) * total  # then all hit whole
        rollouts[caching] = (outs[0], sorted(buf.snapshot(), key=lambda r: r.token_ids))
        if caching:
            assert_baseline(llm)
            assert llm.engine.blocks.features is not None
    assert rollouts[True][0] == rollouts[False][0]
    on, off_ = rollouts[True][1], rollouts[False][1]
    assert len(on) == len(off_) == 2 * len(reqs)
    for a, b in zip(on, off_):
        assert a.token_ids == b.token_ids and a.hidden.shape == b.hidden.shape
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,offset", [(8, 0), (9, 0), (8, 1), (72, 0)])
def test_feature_store_write_in_one_call_equals_torch_indexing(dtype, width, offset,
                                                               monkeypatch):
    """``BlockFeatures.write`` through the extension (``store_rows``) stores the same rows
    and validity as torch's indexing (the path without it), converting the rows' dtype, and
    names a slot out of range: rows of whole 16-byte units from an aligned source (streaming
    stores on x86-64: 8 or 72 bf16 features), of 18 bytes (9 features), and bf16 rows read
    from a source one element off alignment (``offset``)."""
    import specengine.kv.block_features as bf
    assert hasattr(bf.ext(), "store_rows")  # the extension is built: its path is the one tested
    feats = torch.randn(5 * width + offset).to(dtype)[offset:].view(5, width)
    slots = [3, 17, 0, 31, 9]
    stores = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(bf, "ext", lambda: None)
        store = bf.BlockFeatures(2, 16, width, torch.bfloat16)
        store.write(slots, feats)
        stores.append(store)
    a, b = stores
    assert torch.equal(a.data, b.data) and torch.equal(a.valid, b.valid)
    assert a.valid.sum() == 5 and torch.equal(a.data[slots], feats.to(torch.bfloat16))
    assert not a.data[[s for s in range(32) if s not in slots]].any()  # nothing else written
    monkeypatch.undo()
    with pytest.raises(ValueError, match="out of range"):
        bf.BlockFeatures(2, 16, width, torch.bfloat16).write([32], feats[:1])
