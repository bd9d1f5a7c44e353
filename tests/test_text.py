"""Text-level semantics (stop strings, chat, detokenization) with a real tokenizer on a tiny
random-weight model."""

import pytest

from specengine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_tok_dir):
    return LLM(str(tiny_llama_tok_dir), dtype="float32", kv_cache_memory_bytes=16 << 20)


def greedy(n=40, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_text_is_the_decoded_tokens(llm):
    out = llm.generate(["The capital of France is"], greedy(), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt == "The capital of France is"
    assert out.prompt_token_ids == tok("The capital of France is").input_ids
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_like_vllm(llm, include):
    tok = llm.get_tokenizer()
    prompt = "Once upon a time"
    full = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    assert stop.strip()
    at = text.find(stop)
    out = llm.generate([prompt], greedy(stop=[stop], include_stop_str_in_output=include),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == (text[:at + len(stop)] if include else text[:at])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # token_ids end with the token that completed the stop string
    n = len(out.token_ids)
    assert out.token_ids == full.token_ids[:n]
    assert stop in tok.decode(full.token_ids[:n], skip_special_tokens=True)
    assert stop not in tok.decode(full.token_ids[:n - 1], skip_special_tokens=True)


def test_stop_token_text_excluded_unless_requested(llm):
    tok = llm.get_tokenizer()
    full = llm.generate(["Hello there"], greedy(20), use_tqdm=False)[0].outputs[0]
    stop_tok = full.token_ids[5]
    k = full.token_ids.index(stop_tok)
    out = llm.generate(["Hello there"], greedy(20, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:k + 1]
    assert out.text == tok.decode(full.token_ids[:k], skip_special_tokens=True)
    out = llm.generate(["Hello there"], greedy(20, stop_token_ids=[stop_tok],
                                                include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == tok.decode(full.token_ids[:k + 1], skip_special_tokens=True)


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(msgs, greedy(5), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.prompt == want
    assert out.prompt_token_ids == tok(want, add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="conversation 0"):
        llm.chat([{"role": "user"}], greedy(5), use_tqdm=False)
