"""`specengine generate` on a tiny random model with a real tokenizer."""

import json
import subprocess
import sys

import pytest

from specengine.cli import main


@pytest.fixture()
def records():
    return [
        {"id": "a", "prompt": "def add(a, b):", "extra": 1},
        "this line is not json",
        {"id": "b", "messages": [{"role": "user", "content": "Hi there"}]},
        {"id": "c"},
        {"id": "d", "prompt": ""},
        [1, 2, 3],
        {"id": "e", "messages": [{"role": "user"}]},
        {"id": "f", "prompt": "x " * 300},
        {"id": "g", "prompt": "Once upon a time"},
    ]


def write_input(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
        f.write("\n")  # blank lines are ignored


def test_generate_reports_bad_lines_and_completes_the_rest(tmp_path, tiny_llama_tok_dir, records,
                                                           capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, records)
    rc = main(["generate", "--model", str(tiny_llama_tok_dir), "--input", str(inp),
               "--output", str(out), "--max-tokens", "6", "--dtype", "float32",
               "--max-model-len", "256", "--n", "2", "--temperature", "1", "--no-progress"])
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == len(records)  # one output line per input line, in input order
    ok = {r["id"]: r for r in lines if "outputs" in r}
    assert set(ok) == {"a", "b", "g"}
    assert ok["a"]["extra"] == 1 and ok["a"]["prompt"] == "def add(a, b):"
    for r in ok.values():
        assert len(r["outputs"]) == 2
        assert all(len(o["token_ids"]) == 6 and o["finish_reason"] == "length"
                   for o in r["outputs"])
    errors = {r["line"]: r["error"] for r in lines if "error" in r}
    assert "invalid JSON" in errors[2]
    assert "needs a 'prompt' or 'messages'" in errors[4]
    assert "empty" in errors[5]
    assert "expected a JSON object" in errors[6]
    assert "'messages'" in errors[7]
    assert "max_model_len=256" in errors[8]
    printed = capsys.readouterr().out
    assert "requests: 3 ok, 6 failed" in printed and "tokens/s" in printed
    assert not (tmp_path / "out.jsonl.part").exists()


def test_generate_rejects_bad_arguments(tmp_path, capsys):
    assert main(["generate", "--input", str(tmp_path / "missing.jsonl"),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "i.jsonl").write_text('{"prompt": "x"}\n')
    assert main(["generate", "--input", str(tmp_path / "i.jsonl"),
                 "--output", str(tmp_path / "o.jsonl"), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--input", str(tmp_path / "i.jsonl"),  # before loading a model
                 "--output", str(tmp_path / "no" / "o.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--input", str(tmp_path), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err


def test_invalid_json_error_gives_the_column_in_the_line(tmp_path):
    from specengine.jsonl import read_records

    (tmp_path / "i.jsonl").write_text('{"prompt": "x"}\n{"prompt": "a", "n": 2\n')
    (_, rec, err), (no, bad, why) = read_records(str(tmp_path / "i.jsonl"))
    assert rec == {"prompt": "x"} and err is None
    assert no == 2 and bad is None
    # the missing "}" is just past the end of the line (with its newline parsed: "column 1")
    assert why.startswith("line 2: invalid JSON") and "column 23" in why


def test_unknown_model_alias_is_named(tmp_path):
    (tmp_path / "i.jsonl").write_text('{"prompt": "x"}\n')
    r = subprocess.run([sys.executable, "-m", "specengine", "generate", "--model", "no-such-model",
                        "--input", str(tmp_path / "i.jsonl"), "--output", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "no-such-model" in r.stderr
    assert not (tmp_path / "o").exists()


def test_generate_with_speculation_prints_acceptance(tmp_path, tiny_llama_tok_dir, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, [{"prompt": "a b c d a b c d a b c d"}])
    args = ["generate", "--model", str(tiny_llama_tok_dir), "--input", str(inp), "--output",
            str(out), "--max-tokens", "8", "--dtype", "float32", "--max-model-len", "256",
            "--no-progress"]
    assert main(args) == 0
    plain = json.loads(out.read_text())["outputs"][0]["token_ids"]
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "policy": "static"}'
    assert main(args + ["--speculative-config", spec]) == 0
    assert json.loads(out.read_text())["outputs"][0]["token_ids"] == plain
    assert "acceptance length" in capsys.readouterr().out
    assert main(args + ["--speculative-config", "{bad"]) == 2
    assert main(args + ["--speculative-config", '{"method": "nope"}']) == 2
