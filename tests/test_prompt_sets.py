"""Tests of specengine.data.prompt_sets: HumanEval and GSM loaders (small downloads), the
incremental JSON array reader on synthetic files, and ShareGPT (125 MB download: marked
integration)."""

import json
import sys
import warnings

import pytest

from specengine.data import prompt_sets

# ---------------------------------------------------------------- HumanEval


def test_humaneval_all_and_limit():
    problems = prompt_sets.humaneval_prompts()
    assert len(problems) == 164
    assert [p["task_id"] for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
    for p in problems:
        assert set(p) == {"task_id", "prompt", "entry_point", "canonical_solution", "test"}
        assert f"def {p['entry_point']}" in p["prompt"]
    assert prompt_sets.humaneval_prompts(limit=3) == problems[:3]
    assert prompt_sets.humaneval_prompts(limit=0) == []


@pytest.mark.parametrize("limit", [-1, 2.5, "3", True])
def test_humaneval_bad_limit(limit):
    with pytest.raises(ValueError, match="limit"):
        prompt_sets.humaneval_prompts(limit=limit)


# ---------------------------------------------------------------- GSM


def test_gsm_fields_and_answers():
    qs = prompt_sets.gsm_questions(40, seed=0)
    assert len(qs) == 40
    for q in qs:
        assert set(q) == {"question", "answer", "answer_cot", "generator"}
        assert q["question"].strip() and q["answer"]
        cot_answer = q["answer_cot"].rstrip().rsplit("#### ", 1)[1]  # e.g. "15.0" for "15"
        assert float(cot_answer.replace(",", "")) == float(q["answer"])
        n = int(q["generator"].removeprefix("generate_"))
        assert 0 <= n < 100 and n not in prompt_sets.GSM_SKIPPED_GENERATORS
    # round-robin: the first 40 questions come from 40 different generators
    assert len({q["generator"] for q in qs}) == 40


def test_gsm_deterministic_and_prefix_stable():
    a = prompt_sets.gsm_questions(12, seed=3)
    assert a == prompt_sets.gsm_questions(12, seed=3)
    assert prompt_sets.gsm_questions(5, seed=3) == a[:5]
    assert a != prompt_sets.gsm_questions(12, seed=4)
    assert prompt_sets.gsm_questions(0) == []


def test_gsm_leaves_sys_modules_alone():
    had = "reasoning_gym" in sys.modules
    prompt_sets._gsm_generators()
    assert ("reasoning_gym" in sys.modules) == had
    assert len(prompt_sets._gsm_generators()) == 100


@pytest.mark.parametrize("kwargs", [{"n": -1}, {"n": 1.0}, {"n": 2, "difficulty": 0.5},
                                    {"n": 2, "difficulty": 9.0}, {"n": 2, "difficulty": "1"}])
def test_gsm_bad_input(kwargs):
    with pytest.raises(ValueError, match="n|difficulty"):
        prompt_sets.gsm_questions(**kwargs)


def _fake_generator(k):
    def generate(rng, difficulty):
        x = rng.randint(1, 100)
        return {"question": f"q{k} {x}?", "answer": str(x),
                "metadata": {"answer_cot": f"so\n#### {x}"}}
    return generate


def _broken_generator(rng, difficulty):
    rng.random()
    raise ValueError("empty range")


def test_gsm_skips_failing_generator_deterministically(monkeypatch):
    gens = {0: _fake_generator(0), 1: _broken_generator, 2: _fake_generator(2)}
    monkeypatch.setattr(prompt_sets, "_gsm_generators", lambda: gens)
    with pytest.warns(RuntimeWarning, match="generate_1 failed"):
        a = prompt_sets.gsm_questions(6, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert prompt_sets.gsm_questions(6, seed=1) == a
    assert len(a) == 6 and {q["generator"] for q in a} == {"generate_0", "generate_2"}


def test_gsm_all_generators_failing(monkeypatch):
    monkeypatch.setattr(prompt_sets, "_gsm_generators", lambda: {0: _broken_generator})
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="failed in a row"):
        prompt_sets.gsm_questions(1)


# ---------------------------------------------------------------- incremental JSON reader

ELEMENTS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi \"there\" \\ \u00e9\u4e2d"}]},
    {"id": "b", "n": [1, -2.5e3, True, False, None], "s": "line\nbreak \\u0041"},
    {},
    {"id": "c", "nested": {"x": [[], {}], "y": "]}[{,"}},
]


