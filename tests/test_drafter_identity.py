"""Drafters found by what the target is (tokenizer, architecture, weight sketch), not by the
path it was loaded from: the shipped EAGLE drafter via the alias, a renamed directory and the
GGUF file; other models refused with the reason."""

import pytest
import torch

from specengine import LLM, SamplingParams
from specengine.models.loader import load_model, save_random_model
from specengine.models.registry import DEFAULT_MODEL, fetch_gguf
from specengine.speculative.drafters.eagle import (
    match_target,
    shipped_drafter,
    shipped_drafters,
    target_identity,
)
from specengine.speculative.drafters.eagle.identity import SKETCH_COSINE, sketch_cosine


def q4_1(w: torch.Tensor) -> torch.Tensor:
    """Round-trip through llama.cpp-style Q4_1: blocks of 32 along rows, 4-bit codes with a
    per-block minimum and scale."""
    x = w.float().reshape(-1, 32)
    lo, hi = x.min(1, keepdim=True).values, x.max(1, keepdim=True).values
    d = (hi - lo).clamp_min(1e-12) / 15
    return (((x - lo) / d).round().clamp(0, 15) * d + lo).reshape(w.shape)


def test_identity_survives_dtype_and_4bit_quantization(tiny_llama_dir):
    ref = target_identity(load_model(tiny_llama_dir, dtype=torch.float32))
    bf16 = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    assert match_target(ref, target_identity(bf16)) is None
    quant = load_model(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        quant.model.embed_tokens.copy_(q4_1(quant.model.embed_tokens))
        for layer in quant.model.layers:
            for name in ("o_proj", "down_proj", "qkv_proj", "gate_up_proj"):
                p = getattr(layer, name)
                p.copy_(q4_1(p))
    got = target_identity(quant)
    assert match_target(ref, got) is None
    for name, sk in ref["weight_sketch"].items():
        assert 0.99 < sketch_cosine(sk, got["weight_sketch"][name]) < 1.0  # close, not equal


def test_other_models_do_not_match(tiny_llama_dir, tmp_path):
    ref = target_identity(load_model(tiny_llama_dir, dtype=torch.float32))
    # same architecture and (absent) tokenizer, other weights: the sketch tells them apart
    other = target_identity(load_model(save_random_model(tmp_path / "s", seed=7), torch.float32))
    why = match_target(ref, other)
    assert why is not None and why.startswith("weights differ")
    assert all(abs(sketch_cosine(a, other["weight_sketch"][k])) < SKETCH_COSINE
               for k, a in ref["weight_sketch"].items())
    deeper = target_identity(load_model(
        save_random_model(tmp_path / "d", {"num_hidden_layers": 4}), torch.float32))
    assert match_target(ref, deeper) == "architecture config differs"
    # an older drafter without a fingerprint: by name only
    assert match_target({"name": ref["name"]}, ref) is None
    assert "no fingerprint" in match_target({"name": "x"}, ref)


@pytest.fixture(scope="module")
def gguf_path():
    return fetch_gguf(DEFAULT_MODEL)  # cached with the default model


@pytest.mark.parametrize("how", ["alias", "renamed_dir", "gguf"])
def test_shipped_drafter_found_from_any_path(how, default_model_dir, gguf_path, tmp_path):
    if how == "alias":
        src = DEFAULT_MODEL
    elif how == "renamed_dir":
        src = tmp_path / "my-policy-checkpoint"
        src.symlink_to(default_model_dir, target_is_directory=True)
    else:
        src = gguf_path
    target = load_model(src, dtype=torch.bfloat16)
    if how != "alias":
        assert target.model_dir.name != DEFAULT_MODEL
    found = shipped_drafter(target)
    assert found is not None and found.name == DEFAULT_MODEL
    assert (found / "model.safetensors").is_file()


def test_shipped_drafter_drafts_for_the_gguf_path(gguf_path):
    llm = LLM(str(gguf_path), dtype="bfloat16", kv_cache_memory_bytes=16 << 20,
              speculative_config={"method": "eagle", "policy": "static",
                                  "num_speculative_tokens": 2})
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert llm.get_metrics()["spec_steps"] > 0


def test_placeholder_weights_match_on_tokenizer_and_config(default_model_dir, tiny_llama_dir):
    """``load_format="dummy"`` (RL frameworks load random weights, then push the real ones):
    the weights say nothing yet, so tokenizer and architecture decide."""
    target = load_model(default_model_dir, dtype=torch.bfloat16, dummy=True)
    assert target.dummy and target_identity(target)["weight_sketch"] is None
    assert shipped_drafter(target) is not None
    tiny = load_model(tiny_llama_dir, dtype=torch.float32, dummy=True)
    assert shipped_drafter(tiny) is None


def test_a_different_model_is_refused_with_the_reason(tiny_llama_tok_dir):
    """SmolLM2's tokenizer but random tiny weights: no shipped drafter, and the message says
    which check failed."""
    target = load_model(tiny_llama_tok_dir, dtype=torch.float32)
    found, why = shipped_drafters(target)
    assert found is None and why[DEFAULT_MODEL].startswith("hidden_size 64")
    with pytest.raises(ValueError, match=r"no drafter is shipped for target .*"
                                         r"smollm2-135m-instruct: hidden_size 64 != 576"):
        LLM(str(tiny_llama_tok_dir), dtype="float32", kv_cache_memory_bytes=8 << 20,
            speculative_config={"method": "eagle"})
