"""Adaptive thread count for the kernels' pool: measure, occasionally try one thread fewer or
more, keep the faster.

Why: with as many threads as cores, a decode step's kernels split every layer between the
caller and the pool's helpers (``csrc/pool.h``) and wait for the chunks the helpers claimed.
When another process keeps a core busy, a helper is regularly descheduled in the middle of a
chunk and the step waits for the scheduler to give it a core back (a time slice, milliseconds);
each of the ~150 pool jobs of a batch-1 step also wakes a sleeping helper that then competes
with the caller for a core. One thread fewer may then run faster; on a quiet machine the full
count is faster. (``LLM.get_metrics()["kernel_pool"]`` counts the caller's waits.) Neither
can be known in advance, and it changes while the engine runs (a trainer starting beside it),
so ``ThreadTuner`` measures it.

How: steps are grouped by forward size (bucket: ``rows.bit_length()``, i.e. powers of two of
the forward's tokens). Each bucket runs at its current count and, at a bounded rate, runs a
*probe*: ``samples`` steps at a neighbouring count interleaved with ``samples`` at the current
one (interleaving cancels slow drifts such as a growing context). If the candidate's median
step time beats the current one's by ``margin`` it becomes current. A probe starts every
``probe_every`` steps of the bucket, or earlier (never within ``min_gap`` steps of the last)
when the current count's recent median step time moved by more than ``drift`` from the one
the last probe measured: a neighbour came (steps slower) or went (faster; at the full count
there are no more threads to try, so that only re-bases the reference). A new bucket starts
from the count and the probe interval of the nearest bucket that has one, and probes after
``min_gap`` of its steps (the first bucket at once) unless that neighbour's probes lost big
(then after its interval): a policy trying a new draft size at once sees its first steps at
the count that is fastest for its neighbours, not a probe's. Cost: at most ``samples`` steps
at a worse count per ``probe_every`` (defaults: 4 per 128 steps, about 1-3% when the other
count is 1.5-2x slower). A probe whose candidate lost by more than ``drift`` doubles the
bucket's interval, up to ``max_backoff`` times ``probe_every`` (4 per 1024 steps by default,
0.2-0.4%): a change that large starts a probe early anyway; a switch or a close call resets
it. (Measured on a 2-core Intel Xeon, qwen2.5-0.5b RL rollouts of 16 samples shrinking to 1:
each engine probed one thread again in every new batch size and after every epoch's context
reset, 4 steps at 1.6-2x each, 2-4% of a bucket's time; the neighbours' verdict and the
direction rule leave the probes that can find something.)

Results do not depend on the count: the kernels split work over output features, rows and
heads only (``csrc/pool.h``: disjoint outputs), so the engine applies the tuner only to steps
whose whole forward runs in them (``kernels.packed_covers``) and torch stays at one thread
there. ``tests/test_threads.py`` checks both the controller and the invariance.

Off: ``SPECENGINE_ADAPTIVE_THREADS=0`` in the environment (read when an engine is built), or
``engine.threads.enabled = False``; then every step uses the full count.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field

from specengine.ops import kernels


def adaptive_from_env() -> bool:
    """False when ``SPECENGINE_ADAPTIVE_THREADS`` is ``0``/``false``/``off``/``no``, else True.

    Raises:
        ValueError: any other non-empty value."""
    v = os.environ.get("SPECENGINE_ADAPTIVE_THREADS", "").strip().lower()
    if v in ("", "1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"SPECENGINE_ADAPTIVE_THREADS={v!r}: use 1 (adapt, the default) or 0 "
                     "(always the full thread count)")


@dataclass
class _Bucket:
    current: int
    since_probe: int  # steps at ``current`` since the last probe ended
    backoff: int = 1  # periodic probes every ``backoff * probe_every`` steps
    warm: int = 0  # samples skipped so far (first steps pay for packing, page faults)
    candidate: int | None = None  # the count being probed
    cur: list[float] = field(default_factory=list)  # probe samples at current
    cand: list[float] = field(default_factory=list)  # probe samples at candidate
    ref: float | None = None  # median seconds at ``current`` measured by the last probe
    recent: list[float] = field(default_factory=list)  # latest seconds at current (drift)
    go_up: bool = False  # direction of the next probe when both are possible


class ThreadTuner:
    """Chooses the kernels' thread count per forward-size bucket from measured step times.

    Args:
        max_threads: the most threads (the count torch was given, typically the cores).
        clock: seconds, monotonic (``time.perf_counter``; tests inject a fake).
        enabled: False: always ``max_threads``.
        probe_every: steps of a bucket between probes when nothing changes (the probing cost
            is at most ``samples`` steps at a worse count per this many steps).
        samples: steps timed at each count per probe (the median decides).
        margin: fraction the candidate's median must beat the current's by to switch.
        drift: relative change of the current count's recent median (vs the last probe's)
            that starts a probe early; ``min_gap``: steps of a bucket at least between probes.
        warmup: first steps of each bucket not timed.
        max_backoff: most times ``probe_every`` the interval grows to while probes lose by
            more than ``drift`` (1: never grows).

    Raises:
        ValueError: ``max_threads`` < 1, ``samples`` < 1, ``probe_every`` < ``min_gap`` or a
            negative ``margin`` / ``drift`` / ``warmup``.
    """

    def __init__(self, max_threads: int, clock=time.perf_counter, enabled: bool = True,
                 probe_every: int = 128, samples: int = 4, margin: float = 0.05,
                 drift: float = 0.3, min_gap: int = 32, warmup: int = 2,
                 max_backoff: int = 8):
        if max_threads < 1:
            raise ValueError(f"max_threads={max_threads} must be >= 1")
        if samples < 1:
            raise ValueError(f"samples={samples} must be >= 1")
        if not 1 <= min_gap <= probe_every:
            raise ValueError(f"need 1 <= min_gap ({min_gap}) <= probe_every ({probe_every})")
        if max_backoff < 1:
            raise ValueError(f"max_backoff={max_backoff} must be >= 1")
        if margin < 0 or drift < 0 or warmup < 0:
            raise ValueError(f"margin ({margin}), drift ({drift}) and warmup ({warmup}) must "
                             "be >= 0")
        self.max_threads = max_threads
        self.clock = clock
        self.enabled = enabled
        self.probe_every, self.samples, self.margin = probe_every, samples, margin
        self.drift, self.min_gap, self.warmup = drift, min_gap, warmup
        self.max_backoff = max_backoff
        self.buckets: dict[int, _Bucket] = {}
        self.probes = 0
        self.switches = 0
        self.probe_step = False  # the step in ``step`` runs at a count being probed

    @staticmethod
    def bucket_of(rows: int) -> int:
        """The bucket of a forward of ``rows`` tokens: ``rows.bit_length()`` (1 for 1 token,
        2 for 2-3, 3 for 4-7, ...)."""
        return max(1, int(rows)).bit_length()

    def _bucket(self, rows: int) -> _Bucket:
        key = self.bucket_of(rows)
        b = self.buckets.get(key)
        if b is None:
            near = min(self.buckets, key=lambda k: (abs(k - key), k), default=None)
            if near is None:  # the first bucket: probe at once
                b = _Bucket(current=self.max_threads, since_probe=self.probe_every)
            else:  # the neighbour's count and interval; its verdict stands while it lost big
                n = self.buckets[near]
                due = self.probe_every - self.min_gap if n.backoff == 1 else 0
                b = _Bucket(current=n.current, since_probe=due, backoff=n.backoff)
            self.buckets[key] = b
        return b

    def choose(self, rows: int) -> int:
        """Threads for the next step of ``rows`` forward tokens (starts a probe when due)."""
        if not self.enabled or self.max_threads <= 1:
            return self.max_threads
        b = self._bucket(rows)
        if b.warm < self.warmup:
            return b.current
        if b.candidate is None and self._probe_due(b):
            b.candidate = self._candidate(b)
            b.cur, b.cand = [], []
        if b.candidate is not None:
            return b.candidate if len(b.cand) <= len(b.cur) else b.current
        return b.current

    def _probe_due(self, b: _Bucket) -> bool:
        if b.since_probe >= self.probe_every * b.backoff:
            return True
        if b.since_probe < self.min_gap or b.ref is None or len(b.recent) < self.samples:
            return False
        now = statistics.median(b.recent)
        if now > b.ref * (1.0 + self.drift):  # slower: fewer (or more) threads may win now
            return True
        if now < b.ref * (1.0 - self.drift):  # faster: only more threads could win now
            if b.current < self.max_threads:
                return True
            b.ref = now  # at the full count: the new normal, whose slowdowns count from here
        return False

    def _candidate(self, b: _Bucket) -> int:
        down, up = b.current - 1, b.current + 1
        if down < 1:
            return up
        if up > self.max_threads:
            return down
        b.go_up = not b.go_up
        return up if b.go_up else down

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """Report that a step of ``rows`` forward tokens took ``seconds`` with ``threads``."""
        if not self.enabled or self.max_threads <= 1:
            return
        b = self._bucket(rows)
        if b.warm < self.warmup:
            b.warm += 1
            return
        if b.candidate is None:
            if threads == b.current:
                b.since_probe += 1
                b.recent = (b.recent + [seconds])[-self.samples:]
            return
        if threads == b.candidate:
            b.cand.append(seconds)
        elif threads == b.current:
            b.cur.append(seconds)
        if len(b.cand) >= self.samples and len(b.cur) >= self.samples:
            cur, cand = statistics.median(b.cur), statistics.median(b.cand)
            self.probes += 1
            if cand < cur * (1.0 - self.margin):
                b.current, cur = b.candidate, cand
                self.switches += 1
                b.backoff = 1
            elif cand > cur * (1.0 + self.drift):  # lost big: probe this less often
                b.backoff = min(2 * b.backoff, self.max_backoff)
            else:
                b.backoff = 1
            b.candidate, b.since_probe, b.ref, b.recent = None, 0, cur, []

    @contextlib.contextmanager
    def timed(self, rows: int, threads: int):
        """Time the block with ``clock`` and ``record`` it as a step of ``rows`` tokens run
        with ``threads`` (not recorded if the block raises)."""
        t0 = self.clock()
        yield
        self.record(rows, threads, self.clock() - t0)

    @contextlib.contextmanager
    def step(self, rows: int):
        """Run the block as an engine step of at most ``rows`` forward tokens: when every layer
        runs in the extension's kernels (``kernels.packed_covers``), inside
        ``kernels.kernel_threads`` at the count ``choose`` gives, timed and ``record``-ed;
        otherwise inside ``kernels.kernel_threads(False)`` (torch's threads), untimed.
        Inside it ``probe_step`` says whether that count is a probe's rather than the bucket's
        current one (the step's time then says little about the steps that follow; the
        policy does not learn from it)."""
        if not kernels.packed_covers(rows):
            with kernels.kernel_threads(False):
                yield
            return
        threads = self.choose(rows)
        self.probe_step = threads != self._bucket(rows).current
        try:
            with kernels.kernel_threads(True, threads), self.timed(rows, threads):
                yield
        finally:
            self.probe_step = False

    def stats(self) -> dict:
        """``kernel_threads`` (bucket's token range ``"lo-hi"`` -> the count its steps use,
        probes aside),
        ``kernel_threads_max``, ``thread_probes`` (probes decided), ``thread_switches`` and
        ``adaptive_threads`` (enabled)."""
        on = self.enabled and self.max_threads > 1
        per = {f"{1 << (k - 1)}-{(1 << k) - 1}": b.current if on else self.max_threads
               for k, b in sorted(self.buckets.items())}
        return {"kernel_threads": per, "kernel_threads_max": self.max_threads,
                "thread_probes": self.probes, "thread_switches": self.switches,
                "adaptive_threads": self.enabled}
