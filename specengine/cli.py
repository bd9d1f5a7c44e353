"""The ``specengine`` command: ``generate`` (below), ``serve`` (``specengine.server``) and
``train-drafter`` (its arguments here, the job in ``specengine.speculative.training.distill``).

``specengine generate``: offline batch generation from a JSONL file, resumable.

Each input line is a JSON object with ``prompt`` (text), ``messages`` (a chat) or
``prompt_token_ids``, and optionally ``id``. Each output line keeps every input field, adds
``line`` (its line number in the input) and ``outputs`` (one per sample: ``text``,
``token_ids``, ``finish_reason``, ``stop_reason``). A bad line, whatever the reason (not UTF-8,
not JSON, a missing or ill-typed field, a lone surrogate, a chat-template error, a prompt too
long, token ids outside the vocabulary, a repeated id), is reported on stderr, written with an
``error`` field instead of ``outputs``, and skipped; the rest completes.

A record's key is its ``id`` (a string or an integer, unique in the file) if it has one, else
its line number. Each finished record is appended to ``<output>.part`` as one whole, fsync'd
line, so Ctrl-C, a crash or a kill keeps everything finished so far; the final file is written
in input order and renamed into place at the end, so it is never half-written. ``--resume``
skips the records whose key has ``outputs`` in the output or its ``.part`` (a torn last line is
ignored; error lines are tried again) and generates the rest; without it an existing output (or
``.part``) is an error unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from specengine import __version__
from specengine.cli_args import speculative_config_arg
from specengine.data.jsonl import (
    JsonlAppender,
    dump_line,
    read_jsonl_tolerant,
    read_records,
    write_jsonl_atomic,
)
from specengine.models.registry import DEFAULT_MODEL
from specengine.sampling.params import SamplingParams

GENERATE_EXIT = (
    "generate exits with 0 when the job finished, also if some input lines failed (each is in "
    "the output with an 'error' field and listed in the summary), with 2 for bad arguments or "
    "an output that exists (see --resume, --overwrite), and with 130 on Ctrl-C (what finished "
    "is kept in OUTPUT.part; rerun with --resume).")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="specengine", description="Offline batch generation (generate), an OpenAI- and "
        "TRL-compatible HTTP server (serve) and EAGLE drafter training (train-drafter), with "
        "lossless speculative decoding.",
        epilog=GENERATE_EXIT)
    ap.add_argument("--version", action="version", version=f"specengine {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for a JSONL file of prompts",
                       description="Generate completions for a JSONL file of prompts; bad lines "
                       "are reported and skipped, finished records are kept through Ctrl-C "
                       "and crashes (--resume continues).", epilog=GENERATE_EXIT)
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="known alias, Hugging Face directory or .gguf file")
    g.add_argument("--input", required=True,
                   help="JSONL: per line 'prompt' (text), 'messages' (a chat) or "
                   "'prompt_token_ids', and optionally 'id' (a string or integer, unique; "
                   "what --resume matches, else the line number)")
    g.add_argument("--output", required=True,
                   help="JSONL to write (in input order, atomically at the end; finished "
                   "records stream to OUTPUT.part as they complete)")
    once = g.add_mutually_exclusive_group()
    once.add_argument("--resume", action="store_true",
                      help="keep the records already finished in OUTPUT or OUTPUT.part (same "
                      "id, or same line number for lines without one), generate the others "
                      "(also lines that failed before) and write OUTPUT with all of them; use "
                      "the same flags as the first run")
    once.add_argument("--overwrite", action="store_true",
                      help="replace an existing OUTPUT (and discard an OUTPUT.part) instead of "
                      "refusing to start")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the chat template to 'prompt' lines too")
    g.add_argument("--no-chat", dest="chat", action="store_false",
                   help="never apply the chat template ('messages' lines then fail)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_train_drafter(sub)
    from specengine.server.cli import add_serve_cli
    add_serve_cli(sub)
    return ap.parse_args(argv)


def add_train_drafter(sub) -> None:
    """Register ``specengine train-drafter`` (run by ``training.distill.train_drafter``) on
    an argparse subparsers object."""
    t = sub.add_parser("train-drafter", help="train an EAGLE drafter by self-distillation")
    t.add_argument("--model", default="smollm2-135m-instruct", help="target model")
    t.add_argument("--data", required=True,
                   help="JSONL: 'prompt' or 'messages' per line, optional 'response'")
    t.add_argument("--out", required=True, help="checkpoint directory to write")
    t.add_argument("--max-tokens", type=int, default=256, help="response length when generating")
    t.add_argument("--temperatures", default="0,1",
                   help="sampling temperatures used round-robin over prompts when generating")
    t.add_argument("--draft-vocab", type=int, default=8192, help="FR-Spec draft vocabulary size")
    t.add_argument("--val-frac", type=float, default=0.05)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-tokens", type=int, default=2048)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--unroll", type=int, default=3)
    t.add_argument("--warm-unroll-frac", type=float, default=0.0,
                   help="fraction of the steps trained with unroll 1 before unrolling")
    t.add_argument("--noise", type=float, default=0.1)
    t.add_argument("--reg-weight", type=float, default=0.5)
    t.add_argument("--max-len", type=int, default=768)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="target dtype for generation and features")
    t.add_argument("--init", default=None, help="start from this drafter checkpoint")
    t.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    t.add_argument("--max-num-seqs", type=int, default=96,
                   help="sequences decoded at once while generating responses")
    t.add_argument("--no-progress", action="store_true")


def encode_record(llm, rec: dict, no: int, chat: bool | None) -> dict:
    """The ``generate`` prompt (``{"prompt", "prompt_token_ids"}``) of one input record.

    Raises:
        ValueError: naming the line, for any reason the record cannot be generated from (no or
            several of 'prompt' / 'messages' / 'prompt_token_ids', a wrong type, a chat
            template that fails, a prompt that is empty, too long or has token ids outside
            the vocabulary).
    """
    what = f"line {no}"
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if k in rec]
    if not given:
        raise ValueError(f"{what}: needs a 'prompt' or 'messages' field (or 'prompt_token_ids')")
    if len(given) > 1:
        raise ValueError(f"{what}: has {' and '.join(repr(k) for k in given)}; give only one")
    if "messages" in rec:
        if chat is False:
            raise ValueError(f"{what}: has 'messages' but --no-chat was given")
        text, ids = _encode_chat(llm, rec["messages"], what, f"{what}: 'messages'")
    elif "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise ValueError(f"{what}: 'prompt' must be a string, got "
                             f"{type(rec['prompt']).__name__}")
        if chat:
            text, ids = _encode_chat(llm, [{"role": "user", "content": rec["prompt"]}], what,
                                     what)
        else:
            text, ids = rec["prompt"], llm.get_tokenizer()(rec["prompt"]).input_ids
    else:
        ids = rec["prompt_token_ids"]
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{what}: 'prompt_token_ids' must be a list of integers")
        text = None
    llm.engine.validate_prompt(ids, what)
    return {"prompt": text, "prompt_token_ids": ids}


def _encode_chat(llm, conv, what: str, param: str) -> tuple[str, list[int]]:
    """``llm.encode_chat`` with a template that raises (``raise_exception``, a Jinja error, a
    TypeError inside the template) turned into a ValueError naming the line."""
    try:
        return llm.encode_chat(conv, param)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"{what}: the chat template failed ({type(e).__name__}: {e})") from None


def result_record(rec: dict, out, no: int) -> dict:
    """The output line of input line ``no`` (record ``rec``) generated as ``out``: the input
    fields, ``line`` and ``outputs``."""
    return {**rec, "line": no, "outputs": [
        {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
         "stop_reason": o.stop_reason} for o in out.outputs]}


def error_record(rec: dict | None, no: int, err: str) -> dict:
    """The output line of a bad input line: its fields that can be written as UTF-8 JSON
    (a field with a lone surrogate is left out), ``line`` and ``error``."""
    kept = {}
    for k, v in (rec or {}).items():
        try:
            dump_line({k: v})
        except (ValueError, TypeError):
            continue
        kept[k] = v
    kept.pop("outputs", None)
    return {**kept, "line": no, "error": err}


def record_key(rec: dict, no: int) -> tuple[str, str | int]:
    """What ``--resume`` matches a record by: ``("id", id)`` if the record has an ``id``, else
    ``("line", no)``. Output lines carry both ``id`` (an input field) and ``line``, so
    ``output_key`` finds the same key in them."""
    return ("id", rec["id"]) if "id" in rec else ("line", no)


def output_key(rec: dict) -> tuple[str, str | int] | None:
    """``record_key`` of a line read back from an output (None if it has no usable key)."""
    if "id" in rec:
        return ("id", rec["id"]) if _valid_id(rec["id"]) else None
    line = rec.get("line")
    return ("line", line) if isinstance(line, int) and not isinstance(line, bool) else None


def _valid_id(v) -> bool:
    return isinstance(v, str) or isinstance(v, int) and not isinstance(v, bool)


def read_records_with_keys(path: str):
    """``read_records(path)`` as (line, record, error, key) with the ``id`` checked: an id that
    is not a string or integer, or repeats an earlier line's, makes the line an error."""
    seen: dict = {}
    out = []
    for no, rec, err in read_records(path):
        key = None
        if err is None:
            key = record_key(rec, no)
            if key[0] == "id" and not _valid_id(key[1]):
                err = f"line {no}: 'id' must be a string or an integer, got " \
                      f"{type(key[1]).__name__}"
            elif key in seen:
                err = f"line {no}: id {key[1]!r} repeats line {seen[key]} (ids must be unique)"
            else:
                seen[key] = no
        out.append((no, rec, err, key if err is None else None))
    return out


