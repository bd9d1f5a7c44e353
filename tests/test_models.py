"""Our Llama/Qwen2 decoder against transformers' modeling code on the same weights, through a
real paged KV cache with packed prefill chunks and decode tokens."""

import pytest
import torch

from specengine.attention.base import AttentionMetadata
from specengine.attention.torch_ref import TorchAttention
from specengine.models.config import ModelConfig
from specengine.models.llama import LlamaForCausalLM, rope_inv_freq
from specengine.models.loader import load_model, random_hf_state_dict, save_random_model


class PagedRun:
    """Paged KV cache for a few sequences with scattered blocks; feeds packed steps."""

    def __init__(self, model, n_seqs, block_size=4, blocks_per_seq=8, seed=0):
        c = model.config
        n_blocks = n_seqs * blocks_per_seq
        shape = (n_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                   for _ in range(c.num_hidden_layers)]
        perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_tables = perm.view(n_seqs, blocks_per_seq).to(torch.int32)
        self.model, self.bs, self.lens = model, block_size, [0] * n_seqs

    def step(self, chunks):
        """chunks: list of (seq, token list) packed into one forward -> logits [T, V]."""
        ids, pos, seq = [], [], []
        for s, toks in chunks:
            for t in toks:
                ids.append(t)
                pos.append(self.lens[s])
                seq.append(s)
                self.lens[s] += 1
        pos, seq_t = torch.tensor(pos), torch.tensor(seq, dtype=torch.int32)
        blocks = self.block_tables[seq_t.long(), pos // self.bs].long()
        meta = AttentionMetadata(slot_mapping=blocks * self.bs + pos % self.bs,
                                 block_tables=self.block_tables, query_seq=seq_t,
                                 kv_lens=(pos + 1).to(torch.int32), max_kv_len=int(pos.max()) + 1)
        hidden = self.model(torch.tensor(ids), pos, self.kv, meta, TorchAttention())
        assert hidden.shape == (len(ids), self.model.config.hidden_size)
        assert hidden.dtype == self.model.dtype
        return self.model.compute_logits(hidden)


def hf_logits(model_dir, tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def check_against_hf(model_dir, vocab, atol=1e-4):
    """Two sequences: chunked prefill packed with the other's prefill, then packed decodes."""
    model = load_model(model_dir, dtype=torch.float32).model
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(vocab, (10,), generator=g).tolist(),
            torch.randint(vocab, (8,), generator=g).tolist()]
    run = PagedRun(model, 2)
    out = [[], []]
    # step 1: seq0 prefill chunk (4 tokens) + seq1 full prefill (5 tokens)
    logits = run.step([(0, toks[0][:4]), (1, toks[1][:5])])
    out[0].append(logits[:4])
    out[1].append(logits[4:])
    # step 2: rest of seq0's prompt (3 tokens) + one decode token of seq1
    logits = run.step([(0, toks[0][4:7]), (1, toks[1][5:6])])
    out[0].append(logits[:3])
    out[1].append(logits[3:])
    for i in range(2):  # steps 3, 4: one decode token each, seq1 first
        logits = run.step([(1, [toks[1][6 + i]]), (0, [toks[0][7 + i]])])
        out[1].append(logits[:1])
        out[0].append(logits[1:])
    for s, n in ((0, 9), (1, 8)):
        ours = torch.cat(out[s])
        ref = hf_logits(model_dir, toks[s][:n])
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("overrides", [
    {},
    {"model_type": "qwen2"},
    {"attention_bias": True, "tie_word_embeddings": True},  # llama with o_proj bias
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
     "rope_theta": 500.0},
], ids=["llama", "qwen2", "llama_bias_tied", "llama3_rope"])
def test_logits_equal_transformers(tmp_path, overrides):
    model_dir = save_random_model(tmp_path, overrides, seed=3)
    check_against_hf(model_dir, 512)


def test_fixture_dirs_equal_transformers(tiny_llama_dir, tiny_qwen2_dir):
    check_against_hf(tiny_llama_dir, 512)
    check_against_hf(tiny_qwen2_dir, 512)


