// A small work-claiming thread pool for the decode-sized kernels.
//
// Why not at::parallel_for (OpenMP): a parallel region ends in a barrier, so on a machine whose
// other cores are busy a call waits for the slowest OpenMP thread to be scheduled at all
// (milliseconds per call, measured: 24 ms for a 30 us linear on a loaded 2-core machine). Here
// the caller claims chunks itself from an atomic counter and only waits for chunks that a helper
// has already claimed (and is running); a helper that wakes up late finds no work and goes back
// to waiting. Helpers spin briefly (SPECENGINE_SPIN_US, default 200 us) before sleeping, so the
// back-to-back kernel calls of a decode step do not pay for a wake-up each. On a shared machine:
// a caller left waiting for a claimed chunk spins briefly and then sleeps (its idle core is
// where the kernel can run the descheduled helper), and a helper that keeps missing jobs it saw
// while spinning (it was not on a core) stops spinning until it runs a chunk again. Which
// thread count is faster then is measured by the engine (specengine/threads.py).
//
// parallel_chunks(n, f) calls f(i) once for each i in [0, n), on the caller and up to
// pool_threads() - 1 helpers; it returns when all calls are done. Which thread runs
// which chunk varies from call to call: f must write disjoint outputs (results then do not
// depend on the schedule). f must not throw. Nested calls and calls with one thread run inline.
#pragma once

#include <cstdint>
#include <type_traits>

namespace specengine {

using ChunkFn = void (*)(void* ctx, int64_t chunk);

void parallel_chunks_impl(int64_t n, ChunkFn fn, void* ctx);

// Threads the pool would use for a call now: the count given to set_pool_threads, or (0, the
// default) at::get_num_threads(); at least 1.
int pool_threads();
// The engine sets its own count so it can run decode steps with torch's OpenMP pool at one
// thread: OpenMP workers spin for milliseconds after every parallel torch op, and on a machine
// with as many threads as cores they would take turns with these helpers (measured: a
// memory-bound linear at 15 instead of 30 GB/s on 2 cores).
void set_pool_threads(int n);

// Counters since start (or the last reset), to see what a job waits for: jobs run on the pool,
// chunks run by helpers, jobs whose caller had to wait for a helper's claimed chunk after its
// own work (and how many of those it slept through), the caller's total wait in nanoseconds,
// and helper wake-ups that found the job already done while spinning (a late helper: it was
// not on a core).
struct PoolStats {
  int64_t jobs, helper_chunks, waits, sleeps, wait_ns, late_helpers;
};
PoolStats pool_stats(bool reset);

template <class F>
void parallel_chunks(int64_t n, F&& f) {
  if (n <= 0) return;
  using Fn = std::remove_reference_t<F>;
  parallel_chunks_impl(
      n, [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

// Split [0, total) into about `per_thread` chunks per pool thread, each at least `grain` long;
// calls f(begin, end) per chunk.
template <class F>
void parallel_ranges(int64_t total, int64_t grain, int per_thread, F&& f) {
  if (total <= 0) return;
  grain = grain < 1 ? 1 : grain;
  int64_t chunks = static_cast<int64_t>(pool_threads()) * per_thread;
  const int64_t max_chunks = (total + grain - 1) / grain;
  if (chunks > max_chunks) chunks = max_chunks;
  if (chunks <= 1) return f(int64_t{0}, total);
  const int64_t base = total / chunks, extra = total % chunks;
  parallel_chunks(chunks, [&](int64_t c) {
    const int64_t b = c * base + (c < extra ? c : extra);
    f(b, b + base + (c < extra ? 1 : 0));
  });
}

}  // namespace specengine