def load_finished(paths: list[str]) -> tuple[dict, int]:
    """(key -> output record with ``outputs``, lines skipped) from the outputs of earlier runs
    (later paths win). Error lines (no ``outputs``) are not finished; lines that are torn (a
    kill during a write), not JSON objects, or finished but without a usable ``id`` / ``line``
    are skipped and counted."""
    done, skipped = {}, 0
    for path in paths:
        recs, bad = read_jsonl_tolerant(path)
        skipped += bad
        for r in recs:
            key = output_key(r)
            if not isinstance(r.get("outputs"), list):
                continue
            if key is None:
                skipped += 1
            else:
                done[key] = r
    return done, skipped


def finished_count(records: list, done: dict, part: str) -> int:
    """How many input records a ``--resume`` would find finished: ``done`` (this run's and
    the earlier output's) and whatever reached ``part`` (counted from the file, since an
    interrupt can land between a line's write and the bookkeeping after it)."""
    keys = set(done) | set(load_finished([part])[0])
    return sum(1 for _, _, _, key in records if key in keys)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes the job started with ``argv`` (``--resume`` in place of
    ``--overwrite``)."""
    kept = [a for a in argv if a not in ("--resume", "--overwrite")]
    return shlex.join(["specengine", *kept, "--resume"])


def generate(args: argparse.Namespace) -> int:
    """Run ``specengine generate`` (see the module docstring). Returns the exit status: 0 done
    (also with bad lines), 2 bad arguments or an existing output, 130 interrupted."""
    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
            min_tokens=args.min_tokens, stop=args.stop)
        why = output_problem(args)
        if why is not None:
            raise ValueError(why)
        spec = speculative_config_arg(args.speculative_config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return GenerateJob(args, params, spec).run()


def output_problem(args: argparse.Namespace) -> str | None:
    """Why ``--input`` / ``--output`` cannot be used (a missing folder or input, a folder
    given as a file, an output or ``.part`` that exists without ``--resume`` or
    ``--overwrite``), or None."""
    part = f"{args.output}.part"
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        return f"--output {args.output!r}: folder {out_dir!r} does not exist"
    if os.path.isdir(args.output):
        return f"--output {args.output!r} is a folder"
    if not os.path.isfile(args.input):
        what = "is a folder, not a file" if os.path.isdir(args.input) else "does not exist"
        return f"--input {args.input!r} {what}"
    if not (args.resume or args.overwrite):
        there = [p for p in (args.output, part) if os.path.exists(p)]
        if there:
            return (f"{' and '.join(there)} already exist{'s' if len(there) == 1 else ''}; "
                    "pass --resume to keep what is finished and generate the rest, or "
                    "--overwrite to start over")
    return None


class GenerateJob:
    """One ``specengine generate`` run, its arguments checked: the input's records, those
    earlier runs finished (``--resume``), the bookkeeping that keeps every finished record in
    ``<output>.part`` through an interrupt, the final output and the summary.

    Args:
        args: the parsed ``generate`` arguments. params: the ``SamplingParams`` of every
            record. spec: the speculative config (a dict) or None.
    """

    def __init__(self, args: argparse.Namespace, params: SamplingParams, spec: dict | None):
        self.args, self.params, self.spec = args, params, spec
        self.part = f"{args.output}.part"
        self.argv = getattr(args, "argv", None) or sys.argv[1:]
        self.records = read_records_with_keys(args.input)
        self.done: dict = {}  # key -> finished output record
        self.part_done: dict = {}  # the same, of the .part an earlier run left
        self.errors: dict[int, str] = {}  # line -> why it failed
        self.resumed = self.new = 0
        self.llm, self.prompts, self.lines, self.outs = None, [], [], []
        self.part_ready, self.wall = False, 0.0

    def run(self) -> int:
        """Generate what is not finished and write the output; the exit status (0, 2 when
        the model cannot be loaded, 130 on Ctrl-C). Other errors are raised after saying
        what is kept and how to resume."""
        todo = self._start()
        try:
            if todo:
                if not self._load_model():
                    return 2
                self._encode(todo)
            # the .part keeps only finished records: rewritten without torn or error lines
            # when resuming, emptied otherwise
            write_jsonl_atomic(self.part, list(self.part_done.values()))
            self.part_ready = True
            self._generate()
            self._write_output()
        except BaseException as e:  # Ctrl-C or a crash: say what is kept and how to go on
            self._report_stop(e)
            if isinstance(e, KeyboardInterrupt):
                return 130
            raise
        self._print_summary()
        return 0

    def _start(self) -> list:
        """Read what earlier runs finished (``--resume``), report the bad input lines; the
        (line, record, key) of the records to generate."""
        if self.args.resume:
            self.done, skipped = load_finished([self.args.output])
            self.part_done, skipped_part = load_finished([self.part])
            self.done.update(self.part_done)  # the .part is newer than the output
            skipped += skipped_part
        self.resumed = sum(1 for _, _, _, key in self.records if key in self.done)
        if self.args.resume:
            print(f"resume: {self.resumed} records already finished"
                  + (f"; {skipped} lines of earlier output ignored (torn by a kill, not JSON, "
                     "or without an id or line number)" if skipped else ""),
                  file=sys.stderr)
        for no, _, err, _ in self.records:
            if err is not None:
                self.errors[no] = err
                print(f"skipped {err}", file=sys.stderr)
        return [(no, rec, key) for no, rec, err, key in self.records
                if err is None and key not in self.done]

    def _load_model(self) -> bool:
        """Load the ``LLM``; False (said on stderr) when the arguments are refused."""
        from specengine.api import LLM

        a = self.args
        try:
            self.llm = LLM(a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                           kv_cache_memory_bytes=a.kv_cache_memory_bytes, seed=a.seed,
                           speculative_config=self.spec)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return False
        return True

    def _encode(self, todo: list) -> None:
        """The prompts of ``todo``; a record that cannot be encoded is reported and skipped."""
        for no, rec, key in todo:
            try:
                self.prompts.append(encode_record(self.llm, rec, no, self.args.chat))
                self.lines.append((no, rec, key))
            except Exception as e:  # any reason: the line is skipped, the job goes on
                err = str(e) if str(e).startswith(f"line {no}:") else \
                    f"line {no}: {type(e).__name__}: {e}"
                self.errors[no] = err
                print(f"skipped {err}", file=sys.stderr)

    def _generate(self) -> None:
        """Generate the prompts, appending each finished record to the ``.part``."""
        t0 = time.perf_counter()
        if self.prompts:
            with JsonlAppender(self.part) as log:
                for i, out in self.llm.generate_iter(self.prompts, self.params,
                                                     use_tqdm=not self.args.no_progress):
                    no, rec, key = self.lines[i]
                    res = result_record(rec, out, no)
                    try:
                        log.append(res)
                    except (ValueError, TypeError) as e:
                        self.errors[no] = f"line {no}: the result cannot be written as " \
                                          f"JSON ({e})"
                        print(f"failed {self.errors[no]}", file=sys.stderr)
                        continue
                    self.done[key] = res
                    self.outs.append(out)
                    self.new += 1
        self.wall = time.perf_counter() - t0

    def _write_output(self) -> None:
        """Write the output in input order (finished records, error lines for the others,
        then finished records no input line matches) atomically; remove the ``.part``."""
        final, used = [], set()
        for no, rec, _, key in self.records:
            if key in self.done:
                final.append({**self.done[key], "line": no})
                used.add(key)
            else:
                final.append(error_record(rec, no, self.errors[no]))
        extra = [r for k, r in self.done.items() if k not in used]
        if extra:
            print(f"note: {len(extra)} records finished by earlier runs match no input line; "
                  "kept at the end", file=sys.stderr)
        write_jsonl_atomic(self.args.output, final + extra)
        os.remove(self.part)

    def _report_stop(self, e: BaseException) -> None:
        """Say on stderr what an interrupt or a crash ``e`` kept and the command that goes
        on."""
        ctrl_c = isinstance(e, KeyboardInterrupt)
        if not self.part_ready:  # before generating: no file was touched
            what = "interrupted" if ctrl_c else "failed"
            print(f"\n{what} before generating; no file was changed. Run again with\n  "
                  f"{shlex.join(['specengine', *self.argv])}", file=sys.stderr)
            return
        total = finished_count(self.records, self.done, self.part)
        what = (f"interrupted: {total} records finished" if ctrl_c
                else f"failed: {total} records finished")
        print(f"\n{what} ({total - self.resumed} in this run), kept in {self.part}; to finish "
              f"the job{'' if ctrl_c else ' after fixing the cause'}"
              f", run\n  {resume_command(self.argv)}", file=sys.stderr)

    def _print_summary(self) -> None:
        """The job's counts and speed on stdout (with speculation, its statistics), then the
        failed lines."""
        n_prompt = sum(len(p["prompt_token_ids"]) for p in self.prompts)
        n_gen = sum(len(o.token_ids) for out in self.outs for o in out.outputs)
        print(f"requests: {self.new} ok, {len(self.errors)} failed"
              + (f", {self.resumed} finished before (resumed)" if self.args.resume else "")
              + f" | prompt tokens: {n_prompt} | generated tokens: {n_gen} | "
              f"{n_gen / max(self.wall, 1e-9):.1f} tokens/s | wall time: {self.wall:.1f} s")
        if self.llm is not None and self.spec:
            print_speculation(self.llm.get_metrics())
        for err in (self.errors[no] for no in sorted(self.errors)):
            print(f"  failed {err}")


def print_speculation(m: dict) -> None:
    """The speculation lines of ``generate``'s summary, from ``LLM.get_metrics()`` ``m``."""
    print(f"speculation: acceptance length {m.get('acceptance_length', 1.0):.2f} tokens/"
          f"forward | drafted {m['drafted_tokens']} accepted {m['accepted_tokens']} | "
          f"draft {m['draft_time']:.1f} s, target forward "
          f"{m['decode_time'] + m['prefill_time']:.1f} s, sample/verify "
          f"{m['sample_time']:.1f} s")
    ran = m.get("policy_strategies", {})
    if ran:
        def rate(x):
            return "-" if x is None else f"{x:.1f}"

        print(f"policy {m['policy']}: " + ", ".join(
            f"{name} {s['steps']} steps (predicted {rate(s['predicted_tok_s'])}, observed "
            f"{rate(s['observed_tok_s'])} tokens/s)" for name, s in ran.items())
            + (f"; {100 * m['policy_nodes_cut_frac']:.0f}% of draft nodes cut as not worth "
               "verifying" if m.get("policy_nodes_cut_frac") else ""))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specengine`` command."""
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the resume hint
    if args.command == "generate":
        return generate(args)
    if args.command == "train-drafter":
        from specengine.speculative.training.distill import train_drafter
        return train_drafter(args)
    if args.command == "serve":
        from specengine.server.cli import serve_main
        return serve_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
