// Thread pool for the decode-sized kernels.
//
// parallel_chunks(n, f) calls f(i) once for each i in [0, n) and returns when all calls are
// done. By default the chunks run in an OpenMP parallel region, on torch's own OpenMP threads
// (at::get_num_threads()), claimed one by one from an atomic counter. Sharing torch's threads
// matters: a second pool would compete with OpenMP workers that spin after every torch op, and
// on a 2-core machine that halves the speed of both (measured: a memory-bound linear ran at 15
// instead of 30 GB/s).
//
// SPECENGINE_POOL=spin selects our own work-claiming pool instead, for machines whose other
// cores are busy: an OpenMP region ends in a barrier, so there a call waits for the slowest
// thread to be scheduled at all (24 ms for a 30 us linear, measured on a loaded 2-core machine),
// while with this pool the caller only waits for chunks a helper has already claimed. Its helpers
// spin briefly (SPECENGINE_SPIN_US, default 200 us) before sleeping.
//
// Which thread runs which chunk varies from call to call: f must write disjoint outputs (results
// then do not depend on the schedule). f must not throw. Nested calls and calls with one thread
// run inline.
#pragma once

#include <cstdint>
#include <type_traits>

namespace specengine {

using ChunkFn = void (*)(void* ctx, int64_t chunk);

void parallel_chunks_impl(int64_t n, ChunkFn fn, void* ctx);

// Threads the pool would use for a call now (at::get_num_threads(), at least 1).
int pool_threads();

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
