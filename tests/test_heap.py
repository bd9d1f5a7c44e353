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


def test_huge_page_copies_equal_the_tensor_and_share_aligned_chunks(monkeypatch):
    """``in_huge_pages`` copies packed weights bit for bit into memory of their own, small and
    large ones alike, packed one after another (64-byte aligned) into chunks aligned to 2 MiB
    (``ops.heap._arena_take``); a chunk is unmapped with the last copy in it; a non-contiguous
    tensor, or any with huge pages turned off, is left as it is."""
    import gc

    import torch

    from specengine.ops import heap

    monkeypatch.setattr(heap, "_huge", True)
    monkeypatch.setattr(heap, "_arena", None)  # a fresh chunk for this test
    small = torch.randn(7, 576).to(torch.bfloat16)  # 8 KiB
    big = torch.randn(1536, 576).to(torch.bfloat16)  # 1.7 MiB
    bigger = torch.randn(40000, 576).to(torch.bfloat16)  # 44 MiB: over a chunk
    copies = [heap.in_huge_pages(t) for t in (small, big, bigger)]
    for t, c in zip((small, big, bigger), copies):
        assert c is not t and c.data_ptr() != t.data_ptr()
        assert torch.equal(c.view(torch.int16), t.view(torch.int16))
        assert c.shape == t.shape and c.dtype == t.dtype
        assert c.untyped_storage().nbytes() == t.numel() * t.element_size()  # its own storage
    first = copies[0].data_ptr()
    assert first % heap.HUGE_PAGE_BYTES == 0  # a fresh chunk starts on a 2 MiB boundary
    assert copies[1].data_ptr() == first + 8064  # the next 64-byte boundary in that chunk
    assert copies[2].data_ptr() % heap.HUGE_PAGE_BYTES == 0  # its own, larger chunk
    chunk = heap._arena[0]
    assert chunk() is not None
    del copies, c
    gc.collect()
    assert chunk() is None  # unmapped with its last copy
    view = bigger.t()  # not contiguous: left as it is
    assert heap.in_huge_pages(view) is view
    monkeypatch.setattr(heap, "_huge", False)
    assert heap.in_huge_pages(big) is big
    assert not heap.advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8))


def test_huge_pages_off_by_environment():
    out = subprocess.run(
        [sys.executable, "-c", "from specengine.ops.heap import huge_pages_available as h; "
                               "print(h())"],
        env={**os.environ, "SPECENGINE_HUGE_PAGES": "0"}, capture_output=True, text=True,
        check=True)
    assert out.stdout.strip() == "False"