def test_llama3_inv_freq_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_theta=500000.0,
                     rope_scaling=rope, max_position_embeddings=131072)
    ours = rope_inv_freq(ModelConfig.from_hf({**hf.to_dict(), "architectures":
                                              ["LlamaForCausalLM"]}))
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert torch.equal(ours, ref)


def test_tied_model_shares_embedding_and_lm_head(tmp_path):
    lm = load_model(save_random_model(tmp_path, {"tie_word_embeddings": True}),
                    dtype=torch.float32)
    assert lm.model.lm_head is lm.model.embed_tokens
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(lm.model.compute_logits(hidden), hidden @ lm.model.embed_tokens.T,
                               atol=1e-5, rtol=1e-5)


def test_bfloat16_model_close_to_float32(tiny_llama_dir):
    m32 = load_model(tiny_llama_dir, dtype=torch.float32).model
    m16 = load_model(tiny_llama_dir, dtype=torch.bfloat16).model
    assert m16.dtype == torch.bfloat16 and m16.layers[0].qkv_proj.dtype == torch.bfloat16
    toks = list(range(3, 40, 3))
    l32, l16 = PagedRun(m32, 1).step([(0, toks)]), PagedRun(m16, 1).step([(0, toks)])
    assert l16.dtype == torch.float32
    # bf16 rounding moves logits (std about 2) by a few hundredths, far below the argmax gaps
    assert (l32 - l16).abs().max() < 0.25
    assert (l32.argmax(-1) == l16.argmax(-1)).sum() >= len(toks) - 1


def test_fused_weights_are_concatenations(tiny_qwen2_dir):
    from safetensors.torch import load_file

    sd = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    layer = load_model(tiny_qwen2_dir, dtype=torch.float32).model.layers[1]
    p = "model.layers.1."
    qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(layer.qkv_proj, qkv)
    assert torch.equal(layer.qkv_bias, torch.cat([sd[p + f"self_attn.{n}_proj.bias"]
                                                  for n in "qkv"]))
    assert torch.equal(layer.gate_up_proj, torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                      sd[p + "mlp.up_proj.weight"]]))
    assert layer.o_bias is None


def _tiny_config(**kw):
    return ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32,
                                "hidden_size": 16, "intermediate_size": 32,
                                "num_hidden_layers": 1, "num_attention_heads": 2,
                                "num_key_value_heads": 1, **kw})


def test_load_weights_errors():
    config = _tiny_config()
    sd = random_hf_state_dict(config)
    model = LlamaForCausalLM(config)
    extra = "model.layers.0.self_attn.q_proj.bias"
    with pytest.raises(ValueError, match=f"unexpected weight '{extra}'"):
        model.load_weights([*sd.items(), (extra, torch.zeros(16))])
    bad = dict(sd, **{"model.norm.weight": torch.ones(17)})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(17,\), expected"):
        model.load_weights(bad.items())
    del sd["lm_head.weight"]
    with pytest.raises(ValueError, match="1 weights missing.*lm_head.weight"):
        model.load_weights(sd.items())


def test_forward_checks_kv_cache_count():
    model = LlamaForCausalLM(_tiny_config())
    meta = AttentionMetadata(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="kv_caches has 0 entries, the model has 1 layers"):
        model(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), [], meta,
              TorchAttention())


