"""Sleep and wake: give a colocated trainer the engine's memory between rollouts (vLLM's
``sleep``/``wake_up``, SGLang's ``release_memory_occupation``/``resume_memory_occupation``).

``sleep(1)`` releases the KV caches (the target's, and a drafter's) and moves the target's
weights out of the engine's working set: on CPU into an anonymous temporary file (unlinked,
so nothing is left behind; the process's resident memory drops), on CUDA into pinned host
memory; the kernels' packed weight copies are dropped and rebuilt on use. ``sleep(2)`` releases
the KV caches and discards the target's weights: new ones must be loaded (a weight update)
before generating. ``wake_up(tags)`` brings back ``"weights"`` and/or ``"kv_cache"``
(``"cuda_graph"``, SGLang's tag, is accepted and means nothing here); after a level-2 sleep,
waking the weights only re-allocates them and generation stays refused until every tensor has
been loaded again. A drafter's own weights (an EAGLE layer, a draft model) are never released:
only the tensors an EAGLE drafter shares with the target follow it.

Released tensors keep their Python objects (and every view of them): only their storage is
resized to 0 bytes and back, so nothing that holds a reference needs rebuilding. Tensors staged
by an open weight update session (``weights.py``) are not released.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile

import torch

from specengine.ops.heap import advise_huge_pages

TAGS = ("weights", "kv_cache", "cuda_graph")


def process_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (Linux ``/proc/self/statm``), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``); small tensors are freed
    into malloc's heap, where they would still count as resident."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _release(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


class MemoryManager:
    """Sleep state of one ``Engine`` (what ``LLM.sleep`` / ``wake_up`` drive).

    Args:
        engine: the engine; its ``model`` is the target, its ``releasable_tensors`` the KV
            pools (the target's, and those of its drafters), its ``packed_weights`` the
            kernels' packed copies (``drop_packed`` forgets them).
        offload_dir: directory of the temporary file that holds a CPU engine's weights during
            a level-1 sleep (default: the system temp directory; on a tmpfs the bytes stay in
            RAM, outside the process).

    Attributes:
        weights: ``"resident"``, ``"offloaded"`` (level 1) or ``"discarded"`` (level 2).
        kv_resident: False while the KV caches are released.
        missing: HF names of target tensors not loaded since a level-2 sleep discarded them.
    """

    def __init__(self, engine, offload_dir: str | os.PathLike | None = None):
        self.engine = engine
        self.offload_dir = offload_dir
        self.weights = "resident"
        self.kv_resident = True
        self.level = 0
        self.missing: set[str] = set()
        self._names = list(self.model.hf_parameters())  # (no views of released storage later)
        self._saved = None  # ("file", file, [(tensor, nbytes)]) or ("host", [(tensor, copy)])
        self._kv_sizes: list[tuple[torch.Tensor, int]] = []
        self._weight_sizes: list[tuple[torch.Tensor, int]] = []

    # ---- what is managed --------------------------------------------------------------------
    @property
    def model(self):
        return self.engine.model

    def _weight_tensors(self) -> list[torch.Tensor]:
        """The target's parameters (``parameters()`` lists a tied LM head once)."""
        return list(self.model.parameters())

    def _kv_tensors(self) -> list[torch.Tensor]:
        return self.engine.releasable_tensors()

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held now: ``weights`` (the target's parameters), ``packed`` (their kernel
        copies), ``kv_cache`` (the target's and drafter's KV pools), and ``total``."""
        w = sum(_nbytes(t) for t in self._weight_tensors())
        packs = self.engine.packed_weights()
        p = sum(_nbytes(pw.packed) for pw in packs if pw is not None and pw.packed is not None)
        kv = sum(_nbytes(t) for t in self._kv_tensors())
        return {"weights": w, "packed": p, "kv_cache": kv, "total": w + p + kv}

    # ---- sleep / wake -----------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.weights != "resident" or not self.kv_resident

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Release the KV caches and offload (level 1) or discard (level 2) the target's
        weights. Sleeping again is allowed (a level-2 sleep after a level-1 one drops the
        offloaded copy; a level-1 sleep never brings discarded weights back).

        Returns:
            bytes released per kind, as ``resident_bytes`` (before minus after).

        Raises:
            ValueError: ``level`` not 1 or 2.
            RuntimeError: requests are in flight (finish or abort them first).
        """
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"sleep: level must be 1 (offload weights) or 2 (discard "
                             f"weights), got {level!r}")
        if self.engine.has_unfinished():
            raise RuntimeError("sleep: requests are in flight; finish or abort them first")
        before = self.resident_bytes()
        if self.kv_resident:
            self.engine.reset_prefix_cache()
            self._kv_sizes = [(t, _nbytes(t)) for t in self._kv_tensors()]
            for t, _ in self._kv_sizes:
                _release(t)
            self.kv_resident = False
        if self.weights == "resident":
            self.engine.drop_packed()
            self._weight_sizes = [(t, _nbytes(t)) for t in self._weight_tensors()]
            if level == 1:
                self._save()
            for t, _ in self._weight_sizes:
                _release(t)
            self.weights = "offloaded" if level == 1 else "discarded"
        if level == 2 and self.weights == "offloaded":
            self._saved = self._close(self._saved)
            self.weights = "discarded"
        if self.weights == "discarded":
            self.missing = set(self._names)
        self.level = max(self.level, level)
        if self.engine.model.device.type == "cuda":
            torch.cuda.empty_cache()
        _trim_heap()
        after = self.resident_bytes()
        return {k: before[k] - after[k] for k in before}

    def wake_up(self, tags=None) -> None:
        """Bring back ``tags`` (None: everything; a list/tuple/set of ``"weights"``,
        ``"kv_cache"``, ``"cuda_graph"``; one tag as a str is accepted). Waking what is
        awake does nothing. Discarded weights are only re-allocated: generation stays refused
        until a weight update has loaded every tensor.

        Raises:
            ValueError: an unknown tag (the message lists the known ones) or a bad ``tags``.
        """
        if tags is None:
            tags = TAGS
        elif isinstance(tags, str):
            tags = [tags]
        elif not isinstance(tags, (list, tuple, set, frozenset)):
            raise ValueError(f"wake_up: tags must be None or a list of {list(TAGS)}, "
                             f"got {type(tags).__name__}")
        bad = [t for t in tags if t not in TAGS]
        if bad:
            raise ValueError(f"wake_up: unknown tags {bad}; known tags: {list(TAGS)}")
        if "weights" in tags:
            self.ensure_weights_resident()
        if "kv_cache" in tags and not self.kv_resident:
            for t, n in self._kv_sizes:
                t.untyped_storage().resize_(n)
                advise_huge_pages(t)
                t.zero_()  # as allocated at start (padding slots are read, masked)
            self._kv_sizes = []
            self.kv_resident = True
            self.engine.reset_prefix_cache()
        if not self.is_sleeping:
            self.level = 0

    def ensure_weights_resident(self) -> None:
        """Make the target's weights usable storage again: read back the offloaded copy, or
        re-allocate discarded ones (contents undefined until loaded; ``missing`` lists them).
        A weight update calls this before applying, so it also wakes the weights."""
        if self.weights == "resident":
            return
        for t, n in self._weight_sizes:
            t.untyped_storage().resize_(n)
        if self.weights == "offloaded":
            self._restore()
        self._weight_sizes = []
        self.weights = "resident"
        if not self.is_sleeping:
            self.level = 0

    def mark_loaded(self, names) -> None:
        """Tensors loaded by a weight update (no longer ``missing``)."""
        self.missing.difference_update(names)

    def check_ready(self) -> None:
        """Raise RuntimeError unless the engine can generate now (awake, weights loaded)."""
        if self.is_sleeping:
            parts = []
            if self.weights != "resident":
                parts.append(f"weights {self.weights}")
            if not self.kv_resident:
                parts.append("KV cache released")
            raise RuntimeError(f"the engine is asleep (sleep(level={self.level}): "
                               f"{', '.join(parts)}); call wake_up() before generating")
        if self.missing:
            n = len(self.missing)
            raise RuntimeError(
                f"the target's weights were discarded by sleep(level=2) and {n} of "
                f"{len(self._names)} tensors have not been loaded since "
                f"(e.g. {sorted(self.missing)[:3]}): load new weights (update_weights, "
                "load_weights or a begin/finish_weight_update session) before generating")

    # ---- offload storage --------------------------------------------------------------------
    def _save(self) -> None:
        """Copy the weights out before their storage is released: CUDA -> pinned host
        tensors, CPU -> an anonymous temporary file (raw bytes, in order)."""
        if self.engine.model.device.type == "cuda":
            host = []
            for t, _ in self._weight_sizes:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t)
                host.append((t, h))
            self._saved = ("host", host)
            return
        f = tempfile.TemporaryFile(dir=self.offload_dir)
        try:
            for t, _ in self._weight_sizes:
                f.write(memoryview(_bytes_view(t)))
            f.flush()
        except BaseException:
            f.close()
            raise
        self._saved = ("file", f)

    def _restore(self) -> None:
        kind, store = self._saved
        if kind == "host":
            for t, h in store:
                t.copy_(h)
        else:
            store.seek(0)
            for t, _ in self._weight_sizes:
                buf = memoryview(_bytes_view(t))
                done = 0
                while done < len(buf):
                    got = store.readinto(buf[done:])
                    if not got:
                        raise RuntimeError("wake_up: the offloaded weights file is truncated")
                    done += got
        self._saved = self._close(self._saved)

    @staticmethod
    def _close(saved):
        if saved is not None and saved[0] == "file":
            saved[1].close()
        return None


def _bytes_view(t: torch.Tensor):
    """The raw bytes of contiguous CPU tensor ``t`` as a writable ctypes array sharing its
    memory (not ``numpy()``: exporting to numpy makes the storage non-resizable for good)."""
    if not t.is_contiguous():
        raise RuntimeError("memory: only contiguous weights can be offloaded")
    return (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())
