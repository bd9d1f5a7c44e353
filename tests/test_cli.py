"""`specengine generate` on a tiny random model with a real tokenizer: bad lines, resume after
Ctrl-C or a kill, refusal to overwrite."""

import json
import shutil
import subprocess
import sys

import pytest

from specengine.api import LLM
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


def test_version_prints_and_exits_0(capsys):
    from specengine import __version__
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"specengine {__version__}"


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
    from specengine.data.jsonl import read_records

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
    assert main(args + ["--speculative-config", spec, "--overwrite"]) == 0
    assert json.loads(out.read_text())["outputs"][0]["token_ids"] == plain
    assert "acceptance length" in capsys.readouterr().out
    assert main(args + ["--speculative-config", "{bad", "--overwrite"]) == 2
    assert main(args + ["--speculative-config", '{"method": "nope"}', "--overwrite"]) == 2


# ---- bad lines of every kind, resume, overwrite ------------------------------------------------

@pytest.fixture(scope="module")
def strict_template_dir(tmp_path_factory, tiny_llama_tok_dir):
    """``tiny_llama_tok_dir`` with a chat template that raises (as many real templates do) for a
    role other than system / user / assistant."""
    d = tmp_path_factory.mktemp("strict_template") / "model"
    shutil.copytree(tiny_llama_tok_dir, d)
    jinja = d / "chat_template.jinja"
    jinja.write_text("{% for m in messages %}{% if m['role'] not in ['system', 'user', "
                     "'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
                     "{% endif %}{% endfor %}" + jinja.read_text())
    return d


GOOD = [
    {"id": "a", "prompt": "def add(a, b):", "extra": {"k": [1, 2]}},
    {"id": 7, "messages": [{"role": "user", "content": "Hi there"}]},
    {"id": "c", "prompt_token_ids": [1, 2, 3, 4, 5]},
    {"prompt": "Once upon a time"},  # no id: matched by line number
]

BAD = [  # (raw line, what its error says)
    (b"this line is not json", "invalid JSON"),
    (b'{"id": "u", "prompt": "caf\xe9"}', "not valid UTF-8"),
    (b'{"id": "s", "prompt": "x \\ud800 y"}', "'prompt' is not valid Unicode"),
    (b'{"id": "s2", "messages": [{"role": "user", "content": "\\udfff"}]}',
     "'messages[0].content' is not valid Unicode"),
    (b'{"id": "nan", "prompt": NaN}', "NaN is not a JSON value"),
    (b"[1, 2, 3]", "expected a JSON object"),
    (b'{"id": "m"}', "needs a 'prompt' or 'messages'"),
    (b'{"id": "t", "prompt": 5}', "'prompt' must be a string"),
    (b'{"id": "mt", "messages": "hi"}', "'messages' must be a non-empty list"),
    (b'{"id": "both", "prompt": "x", "messages": []}', "give only one"),
    (b'{"id": "pt", "prompt_token_ids": [1, "2"]}', "list of integers"),
    (b'{"id": [1], "prompt": "x"}', "'id' must be a string or an integer"),
    (b'{"id": "a", "prompt": "again"}', "id 'a' repeats line"),
    (b'{"id": "r", "messages": [{"role": "robot", "content": "hi"}]}',
     "the chat template failed (TemplateError: unknown role robot)"),
    (b'{"id": "e", "prompt": ""}', "the prompt is empty"),
    (b'{"id": "l", "prompt": "' + b"x " * 300 + b'"}', "max_model_len=256"),
    (b'{"id": "v", "prompt_token_ids": [1, 2, 49152]}', "outside the vocabulary"),
    (b'{"id": "neg", "prompt_token_ids": [-1]}', "outside the vocabulary"),
]


def write_lines(path, lines):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n"
                              for x in lines))


def gen_args(model, inp, out, *extra):
    return ["generate", "--model", str(model), "--input", str(inp), "--output", str(out),
            "--max-tokens", "6", "--dtype", "float32", "--max-model-len", "256", "--n", "2",
            "--temperature", "1", "--seed", "3", "--no-progress", *extra]


