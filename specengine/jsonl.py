"""JSONL input and output for batch jobs: per-line errors instead of a failed job, atomic writes."""

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
