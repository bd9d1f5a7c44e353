"""Helpers shared by the benchmarks: machine facts, memory bandwidth, weight bytes, tables."""

from __future__ import annotations

import platform
import time

import torch


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform's guess elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """Versions and machine facts to store next to the numbers."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu": cpu_model(),
            "torch_threads": torch.get_num_threads(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def best_time(fn, repeats: int) -> float:
    """Fewest seconds of ``repeats`` calls of ``fn``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict:
    """Memory bandwidth in GB/s, best of ``repeats``: ``read`` from summing a float32 tensor of
    ``gib`` GiB, ``copy`` (read + write bytes) from copying it into another one."""
    n = int(gib * (1 << 30)) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    src.sum()  # touch pages
    dst.copy_(src)
    nbytes = n * 4
    read = nbytes / best_time(src.sum, repeats) / 1e9
    copy = 2 * nbytes / best_time(lambda: dst.copy_(src), repeats) / 1e9
    return {"read_gbs": read, "copy_gbs": copy, "bytes": nbytes, "repeats": repeats}


def decode_weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads in ``dtype``: every parameter once (tied tensors
    once), but not the input embedding table unless it is also the LM head (a lookup reads only
    a few rows of it)."""
    elem = torch.empty((), dtype=dtype).element_size()
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is emb and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * elem
    return total


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; floats get 3 significant figures, None prints as '-'."""
    def fmt(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def quiet_transformers() -> None:
    """Silence Python warnings and transformers' logging and progress bars."""
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def stderr_logger(start: float):
    """``log(msg)``: print ``msg`` to stderr with the seconds since ``start``."""
    import sys
    import time

    def log(msg: str) -> None:
        print(f"# [{time.perf_counter() - start:6.0f}s] {msg}", file=sys.stderr, flush=True)

    return log


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` as indented JSON, atomically (a temporary file renamed into
    place, missing parent directories created), so an interrupted run never leaves a
    half-written results file."""
    from specengine.data.jsonl import write_json_atomic

    write_json_atomic(path, doc, indent=1)


def timed_method(obj, name: str, sink: list) -> None:
    """Replace ``obj.name`` by a wrapper appending each call's wall seconds to ``sink``."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)