def test_param_stamp_sees_each_change_in_one_call(monkeypatch):
    """``_param_stamp`` (the extension's ``param_stamps``: one call over every layer's
    parameters) gives what the Python loop gives (id, data pointer, version; absent: zeros /
    None), and changes with an in-place op, a replaced parameter and a new storage."""
    from specengine.models import llama
    from specengine.ops.extension import ext

    model = LlamaForCausalLM(_tiny_config())
    if ext() is None or not hasattr(ext(), "param_stamps"):
        pytest.skip("the C++ extension is not built")
    got = model._param_stamp()
    monkeypatch.setattr(llama, "ext", lambda: None)
    want = model._param_stamp()
    monkeypatch.undo()
    assert got.shape == (len(want), 3)
    for row, w in zip(got.tolist(), want):
        assert row == (list(w) if w is not None else [0, 0, 0])
    layer = model.layers[0]
    changes = [lambda: layer.o_proj.requires_grad_(False).mul_(2),  # in place: version
               lambda: setattr(layer, "o_proj", torch.nn.Parameter(  # replaced: id
                   layer.o_proj.detach().clone(), requires_grad=False)),
               lambda: setattr(layer.o_proj, "data", layer.o_proj.detach().clone())]  # storage
    for i, change in enumerate(changes):
        before = model._param_stamp()
        change()
        assert not llama._same_stamp(before, model._param_stamp()), i
    assert llama._same_stamp(model._param_stamp(), model._param_stamp())
    with torch.inference_mode():
        inf = torch.zeros(2)
    assert ext().param_stamps([{"w": inf}], ["w"])[0, 2] == -1  # no version counter
    with pytest.raises(TypeError, match="dicts must hold dicts"):
        ext().param_stamps([[1]], ["w"])
    with pytest.raises(TypeError, match="neither a tensor nor None"):
        ext().param_stamps([{"w": 1}], ["w"])


@pytest.mark.integration
def test_smollm2_logits_equal_transformers(default_model_dir):
    lm = load_model(default_model_dir, dtype=torch.float32)
    toks = lm.tokenizer("def fibonacci(n):\n    if n < 2:\n        return n").input_ids
    run = PagedRun(lm.model, 1, block_size=16, blocks_per_seq=4)
    ours = torch.cat([run.step([(0, toks[:9])]), run.step([(0, toks[9:])])])
    ref = hf_logits(default_model_dir, toks)
    torch.testing.assert_close(ours, ref, atol=5e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kept_decoder_weights_follow_every_kind_of_weight_change(tiny_qwen2_dir, dtype):
    """``LlamaForCausalLM._decoder_weights`` keeps ``decoder_forward``'s argument list between
    steps and must rebuild it whenever a weight changes: in place (a packed weight and a
    bias), by replacing a parameter, and after ``drop_packed`` (sleep). After each change the
    engine's greedy tokens and logprobs equal, bit for bit, those of an engine that applied
    the same change before its first forward (packing fresh)."""
    from specengine import LLM, SamplingParams
    from specengine.ops import kernels
    from specengine.ops.extension import ext

    if ext() is None or not hasattr(ext(), "decoder_forward"):
        pytest.skip("the C++ extension is not built")
    if not kernels.packed_covers(1):  # e.g. SPECENGINE_ISA=generic: the torch layer loop runs
        pytest.skip("no packed kernels under this instruction-set cap: no decoder_forward")
    prompts = [{"prompt_token_ids": [5, 9, 13, 2, 7, 30, 11]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=3)
    changes = [
        lambda m: m.layers[0].o_proj.mul_(-1),  # in place, a packed weight
        lambda m: m.layers[1].qkv_bias.add_(0.5),  # in place, a bias
        lambda m: setattr(m.layers[1], "down_proj",  # replaced
                          torch.nn.Parameter(m.layers[1].down_proj.detach().flip(0),
                                             requires_grad=False)),
        lambda m: m.drop_packed(),
    ]

    def run(llm):
        out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [{k: v.logprob for k, v in lp.items()} for lp in out.logprobs]

    def engine():
        return LLM(str(tiny_qwen2_dir), dtype=dtype, kv_cache_memory_bytes=8 << 20,
                   block_size=8, enable_prefix_caching=False)

    kept = engine()
    model = kept.engine.model
    seen = [run(kept)]
    args = model._decoder_kept
    assert args is not None  # the extension path ran and kept its arguments
    run(kept)
    assert model._decoder_kept[3] is args[3]  # reused while nothing changed
    for i, change in enumerate(changes):
        change(model)
        got = run(kept)
        fresh = engine()
        for c in changes[:i + 1]:
            c(fresh.engine.model)
        assert got == run(fresh), i
        seen.append(got)
        del fresh
    assert len({str(s) for s in seen}) >= 4  # the changes did change the outputs
