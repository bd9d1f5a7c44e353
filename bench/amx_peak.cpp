// What one core's AMX tile unit computes per second, by operand data: TDPBF16PS (16 x 16 x 32
// bf16 products into float32, 16384 FLOP) on 2x2 blocks of C tiles, as csrc/linear_amx.cpp runs
// them, with operands that stay in L1 (8 KiB of A and 8 KiB of B tiles, cycled), C zeroed every
// 18 K steps (K = 576, SmolLM2's hidden size) so the sums stay finite, as a linear layer's do.
//
//   g++ -O2 -pthread bench/amx_peak.cpp -o /tmp/amx_peak && /tmp/amx_peak [threads]
//
// Prints TFLOP/s per thread for zero, constant (1.0) and random normal operands, 64-byte aligned
// (every tile row one cache line), and for random normal operands 16 bytes off that alignment
// (every tile row split over two lines). Linux x86-64 with AMX-BF16 only;
// bench/bench_kernels.py --peak builds and runs it. An earlier version kept the operands in
// std::vectors (16-byte aligned): the rate then followed where each vector happened to start,
// which it had read as a dependence on the operand data.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#define AMX __attribute__((target("amx-tile,amx-bf16")))

namespace {

struct TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int kTiles = 8;   // A and B tiles each: 8 x 1 KiB
constexpr int kSteps = 18;  // K steps of 32 between zeroings of C

AMX double tflops(const uint16_t* a, const uint16_t* b, long blocks) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  alignas(64) float c[4][256];
  const auto t0 = std::chrono::steady_clock::now();
  for (long j = 0; j < blocks; ++j) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < kSteps; ++k) {
      const uint16_t* ak = a + (k % (kTiles / 2)) * 1024;
      const uint16_t* bk = b + (k % (kTiles / 2)) * 1024;
      _tile_loadd(4, ak, 64);
      _tile_loadd(6, bk, 64);
      _tile_loadd(7, bk + 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, ak + 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return blocks * kSteps * 4 * 16384.0 / s / 1e12;
}

uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

int main(int argc, char** argv) {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::fprintf(stderr, "AMX tiles are not available (arch_prctl failed)\n");
    return 1;
  }
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  std::mt19937 gen(0);
  std::normal_distribution<float> normal(0.f, 1.f);
  const size_t n = kTiles * 512;
  // one 64-byte aligned buffer per operand set, with room for the misaligned copies
  auto buffer = [&](float v, bool random) {
    auto* p = static_cast<uint16_t*>(std::aligned_alloc(64, (n + 64) * sizeof(uint16_t)));
    for (size_t i = 0; i < n + 64; ++i) p[i] = random ? bf16(normal(gen)) : bf16(v);
    return p;
  };
  uint16_t *zero = buffer(0.f, false), *one = buffer(1.f, false);
  uint16_t *ra = buffer(0.f, true), *rb = buffer(0.f, true);
  const struct {
    const char* name;
    const uint16_t *a, *b;
  } cases[] = {{"random normal", ra, rb},
               {"zeros", zero, zero},
               {"ones", one, one},
               {"random +16 B", ra + 8, rb + 8}};
  for (const auto& k : cases) {
    std::vector<double> out(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] { out[t] = tflops(k.a, k.b, 40000); });
    for (auto& t : pool) t.join();
    std::printf("%-14s", k.name);
    for (double v : out) std::printf("  %.2f", v);
    std::printf("  TFLOP/s per thread (%d threads)\n", threads);
  }
  return 0;
}