def read_out(path):
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_every_kind_of_bad_line_is_reported_and_good_lines_match_a_clean_run(
        tmp_path, strict_template_dir, capsys):
    clean_in, clean_out = tmp_path / "clean.jsonl", tmp_path / "clean.out.jsonl"
    write_lines(clean_in, GOOD)
    assert main(gen_args(strict_template_dir, clean_in, clean_out)) == 0
    clean = read_out(clean_out)
    assert [r["line"] for r in clean] == [1, 2, 3, 4] and all("outputs" in r for r in clean)
    capsys.readouterr()

    # the bad lines between the good ones (the last good one, without an id, moves to line 2)
    mixed = [GOOD[0], GOOD[3], *(raw for raw, _ in BAD[:9]), GOOD[1], *(raw for raw, _ in BAD[9:]),
             GOOD[2]]
    mixed_in, mixed_out = tmp_path / "mixed.jsonl", tmp_path / "mixed.out.jsonl"
    write_lines(mixed_in, mixed)
    assert main(gen_args(strict_template_dir, mixed_in, mixed_out)) == 0
    printed = capsys.readouterr()
    raw = mixed_out.read_bytes()
    raw.decode("utf-8")  # the output is valid UTF-8 JSON whatever the input had
    lines = read_out(mixed_out)
    assert [r["line"] for r in lines] == list(range(1, len(mixed) + 1))
    ok = {r.get("id", "no id"): r for r in lines if "outputs" in r}
    assert set(ok) == {"a", 7, "c", "no id"}
    by_key = {r.get("id", "no id"): r for r in clean}
    for k, r in ok.items():  # token for token what the clean file gave (seeded sampling)
        assert r["outputs"] == by_key[k]["outputs"], k
        assert {f: v for f, v in r.items() if f != "line"} == \
            {f: v for f, v in by_key[k].items() if f != "line"}
    assert all(len(o["token_ids"]) == 6 for r in ok.values() for o in r["outputs"])
    errors = [r for r in lines if "error" in r]
    assert len(errors) == len(BAD)
    for r, (_, why) in zip(errors, BAD):
        assert why in r["error"], (r, why)
        assert r["error"].startswith(f"line {r['line']}: ")
        assert f"skipped {r['error']}" in printed.err
        assert "outputs" not in r
    surrogate = next(r for r in errors if r.get("id") == "s")
    assert "prompt" not in surrogate  # the field that cannot be written is left out
    assert f"requests: 4 ok, {len(BAD)} failed" in printed.out
    assert not (tmp_path / "mixed.out.jsonl.part").exists()


@pytest.fixture()
def job(tmp_path, tiny_llama_tok_dir):
    """Seven good lines (some with ids) and a bad one, and the output of one uninterrupted run
    of them (the reference)."""
    recs = [{"id": f"r{i}", "prompt": f"Item {i}: the"} if i % 2 else {"prompt": f"Item {i}: a"}
            for i in range(7)]
    recs.insert(3, {"prompt": 5})
    inp = tmp_path / "in.jsonl"
    write_lines(inp, recs)
    ref = tmp_path / "ref.jsonl"
    assert main(gen_args(tiny_llama_tok_dir, inp, ref)) == 0
    return inp, ref, tmp_path / "out.jsonl", tiny_llama_tok_dir


GENERATE_ITER = LLM.generate_iter  # the real one, whatever a test patched in


def patch_generate_iter(monkeypatch, stop_after=None, error=KeyboardInterrupt):
    """Count the requests ``LLM.generate_iter`` is given; with ``stop_after``, raise ``error``
    (by default KeyboardInterrupt, a Ctrl-C) once that many results came out."""
    requests = []

    def generate_iter(self, prompts, params=None, use_tqdm=True):
        requests.append(len(prompts))
        it = GENERATE_ITER(self, prompts, params, use_tqdm)

        def results():
            for k, item in enumerate(it):
                if k == stop_after:
                    raise error
                yield item
        return results()

    monkeypatch.setattr(LLM, "generate_iter", generate_iter)
    return requests