def _write(tmp_path, text, name="a.json"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("chunk_chars", [1, 7, 1 << 20])
def test_iter_json_array_complete(tmp_path, chunk_chars):
    path = _write(tmp_path, json.dumps(ELEMENTS, indent=2, ensure_ascii=False))
    assert list(prompt_sets._iter_json_array(path, chunk_chars)) == ELEMENTS
    empty = _write(tmp_path, " [ ] ", "e.json")
    assert list(prompt_sets._iter_json_array(empty, chunk_chars)) == []


@pytest.mark.parametrize("chunk_chars, ensure_ascii", [(5, True), (1 << 20, False)])
def test_iter_json_array_truncated_at_every_point(tmp_path, chunk_chars, ensure_ascii):
    text = json.dumps(ELEMENTS, indent=1, ensure_ascii=ensure_ascii)
    # where each element's text ends
    ends, pos = [], text.index("[") + 1
    for _ in ELEMENTS:
        _, pos = json.JSONDecoder().raw_decode(text, text.index("{", pos))
        ends.append(pos)
    for cut in range(text.index("[") + 1, len(text)):
        path = _write(tmp_path, text[:cut])
        got = list(prompt_sets._iter_json_array(path, chunk_chars))
        assert got == ELEMENTS[:sum(end <= cut for end in ends)], (cut, text[:cut][-20:])


def test_iter_json_array_is_lazy(tmp_path):
    # a malformed tail far away is never read when only the first element is taken
    path = _write(tmp_path, '[{"a": 1},' + " " * 100_000 + "{bad")
    assert next(prompt_sets._iter_json_array(path, chunk_chars=1000)) == {"a": 1}


@pytest.mark.parametrize("text", ['{"a": 1}', "", '[{"a": 1}, {bad json here}, {"b": 2}]'])
def test_iter_json_array_bad_input(tmp_path, text):
    with pytest.raises(ValueError, match="JSON"):
        list(prompt_sets._iter_json_array(_write(tmp_path, text)))


# ---------------------------------------------------------------- ShareGPT (synthetic file)


def _fake_sharegpt(tmp_path, monkeypatch, max_index=4):
    records = [
        {"id": "r0", "conversations": [{"from": "human", "value": "q0"},
                                        {"from": "gpt", "value": "a0"}]},
        {"id": "r1", "conversations": [{"from": "gpt", "value": "cont"},
                                        {"from": "human", "value": "q1"},
                                        {"from": "bard", "value": "a1"}]},
        {"id": "r2", "conversations": []},
        {"id": "r3", "conversations": [{"from": "system", "value": "sys"},
                                        {"from": "human", "value": "x" * 3000}]},
        {"id": "r4", "conversations": [{"from": "human", "value": "reserved"}]},
    ]
    text = json.dumps(records, indent=2)
    path = _write(tmp_path, text[: len(text) - 30], "sharegpt.json")  # truncated in r4
    monkeypatch.setattr(prompt_sets, "prompt_file", lambda name: path)
    monkeypatch.setattr(prompt_sets, "SHAREGPT_MAX_INDEX", max_index)


def test_sharegpt_mapping_and_limits(tmp_path, monkeypatch):
    _fake_sharegpt(tmp_path, monkeypatch)
    convs = prompt_sets.sharegpt_conversations(3)
    assert [(c["id"], c["index"]) for c in convs] == [("r0", 0), ("r1", 1), ("r3", 3)]
    assert convs[0]["messages"] == [{"role": "user", "content": "q0"},
                                    {"role": "assistant", "content": "a0"}]
    assert [m["role"] for m in convs[1]["messages"]] == ["user", "assistant"]
    assert [m["role"] for m in convs[2]["messages"]] == ["system", "user"]
    assert prompt_sets.sharegpt_conversations(1, start=1)[0]["id"] == "r1"
    with pytest.raises(ValueError, match="reserved"):
        prompt_sets.sharegpt_conversations(1, start=4)
    with pytest.raises(ValueError, match="reserved"):
        prompt_sets.sharegpt_conversations(5)
    with pytest.raises(ValueError, match="only 3 usable"):
        prompt_sets.sharegpt_conversations(4)
    with pytest.raises(ValueError, match="start"):
        prompt_sets.sharegpt_conversations(1, start=-1)


def test_chat_prompts_skips_long_and_empty(tmp_path, monkeypatch):
    _fake_sharegpt(tmp_path, monkeypatch)
    assert prompt_sets.chat_prompts(2) == [[{"role": "user", "content": "q0"}],
                                    [{"role": "user", "content": "q1"}]]
    with pytest.raises(ValueError, match="only 2"):
        prompt_sets.chat_prompts(3)
    assert len(prompt_sets.chat_prompts(3, max_chars=5000)) == 3
    assert prompt_sets.chat_prompts(1, start=1) == [[{"role": "user", "content": "q1"}]]


def test_sharegpt_truncated_file_read_past_limit(tmp_path, monkeypatch):
    # with the limit above the record count, the truncated last record is simply absent
    _fake_sharegpt(tmp_path, monkeypatch, max_index=100)
    assert [c["id"] for c in prompt_sets.sharegpt_conversations(3)] == ["r0", "r1", "r3"]
    with pytest.raises(ValueError, match="only 3 usable"):
        prompt_sets.sharegpt_conversations(4)


# ---------------------------------------------------------------- ShareGPT (real file)


@pytest.mark.integration
def test_sharegpt_real():
    convs = prompt_sets.sharegpt_conversations(50)
    assert len(convs) == 50 and len({c["id"] for c in convs}) == 50
    assert convs == prompt_sets.sharegpt_conversations(50)
    for c in convs:
        assert c["index"] < prompt_sets.SHAREGPT_MAX_INDEX
        assert c["messages"][0]["role"] in ("user", "system")
        assert {m["role"] for m in c["messages"]} <= {"system", "user", "assistant"}
        assert all(isinstance(m["content"], str) for m in c["messages"])
    later = prompt_sets.sharegpt_conversations(5, start=convs[10]["index"])
    assert later[0] == convs[10]
    with pytest.raises(ValueError, match="reserved"):
        prompt_sets.sharegpt_conversations(10, start=prompt_sets.SHAREGPT_MAX_INDEX - 5)
    prompts = prompt_sets.chat_prompts(30)
    assert len(prompts) == 30
    for p in prompts:
        assert len(p) == 1 and p[0]["role"] == "user"
        assert p[0]["content"].strip() and len(p[0]["content"]) <= 2000
