"""JSON and JSONL files: per-line errors instead of a failed batch job, atomic writes, fsync'd
line appends (a resumable job's log), and one JSON document read with a clear error."""

from __future__ import annotations

import json
import os


def read_records(path: str | os.PathLike) -> list[tuple[int, dict | None, str | None]]:
    """(line number, record, error) for each non-blank line of ``path`` (numbered from 1).

    A line is an error (``error`` a message starting ``"line N: "``, the line skipped by the
    callers) when it is not valid UTF-8, not JSON (also ``NaN`` / ``Infinity``, nesting too deep
    or an integer too long to convert), not a JSON object, or has a string with a lone surrogate
    (e.g. the escape ``"\\ud800"``: not Unicode text, no tokenizer or UTF-8 file takes it). The
    record is None when the line is not a JSON object, else the parsed object (also beside an
    error). A UTF-8 byte order mark at the start of the file is ignored. Never raises for the
    content of a line (only ``OSError`` for the file itself).
    """
    out = []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            if no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                out.append((no, None, f"line {no}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                                      f"byte {e.start + 1})"))
                continue
            if not line.strip():
                continue
            rec, err = _parse_line(line.rstrip("\r\n"), no)
            out.append((no, rec, err))
    return out


def _parse_line(line: str, no: int) -> tuple[dict | None, str | None]:
    try:
        rec = json.loads(line, parse_constant=_no_constant)  # error columns within the line
    except json.JSONDecodeError as e:
        why = e.msg.removesuffix(" at")  # some messages end in "at"
        return None, f"line {no}: invalid JSON ({why} at column {e.colno})"
    except RecursionError:
        return None, f"line {no}: invalid JSON (nested too deeply)"
    except ValueError as e:  # NaN / Infinity, integers over Python's digit limit
        return None, f"line {no}: invalid JSON ({str(e).split(';')[0]})"
    if not isinstance(rec, dict):
        return None, f"line {no}: expected a JSON object, got {type(rec).__name__}"
    where = lone_surrogate(rec)
    if where is not None:
        field, text = where
        return rec, (f"line {no}: {field} is not valid Unicode (lone surrogate "
                     f"{text!r} has no UTF-8 encoding)")
    return rec, None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def lone_surrogate(obj, field: str = "") -> tuple[str, str] | None:
    """(where, e.g. ``"'messages[0].content'"``, and the offending characters) for the first
    string, key or value, in ``obj`` that has no UTF-8 encoding (a lone surrogate), or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            return (repr(field) if field else "the text"), obj[e.start:e.end]
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            bad = lone_surrogate(k)
            if bad is not None:
                return (f"a key in {field!r}" if field else "a key"), bad[1]
            bad = lone_surrogate(v, f"{field}.{k}" if field else k)
            if bad is not None:
                return bad
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            bad = lone_surrogate(v, f"{field}[{i}]")
            if bad is not None:
                return bad
    return None


def read_jsonl_tolerant(path: str | os.PathLike) -> tuple[list[dict], int]:
    """(the JSON objects of ``path``, the number of lines skipped): a line that is not valid
    UTF-8 JSON object text is skipped, e.g. the torn last line a killed writer left behind.
    A missing file reads as ([], 0)."""
    recs, bad = [], 0
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return [], 0
    with f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                bad += 1
                continue
            if isinstance(rec, dict):
                recs.append(rec)
            else:
                bad += 1
    return recs, bad


def dump_line(rec: dict) -> bytes:
    """``rec`` as one JSONL line (UTF-8, non-ASCII kept, ending in a newline).

    Raises:
        ValueError: ``rec`` cannot be written (a lone surrogate: UnicodeEncodeError, a NaN:
            ValueError; a TypeError for a value JSON has no type for).
    """
    return (json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


class JsonlAppender:
    """Append JSON records to a file, one whole line per ``os.write`` (``O_APPEND``), each
    fsync'd before ``append`` returns: a crash or Ctrl-C keeps every record appended so far,
    and a ``kill -9`` or power loss at most leaves one torn last line (which
    ``read_jsonl_tolerant`` skips). Use as a context manager.

    Args:
        path: the file, created if missing (its folder fsync'd then).
        truncate: start from an empty file.
    """

    def __init__(self, path: str | os.PathLike, truncate: bool = False):
        self.path = os.fspath(path)
        created = not os.path.exists(self.path)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        self.fd = os.open(self.path, flags, 0o644)
        os.fsync(self.fd)
        if created:
            fsync_dir(self.path)

    def append(self, rec: dict) -> None:
        """Write ``rec`` as one line and fsync it.

        Raises:
            ValueError / TypeError: as ``dump_line`` (nothing is written then).
        """
        data = memoryview(dump_line(rec))
        while data:  # a regular file takes it in one write; loop for the rare short write
            data = data[os.write(self.fd, data):]
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync the folder holding ``path`` (so a created or renamed entry survives a power loss;
    a no-op where folders cannot be opened, e.g. on Windows)."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_jsonl_atomic(path: str | os.PathLike, records: list[dict]) -> None:
    """Write ``records`` as JSONL to a temporary file beside ``path``, fsync it, then rename it
    into place: ``path`` is the old file or the complete new one, never a part (the temporary
    file is removed if writing fails)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(path)


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
