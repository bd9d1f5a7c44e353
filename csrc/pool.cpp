// Work-claiming thread pool; see pool.h for why and how.
#include "pool.h"

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace specengine {
namespace {

// Claim word: generation (32 bits) | chunk count (16 bits) | next chunk (16 bits). A claim is a
// CAS that succeeds only for the current generation and an unclaimed chunk, so a late helper
// can never run a chunk of a job that has moved on.
constexpr uint64_t kMask16 = 0xffff;
inline uint64_t pack(uint64_t gen, uint64_t n, uint64_t next) {
  return (gen << 32) | (n << 16) | next;
}

// Spin-wait hint: x86 PAUSE, Arm YIELD, nothing on other CPUs.
inline void spin_pause() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

int spin_us() {
  static const int us = [] {
    const char* s = std::getenv("SPECENGINE_SPIN_US");
    return s ? std::atoi(s) : 200;
  }();
  return us;
}

thread_local bool in_pool_job = false;

struct Pool {
  std::atomic<uint64_t> word{0};
  std::atomic<uint32_t> gen{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> sleepers{0};
  std::atomic<int> active{0};  // helpers with index < active take part in the current job
  std::atomic<int64_t> n_jobs{0}, n_helper_chunks{0}, n_waits{0}, n_sleeps{0}, n_wait_ns{0},
      n_late{0};  // PoolStats (relaxed counters)
  std::atomic<bool> caller_waits{false};  // the caller sleeps on done_cv for claimed chunks
  ChunkFn fn = nullptr;
  void* ctx = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  std::condition_variable done_cv;
  std::mutex call_mu;  // one job at a time (callers from several Python threads queue here)
  std::vector<std::thread> helpers;

  // Runs chunks of generation g while there are any; returns how many it ran.
  int64_t work(uint32_t g) {
    int64_t ran = 0;
    uint64_t w = word.load(std::memory_order_acquire);
    for (;;) {
      if ((w >> 32) != g || (w & kMask16) >= ((w >> 16) & kMask16)) break;
      if (!word.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire))
        continue;
      fn(ctx, static_cast<int64_t>(w & kMask16));
      done.fetch_add(1);  // seq_cst: pairs with caller_waits (no lost wake-up)
      if (caller_waits.load()) {
        { std::lock_guard<std::mutex> lock(mu); }
        done_cv.notify_all();
      }
      ++ran;
      w = word.load(std::memory_order_acquire);
    }
    return ran;
  }

  void helper_loop(int index) {
    in_pool_job = true;
    uint32_t seen = gen.load();
    // Jobs in a row this helper saw while spinning yet joined too late to run a chunk of: a
    // spinning helper that misses a job was not on a core (another process is busy), and its
    // spinning then only takes time from the caller or that process, so after two such misses
    // it sleeps at once after each job until it runs a chunk again. (A helper woken from sleep
    // may miss a short job by the wake-up latency alone; that is not counted.)
    int misses = 0;
    for (;;) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto limit = std::chrono::microseconds(misses >= 2 ? 0 : spin_us());
      uint32_t g = gen.load(std::memory_order_acquire);
      for (int i = 0; g == seen; ++i) {
        spin_pause();
        if ((i & 63) == 63 && std::chrono::steady_clock::now() - t0 > limit) break;
        g = gen.load(std::memory_order_acquire);
      }
      const bool spun = g != seen;
      if (g == seen) {
        std::unique_lock<std::mutex> lock(mu);
        sleepers.fetch_add(1);
        cv.wait(lock, [&] { return gen.load() != seen; });
        sleepers.fetch_sub(1);
        g = gen.load();
      }
      seen = g;
      if (index < active.load(std::memory_order_acquire)) {
        const int64_t ran = work(g);
        n_helper_chunks.fetch_add(ran, std::memory_order_relaxed);
        if (ran > 0) {
          misses = 0;
        } else if (spun) {
          ++misses;
          n_late.fetch_add(1, std::memory_order_relaxed);
        }
      }
    }
  }

  void ensure_helpers(int n) {
    while (static_cast<int>(helpers.size()) < n) {
      const int index = static_cast<int>(helpers.size());
      helpers.emplace_back([this, index] { helper_loop(index); });
      helpers.back().detach();
    }
  }

  void run(int64_t n, ChunkFn f, void* c, int threads) {
    std::lock_guard<std::mutex> guard(call_mu);
    ensure_helpers(threads - 1);
    fn = f;
    ctx = c;
    done.store(0, std::memory_order_relaxed);
    active.store(threads - 1, std::memory_order_relaxed);
    const uint32_t g = gen.load() + 1;
    word.store(pack(g, static_cast<uint64_t>(n), 0), std::memory_order_release);
    gen.store(g);  // seq_cst: pairs with sleepers (no lost wake-up)
    if (sleepers.load() > 0) {
      { std::lock_guard<std::mutex> lock(mu); }
      cv.notify_all();
    }
    in_pool_job = true;
    work(g);
    in_pool_job = false;
    // Only chunks a helper has claimed are left. Spin briefly (a running helper finishes in
    // microseconds), then sleep: a helper that was descheduled mid-chunk needs a core, and a
    // caller spinning or yielding would keep its own core busy (the idle core is what lets
    // the kernel move the helper over).
    n_jobs.fetch_add(1, std::memory_order_relaxed);
    if (done.load(std::memory_order_acquire) >= n) return;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 4096 && done.load(std::memory_order_acquire) < n; ++i) spin_pause();
    if (done.load(std::memory_order_acquire) < n) {
      std::unique_lock<std::mutex> lock(mu);
      caller_waits.store(true);  // seq_cst: pairs with the helpers' done.fetch_add
      done_cv.wait(lock, [&] { return done.load() >= n; });
      caller_waits.store(false);
      n_sleeps.fetch_add(1, std::memory_order_relaxed);
    }
    n_waits.fetch_add(1, std::memory_order_relaxed);
    n_wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - t0).count(),
                        std::memory_order_relaxed);
  }
};

Pool* g_pool = nullptr;

void reset_after_fork() { g_pool = nullptr; }  // the child has no helper threads: leak the old

Pool& pool() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, reset_after_fork); });
  if (!g_pool) g_pool = new Pool();
  return *g_pool;
}

}  // namespace

std::atomic<int> g_threads{0};

int pool_threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  return std::max(1, n > 0 ? n : at::get_num_threads());
}

PoolStats pool_stats(bool reset) {
  Pool& p = pool();
  auto get = [reset](std::atomic<int64_t>& c) {
    return reset ? c.exchange(0) : c.load(std::memory_order_relaxed);
  };
  return {get(p.n_jobs), get(p.n_helper_chunks), get(p.n_waits), get(p.n_sleeps),
          get(p.n_wait_ns), get(p.n_late)};
}

void set_pool_threads(int n) { g_threads.store(std::max(0, n), std::memory_order_relaxed); }

void parallel_chunks_impl(int64_t n, ChunkFn fn, void* ctx) {
  const int threads = pool_threads();
  if (n == 1 || threads <= 1 || in_pool_job || n > static_cast<int64_t>(kMask16)) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
    return;
  }
  pool().run(n, fn, ctx, threads);
}

}  // namespace specengine