@pytest.mark.parametrize("torn", [False, True])
def test_resume_after_ctrl_c_gives_the_uninterrupted_output(job, monkeypatch, capsys, torn):
    inp, ref, out, model = job
    part = out.with_name(out.name + ".part")
    requests = patch_generate_iter(monkeypatch, stop_after=3)
    assert main(gen_args(model, inp, out)) == 130
    err = capsys.readouterr().err
    assert "interrupted: 3 records finished (3 in this run)" in err
    hint = err.strip().splitlines()[-1].strip()
    assert hint.startswith("specengine generate ") and hint.endswith(" --resume")
    assert requests == [7] and not out.exists()
    kept = part.read_bytes()
    assert kept.count(b"\n") == 3  # whole lines, one per finished record
    if torn:  # a kill -9 in the middle of writing the third line
        cut = kept.rstrip(b"\n").rfind(b"\n") + 1
        part.write_bytes(kept[:cut + 40])

    assert main(gen_args(model, inp, out)) == 2  # neither --resume nor --overwrite
    assert "--resume" in capsys.readouterr().err

    requests = patch_generate_iter(monkeypatch)
    assert main(gen_args(model, inp, out, "--resume")) == 0
    printed = capsys.readouterr()
    done_before = 2 if torn else 3
    assert requests == [7 - done_before]  # finished records are not generated again
    assert f"resume: {done_before} records already finished" in printed.err
    assert ("1 lines of earlier output ignored (torn" in printed.err) == torn
    assert f"requests: {7 - done_before} ok, 1 failed, {done_before} finished before" \
        in printed.out
    assert out.read_text() == ref.read_text()  # token for token, in input order
    assert not part.exists()

    requests = patch_generate_iter(monkeypatch)  # all done: nothing to generate
    assert main(gen_args(model, inp, out, "--resume")) == 0
    assert requests == [] and out.read_text() == ref.read_text()


def test_a_crash_keeps_the_finished_records_for_resume(job, monkeypatch, capsys):
    inp, ref, out, model = job
    patch_generate_iter(monkeypatch, stop_after=2, error=RuntimeError("engine step failed"))
    with pytest.raises(RuntimeError, match="engine step failed"):
        main(gen_args(model, inp, out))
    err = capsys.readouterr().err
    assert "failed: 2 records finished (2 in this run)" in err and err.rstrip().endswith(
        " --resume")
    requests = patch_generate_iter(monkeypatch)
    assert main(gen_args(model, inp, out, "--resume")) == 0
    assert requests == [5] and out.read_text() == ref.read_text()


def test_ctrl_c_before_generating_changes_no_file(job, monkeypatch, capsys):
    inp, ref, out, model = job
    part = out.with_name(out.name + ".part")
    part.write_text(ref.read_text().splitlines()[0] + "\n")  # an earlier run's work
    shutil.copy(ref, out)

    def load(*a, **k):
        raise KeyboardInterrupt  # while the model loads

    monkeypatch.setattr(LLM, "__init__", load)
    for flag in ("--resume", "--overwrite"):  # with --resume the ref's 7 records are done, so
        inp.write_bytes(inp.read_bytes() + b'{"prompt": "one more"}\n')  # add one to do
        before = out.read_bytes(), part.read_bytes()
        assert main(gen_args(model, inp, out, flag)) == 130
        assert "interrupted before generating; no file was changed" in capsys.readouterr().err
        assert (out.read_bytes(), part.read_bytes()) == before


def test_resume_generates_only_new_and_failed_lines(job, monkeypatch, capsys):
    inp, ref, out, model = job
    shutil.copy(ref, out)
    with open(inp, "ab") as f:  # two more lines; the bad line 4 gets fixed
        f.write(b'{"id": "new", "prompt": "More"}\n{"prompt": "And more"}\n')
    text = inp.read_bytes().replace(b'{"prompt": 5}', b'{"prompt": "five"}')
    inp.write_bytes(text)
    requests = patch_generate_iter(monkeypatch)
    assert main(gen_args(model, inp, out, "--resume")) == 0
    assert requests == [3]
    lines = read_out(out)
    assert len(lines) == 10 and all("outputs" in r for r in lines)
    assert [r["line"] for r in lines] == list(range(1, 11))
    assert lines[:3] + lines[4:8] == [r for r in read_out(ref) if "outputs" in r]
    assert "requests: 3 ok, 0 failed, 7 finished before" in capsys.readouterr().out


def test_an_existing_output_is_never_overwritten_without_overwrite(job, monkeypatch, capsys):
    inp, ref, out, model = job
    out.write_text("precious\n")
    requests = patch_generate_iter(monkeypatch)
    assert main(gen_args(model, inp, out)) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--resume" in err and "--overwrite" in err
    assert out.read_text() == "precious\n" and requests == []  # refused before loading a model
    with pytest.raises(SystemExit) as e:  # one or the other
        main(gen_args(model, inp, out, "--resume", "--overwrite"))
    assert e.value.code == 2
    out.with_name(out.name + ".part").write_text('{"torn": ')
    assert main(gen_args(model, inp, out, "--overwrite")) == 0
    assert requests == [7]
    assert out.read_text() == ref.read_text()
    assert not out.with_name(out.name + ".part").exists()
