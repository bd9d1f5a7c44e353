"""``examples/agent_calculator.py``: the calculator, and the token-in/token-out agent loop
against a real in-process server (tiny random model with SmolLM2's tokenizer)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import agent_calculator as agent  # noqa: E402

from specengine import LLM, SamplingParams  # noqa: E402


def test_calculator():
    assert agent.calculate("12*7") == "84"
    assert agent.calculate(" (3 + 4) / 2 ") == "3.5"
    assert agent.calculate("-2**3 % 5") == "2"
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "1/0", "", "[1]"):
        assert agent.calculate(bad).startswith("error")
    assert agent.reward("so Answer: 1,234", "1234") == 1.0
    assert agent.reward("Answer: 12", "13") == 0.0 and agent.reward("none", "1") == 0.0


def test_episode_calls_the_tool_and_keeps_ids(tiny_llama_tok_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_llama_tok_dir)
    replies = iter(["Let me compute <calc>12*7</calc>", "Answer: 84"])

    def generate(ids):
        text = next(replies)
        tids = tok(text, add_special_tokens=False).input_ids + (
            [tok.eos_token_id] if "Answer" in text else [])
        return {"token_ids": tids, "text": text,
                "logprobs": {"token_logprobs": [-0.5] * len(tids)}}

    ep = agent.episode(tok, "What is 12*7?", generate)
    assert ep["tool_calls"] == 1 and ep["turns"] == 2 and ep["final_text"] == "Answer: 84"
    assert len(ep["token_ids"]) == len(ep["loss_mask"]) == len(ep["logprobs"])
    assert "84" in tok.decode([t for t, m in zip(ep["token_ids"], ep["loss_mask"]) if not m])
    assert sum(lp != 0.0 for lp in ep["logprobs"]) == sum(ep["loss_mask"])


def test_episode_through_the_server(tiny_llama_tok_dir):
    from test_server import Server
    from transformers import AutoTokenizer

    from specengine.server.app import build_app

    tok = AutoTokenizer.from_pretrained(tiny_llama_tok_dir)
    llm = LLM(str(tiny_llama_tok_dir), dtype="float32", kv_cache_memory_bytes=16 << 20,
              max_model_len=512)
    ref = LLM(str(tiny_llama_tok_dir), dtype="float32", kv_cache_memory_bytes=16 << 20,
              max_model_len=512)
    params = {"model": "tiny", "max_tokens": 12, "temperature": 1.0, "seed": 5}
    with Server(build_app(llm, "tiny")) as s:
        ep = agent.episode(tok, "What is 2+2?", lambda ids: agent.complete(s.url, ids, params),
                           max_turns=2)
    # the sampled ids are exactly what the engine samples from those prompt ids
    prompt_len = ep["loss_mask"].index(1)
    want = ref.generate([{"prompt_token_ids": ep["token_ids"][:prompt_len]}], SamplingParams(
        max_tokens=12, temperature=1.0, seed=5, stop=["</calc>"],
        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0].token_ids
    got = ep["token_ids"][prompt_len:prompt_len + len(want)]
    assert got == list(want)
