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
2-core AMD EPYC (Zen 4), SmolLM2-135M, 16 samples at T = 1, engines in one process run in
lockstep, those whose packed weights sat in 2 MiB pages decoded 3.5-5% faster than those in
4 KiB pages, and engines of the 4 KiB kind differed by up to 4% among themselves by the order
they were built in. Linux gives 2 MiB pages only to memory advised for them (``madvise``
``MADV_HUGEPAGE``; THP mode ``madvise``, the usual default) before it is first touched:
``in_huge_pages`` copies a packed weight into such a mapping, ``advise_huge_pages`` advises a
fresh buffer (the KV cache) before it is zeroed. Off when ``SPECENGINE_HUGE_PAGES=0``, off
Linux or with THP ``never``; tensors under 2 MiB are left alone. Results never depend on it.
"""

from __future__ import annotations

import ctypes
import mmap
import os

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


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (a contiguous CPU tensor, not changed) in an anonymous mapping advised
    for transparent huge pages, freed with the copy; ``t`` itself when it is under 2 MiB, not
    a contiguous CPU tensor, or huge pages are not available (``huge_pages_available``). The
    copy's storage cannot be resized."""
    nbytes = t.numel() * t.element_size()
    if (nbytes < HUGE_PAGE_BYTES or t.device.type != "cpu" or not t.is_contiguous()
            or not huge_pages_available()):
        return t
    try:
        buf = mmap.mmap(-1, nbytes)  # anonymous; Linux aligns a mapping this large to 2 MiB
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused (a sandbox, an old kernel): the tensor where it is
        return t
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).view(t.shape)  # keeps buf
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
