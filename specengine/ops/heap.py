"""Where the engine's large CPU buffers live: freed buffers kept in the process heap (glibc
``mallopt``), and the weights' kernel copies and the KV cache in transparent huge pages.

Kept buffers. Why: a verify step of a large-vocabulary target allocates a few ``[R, V]`` float32
tensors (Qwen2.5's 151,936-token vocabulary at 48 rows: 29 MB each). glibc serves allocations
over its mmap threshold (dynamic, at most 32 MiB) with fresh ``mmap`` pages, and gives the top
of the heap back to the OS once more than its trim threshold (twice the mmap threshold) is free;
either way the next step's buffer of the same size page-faults in again (about 7,000 faults of 4
KiB per 29 MB). Measured on a 2-core Intel Xeon with AMX (qwen2.5-coder-0.5b-instruct, 16
samples at T = 1, EAGLE chain of 2): the softmax of a verify step 12.9 -> 7.1 ms and the step
125 -> 108 ms; plain decoding unchanged.

What: ``M_MMAP_THRESHOLD`` 64 MiB (a fixed threshold, just above glibc's own 32 MiB maximum)
and ``M_TRIM_THRESHOLD`` 512 MiB (free heap top kept up to that size), set once per process
when the first CPU engine is built. The cost is up to 512 MiB of freed memory kept by the
process instead of returned to the OS. Nothing is changed when ``SPECENGINE_MALLOC_TUNE=0``,
when the user set either threshold (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``),
or when the C library is not glibc. Results never depend on it (only where memory comes from).

Huge pages. A decode step streams every packed weight (and the K/V of every sequence) from
memory once. In 4 KiB pages a hardware prefetcher stops at each page boundary and each page
needs its own TLB entry, and the speed depends on where the pages happened to land: on a
2-core AMD EPYC (Zen 4), SmolLM2-135M, 16 samples at T = 1, 256 tokens, engines in one process
run in lockstep, those with all their packed weights in 2 MiB pages decoded 7-11% faster than
those with them in 4 KiB pages (``python bench/bench_huge_pages.py``: two engines of each kind,
three rounds), and engines of the 4 KiB kind differed by up to 4% among themselves by the
order they were built in. Linux gives 2 MiB pages only to memory advised for them
(``madvise`` ``MADV_HUGEPAGE``; THP mode ``madvise``, the usual default) before it is first
touched: ``in_huge_pages`` copies a packed weight into such memory (chunks of 32 MiB aligned to 2
MiB that the packed weights share), ``advise_huge_pages`` advises a fresh buffer (the KV cache)
before it is zeroed. Off when ``SPECENGINE_HUGE_PAGES=0``, off Linux or with THP ``never``.
Results never depend on it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

import torch

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 512 << 20

_done: bool | None = None  # None: not tried yet


def tune_malloc() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring) once per process.

    Returns:
        True when they are set (now or by an earlier call), False when left alone: turned off
        (``SPECENGINE_MALLOC_TUNE=0``), set by the user's environment, or not glibc.
    """
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("SPECENGINE_MALLOC_TUNE", "1") == "0" or any(
            k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (raises AttributeError off glibc)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _done


HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
_huge: bool | None = None  # None: not checked yet


def huge_pages_available() -> bool:
    """Whether buffers may be advised for transparent huge pages (module docstring): Linux
    with THP not ``never`` and ``SPECENGINE_HUGE_PAGES`` not ``0``."""
    global _huge
    if _huge is None:
        _huge = False
        if os.environ.get("SPECENGINE_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                    _huge = "[never]" not in f.read()
            except OSError:
                _huge = False
    return _huge


ARENA_CHUNK_BYTES = 32 << 20
_arena: tuple[weakref.ref, int] | None = None  # (the current chunk's mapping, its next byte)
_arena_lock = threading.Lock()


def _arena_take(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` bytes (a ``uint8`` tensor of its own storage, 64-byte aligned) of a chunk of
    anonymous private memory advised for transparent huge pages and aligned to 2 MiB: the
    packed weights share chunks, so small ones sit in 2 MiB pages too (a mapping of its own
    each would not be aligned: Linux aligns only mappings whose length is a multiple of 2 MiB).
    A chunk is ``ARENA_CHUNK_BYTES`` (more for a larger tensor) and is unmapped when the last
    tensor in it is freed (the arena holds it weakly). None when the mapping or advice is
    refused."""
    global _arena
    with _arena_lock:
        buf = _arena[0]() if _arena is not None else None
        at = _arena[1] if buf is not None else 0
        if buf is None or at + nbytes > len(buf):
            chunk = max(ARENA_CHUNK_BYTES, -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
            try:  # private: a shared anonymous mapping is shmem, whose THP setting differs
                buf = mmap.mmap(-1, chunk + HUGE_PAGE_BYTES,  # room to align the start
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # refused (a sandbox, an old kernel)
                return None
            at = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE_BYTES
        out = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=at)  # keeps buf
        _arena = (weakref.ref(buf), at + -(-nbytes // 64) * 64)
        return out


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (a contiguous CPU tensor, not changed) in transparent huge pages (a
    chunk shared with other such copies, ``_arena_take``), freed with the copy; ``t`` itself
    when it is empty, not a contiguous CPU tensor, or huge pages are not available
    (``huge_pages_available``) or refused. The copy has a storage of its own (exactly its
    bytes) inside the chunk; it cannot be resized."""
    nbytes = t.numel() * t.element_size()
    if (not nbytes or t.device.type != "cpu" or not t.is_contiguous()
            or not huge_pages_available()):
        return t
    raw = _arena_take(nbytes)
    if raw is None:
        return t
    out = raw.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Advise the 2 MiB-aligned part of ``t``'s memory (a CPU tensor not touched yet, e.g.
    from ``torch.empty``) for transparent huge pages. Returns whether the advice was given
    (False: under 2 MiB, not CPU, not available or refused)."""
    if t.device.type != "cpu" or not huge_pages_available():
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(first, last - first, MADV_HUGEPAGE) == 0
