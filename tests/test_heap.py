"""``ops.heap.tune_malloc``: a step-sized buffer comes from the heap and stays there when freed
(instead of being mapped and unmapped, then page-faulted in again each step); off by
environment; never applied twice."""

import os
import platform
import subprocess
import sys

import pytest

# 48 MiB: above glibc's largest dynamic mmap threshold (32 MiB on 64-bit), so with glibc's
# defaults it is always mmap'd; below the tuned 64 MiB, so tuned it comes from the heap.
PROBE = r"""
import ctypes, torch
from specengine.ops.heap import tune_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
on = tune_malloc()
before = libc.mallinfo2()
x = torch.empty(48 << 20, dtype=torch.uint8).fill_(1)
during = libc.mallinfo2()
del x
after = libc.mallinfo2()
print(on, during.hblkhd - before.hblkhd, after.fordblks - before.fordblks)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc only")


def probe(env: dict) -> tuple[bool, int, int]:
    """(tuned?, bytes mmap'd for the buffer, heap bytes left free after it was freed)."""
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


@glibc
def test_tuned_heap_keeps_step_sized_buffers():
    on, mapped, kept = probe({})
    assert on
    assert mapped == 0  # from the heap, not a fresh mapping
    assert kept >= 40 << 20  # and kept free in the heap for the next step (most of it)
    off, mapped_off, kept_off = probe({"SPECENGINE_MALLOC_TUNE": "0"})
    assert not off
    assert mapped_off >= 48 << 20  # the control: glibc's defaults map it afresh
    assert kept_off < 8 << 20  # and give it back
    user, mapped_user, _ = probe({"MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert not user and mapped_user >= 48 << 20  # the user's own setting is left alone


def test_tune_malloc_is_applied_once():
    from specengine.ops import heap

    first = heap.tune_malloc()
    assert heap.tune_malloc() is first


def test_huge_page_copies_equal_the_tensor_and_leave_small_ones(monkeypatch):
    """``in_huge_pages`` copies a packed-weight-sized tensor bit for bit (into memory of its
    own), leaves one under 2 MiB as it is, and leaves everything alone when turned off."""
    import torch

    from specengine.ops import heap

    monkeypatch.setattr(heap, "_huge", True)
    big = torch.randn(1536, 576).to(torch.bfloat16)  # 1.7 MiB
    bigger = torch.randn(4096, 576).to(torch.bfloat16)  # 4.5 MiB
    copy = heap.in_huge_pages(bigger)
    assert copy is not bigger and copy.data_ptr() != bigger.data_ptr()
    assert torch.equal(copy.view(torch.int16), bigger.view(torch.int16))
    assert copy.shape == bigger.shape and copy.dtype == bigger.dtype
    assert heap.in_huge_pages(big) is big
    view = bigger.t()  # not contiguous: left as it is
    assert heap.in_huge_pages(view) is view
    monkeypatch.setattr(heap, "_huge", False)
    assert heap.in_huge_pages(bigger) is bigger
    assert not heap.advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8))


def test_huge_pages_off_by_environment():
    out = subprocess.run(
        [sys.executable, "-c", "from specengine.ops.heap import huge_pages_available as h; "
                               "print(h())"],
        env={**os.environ, "SPECENGINE_HUGE_PAGES": "0"}, capture_output=True, text=True,
        check=True)
    assert out.stdout.strip() == "False"
