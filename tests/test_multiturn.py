"""Token-in/token-out multi-turn conversations (``specengine.multiturn``) with SmolLM2's ChatML
tokenizer: the ids equal the template's own rendering, generated ids are kept as sampled, and a
rollout through the engine continues from the exact ids."""

import pytest

from specengine import LLM, SamplingParams
from specengine.multiturn import Conversation

Q = [{"role": "user", "content": "What is 12 * 7? Use the calculator."}]


@pytest.fixture(scope="module")
def tok(tiny_llama_tok_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama_tok_dir)


def rendered(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def test_turns_equal_the_templates_rendering(tok):
    conv = Conversation.start(tok, Q)
    assert conv.token_ids == rendered(tok, Q)
    reply = tok("CALC 12*7", add_special_tokens=False).input_ids + [tok.eos_token_id]
    conv.add_response(reply, [3] * len(reply))
    added = conv.add_messages([{"role": "tool", "content": "84"}])
    full = Q + [{"role": "assistant", "content": "CALC 12*7"},
                {"role": "tool", "content": "84"}]
    assert conv.token_ids == rendered(tok, full)
    assert tok.decode(added).startswith("\n<|im_start|>tool")  # the separator is kept
    assert conv.loss_mask == [0] * len(rendered(tok, Q)) + [1] * len(reply) + [0] * len(added)
    assert conv.weight_versions.count(3) == len(reply)


def test_a_response_cut_by_length_gets_its_end_token(tok):
    conv = Conversation.start(tok, Q)
    conv.add_response(tok("CALC 12", add_special_tokens=False).input_ids)  # no end token
    conv.add_messages([{"role": "user", "content": "go on"}])
    assert conv.token_ids == rendered(tok, Q + [{"role": "assistant", "content": "CALC 12"},
                                                {"role": "user", "content": "go on"}])


def test_sampled_ids_are_never_retokenized(tok, tiny_llama_tok_dir):
    """A sampled response whose ids are not what tokenizing its text gives is kept as
    sampled; the next turn continues from those exact ids."""
    llm = LLM(str(tiny_llama_tok_dir), dtype="float32", kv_cache_memory_bytes=16 << 20,
              max_model_len=512)
    conv = Conversation.start(tok, Q)
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=20)
    for turn in range(2):
        out = llm.generate([{"prompt_token_ids": conv.token_ids}], sp, use_tqdm=False)[0]
        c = out.outputs[0]
        before = list(conv.token_ids)
        conv.add_response(c.token_ids, c.weight_versions)
        assert conv.token_ids[:len(before)] == before
        assert conv.token_ids[len(before):] == list(c.token_ids)
        conv.add_messages([{"role": "tool", "content": str(turn)}])
    assert sum(conv.loss_mask) > 0


def test_errors(tok):
    conv = Conversation.start(tok, Q)
    with pytest.raises(ValueError, match="follows a response"):
        conv.add_messages([{"role": "tool", "content": "1"}])
    with pytest.raises(ValueError, match="weight_versions"):
        conv.add_response([1, 2], [0])
