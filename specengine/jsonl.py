"""JSON and JSONL files: per-line errors instead of a failed batch job, atomic writes, and one
JSON document read with a clear error."""

from __future__ import annotations

import json
import os


def read_records(path: str) -> list[tuple[int, dict | None, str | None]]:
    """(line number, record or None, error or None) for each non-blank line of ``path``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.rstrip("\r\n"))  # error columns within the line
            except json.JSONDecodeError as e:
                why = e.msg.removesuffix(" at")  # some messages end in "at"
                out.append((no, None, f"line {no}: invalid JSON ({why} at column {e.colno})"))
                continue
            if not isinstance(rec, dict):
                out.append((no, None, f"line {no}: expected a JSON object, got "
                                      f"{type(rec).__name__}"))
                continue
            out.append((no, rec, None))
    return out


def write_jsonl_atomic(path: str, records: list[dict]) -> None:
    """Write ``records`` as JSONL to a temporary file beside ``path``, then rename it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str | os.PathLike, doc, indent: int | None = None) -> None:
    """Write ``doc`` as JSON to a temporary file beside ``path``, then rename it into place
    (compact without ``indent``; missing parent directories are created)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=indent, separators=None if indent else (",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str | os.PathLike, what: str):
    """The JSON document in ``path``.

    Raises:
        FileNotFoundError: no such file. ValueError: not JSON (the message names ``what`` and
            the path).
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} {path}: not JSON ({e})") from None
