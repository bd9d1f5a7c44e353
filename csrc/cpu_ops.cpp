// Memory-bound CPU ops for small token counts: linear (bf16 via AVX-512 BF16 dot products,
// fp32 via portable vectors), RMSNorm (Zhang & Sennrich 2019), fused residual add + RMSNorm,
// SiLU-and-multiply (SwiGLU, Shazeer 2020).
//
// linear reads each weight row once for all M rows: the output is tiled into 4 rows x 4
// features; a thread owns a contiguous range of output features. Every output element is one
// dot product accumulated over K in a fixed order (16 lanes, then a fixed horizontal sum), so
// row i of linear(x) equals linear(x[i:i+1]) bit for bit whatever M is (batch invariance).
#include <algorithm>
#include <cmath>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "pool.h"
#include "vec.h"

namespace specengine {
namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kTileM = 4, kTileN = 4;

bool has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool ok = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return ok;
#else
  return false;
#endif
}

// ---- bf16: AVX-512 BF16 ------------------------------------------------------------------
#if defined(__x86_64__) && defined(__GNUC__)
#define SE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

template <int MB, int NB>
SE_BF16_TARGET inline void bf16_tile(const LinearArgs& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const auto* x = static_cast<const uint16_t*>(a.x) + m0 * K;
  const auto* w = static_cast<const uint16_t*>(a.w) + n0 * K;
  __m512 acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mk = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512i wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_epi16(mk, w + j * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mk, x + i * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const float s = _mm512_reduce_add_ps(acc[i][j]);  // fixed tree order
      a.y[(m0 + i) * a.N + n0 + j] = a.b ? s + a.b[n0 + j] : s;
    }
}

template <int NB>
SE_BF16_TARGET inline void bf16_column(const LinearArgs& a, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) bf16_tile<4, NB>(a, m, n0);
  switch (a.M - m) {
    case 3: bf16_tile<3, NB>(a, m, n0); break;
    case 2: bf16_tile<2, NB>(a, m, n0); break;
    case 1: bf16_tile<1, NB>(a, m, n0); break;
    default: break;
  }
}

SE_BF16_TARGET void linear_bf16_range(const LinearArgs& a, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kTileN <= n_end; n += kTileN) bf16_column<kTileN>(a, n);
  for (; n < n_end; ++n) bf16_column<1>(a, n);
}
#endif

// ---- fp32 (and the bf16 fallback without AVX-512 BF16): portable vectors ------------------
template <class T, int MB, int NB>
SE_INLINE void vec_tile(const LinearArgs& a, int64_t m0, int64_t n0) {
  const T* x = static_cast<const T*>(a.x) + m0 * a.K;
  const T* w = static_cast<const T*>(a.w) + n0 * a.K;
  f32x16 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = f32x16{};
  int64_t k = 0;
  for (; k + 16 <= a.K; k += 16) {
    f32x16 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load16(w + j * a.K + k);
    for (int i = 0; i < MB; ++i) {
      const f32x16 xv = load16(x + i * a.K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t kk = k; kk < a.K; ++kk)
        s += to_float(x[i * a.K + kk]) * to_float(w[j * a.K + kk]);
      a.y[(m0 + i) * a.N + n0 + j] = a.b ? s + a.b[n0 + j] : s;
    }
}

template <class T, int NB>
SE_INLINE void vec_column(const LinearArgs& a, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) vec_tile<T, 4, NB>(a, m, n0);
  switch (a.M - m) {
    case 3: vec_tile<T, 3, NB>(a, m, n0); break;
    case 2: vec_tile<T, 2, NB>(a, m, n0); break;
    case 1: vec_tile<T, 1, NB>(a, m, n0); break;
    default: break;
  }
}

template <class T>
SE_INLINE void vec_range(const LinearArgs& a, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kTileN <= n_end; n += kTileN) vec_column<T, kTileN>(a, n);
  for (; n < n_end; ++n) vec_column<T, 1>(a, n);
}

SE_CLONES void linear_f32_range(const LinearArgs& a, int64_t n0, int64_t n1) {
  vec_range<float>(a, n0, n1);
}
SE_CLONES void linear_bf16_portable_range(const LinearArgs& a, int64_t n0, int64_t n1) {
  vec_range<bf16>(a, n0, n1);
}

// ---- norms and activations -----------------------------------------------------------------
template <class T>
SE_INLINE void rms_row(const T* x, const T* w, T* out, int64_t D, float eps) {
  f32x16 acc{};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    const f32x16 v = load16(x + i);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; i < D; ++i) ss += to_float(x[i]) * to_float(x[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t j = 0; j < D; ++j) out[j] = static_cast<T>(to_float(x[j]) * inv * to_float(w[j]));
}

template <class T>
SE_INLINE void rms_rows(const T* x, const T* res, const T* w, T* out, T* new_res, int64_t r0,
                        int64_t r1, int64_t D, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * D;
    if (res) {  // new residual = x + residual, rounded to T before normalising (as in torch)
      for (int64_t j = 0; j < D; ++j)
        new_res[r * D + j] = static_cast<T>(to_float(xr[j]) + to_float(res[r * D + j]));
      xr = new_res + r * D;
    }
    rms_row(xr, w, out + r * D, D, eps);
  }
}

SE_CLONES void rms_rows_f32(const float* x, const float* res, const float* w, float* out,
                            float* nr, int64_t r0, int64_t r1, int64_t D, float eps) {
  rms_rows(x, res, w, out, nr, r0, r1, D, eps);
}
SE_CLONES void rms_rows_bf16(const bf16* x, const bf16* res, const bf16* w, bf16* out, bf16* nr,
                             int64_t r0, int64_t r1, int64_t D, float eps) {
  rms_rows(x, res, w, out, nr, r0, r1, D, eps);
}

// silu(g) is rounded to T before the product, like torch's F.silu(gate) * up in T; 16 lanes
// use vsilu (vec.h), a scalar tail std::exp.
template <class T>
SE_INLINE void silu_mul_rows(const T* x, T* out, int64_t r0, int64_t r1, int64_t d) {
  for (int64_t r = r0; r < r1; ++r) {
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
      const f32x16 act = vsilu(load16(x + r * 2 * d + j));
      const f32x16 up = load16(x + r * 2 * d + d + j);
      for (int i = 0; i < 16; ++i) {
        const T a = static_cast<T>(act[i]);
        out[r * d + j + i] = static_cast<T>(to_float(a) * to_float(up[i]));
      }
    }
    for (; j < d; ++j) {
      const float g = to_float(x[r * 2 * d + j]);
      const T act = static_cast<T>(g / (1.f + std::exp(-g)));
      out[r * d + j] = static_cast<T>(to_float(act) * to_float(x[r * 2 * d + d + j]));
    }
  }
}

// In-place rotate-half RoPE of rows x[t, h, :] (D contiguous) with cos/sin [T, D] float32
// (sin signed: [-sin, sin]), in float32 with one rounding to T.
template <class T>
SE_INLINE void rope_rows(T* x, const float* cos, const float* sin, int64_t t0, int64_t t1,
                         int64_t H, int64_t D, int64_t sx_t, int64_t sx_h, int64_t sc, int64_t ss) {
  const int64_t half = D / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const float* c = cos + t * sc;
    const float* s = sin + t * ss;
    for (int64_t h = 0; h < H; ++h) {
      T* r = x + t * sx_t + h * sx_h;
      int64_t i = 0;
      for (; i + 16 <= half; i += 16) {
        const f32x16 a = load16(r + i), b = load16(r + half + i);
        const f32x16 lo = a * load16(c + i) + b * load16(s + i);
        const f32x16 hi = b * load16(c + half + i) + a * load16(s + half + i);
        for (int j = 0; j < 16; ++j) {
          r[i + j] = static_cast<T>(lo[j]);
          r[half + i + j] = static_cast<T>(hi[j]);
        }
      }
      for (; i < half; ++i) {
        const float a = to_float(r[i]), b = to_float(r[half + i]);
        r[i] = static_cast<T>(a * c[i] + b * s[i]);
        r[half + i] = static_cast<T>(b * c[half + i] + a * s[half + i]);
      }
    }
  }
}

SE_CLONES void rope_rows_f32(float* x, const float* c, const float* s, int64_t t0, int64_t t1,
                             int64_t H, int64_t D, int64_t a, int64_t b, int64_t sc, int64_t ss) {
  rope_rows(x, c, s, t0, t1, H, D, a, b, sc, ss);
}
SE_CLONES void rope_rows_bf16(bf16* x, const float* c, const float* s, int64_t t0, int64_t t1,
                              int64_t H, int64_t D, int64_t a, int64_t b, int64_t sc,
                              int64_t ss) {
  rope_rows(x, c, s, t0, t1, H, D, a, b, sc, ss);
}

}  // namespace

const char* cpu_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (has_avx512_bf16()) return "avx512_bf16";
  if (__builtin_cpu_supports("avx512f")) return "avx512";
  if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
  return "generic";
}

void linear_kernel(const LinearArgs& a, bool is_bf16) {
  const int64_t N = a.N, K = a.K;
  [[maybe_unused]] const bool fast_bf16 = is_bf16 && has_avx512_bf16() && isa_cap() >= kIsaAvx512;  // x86-64
  // Ranges of whole 4-feature tiles per thread; ~64 KiB of weights per task at least.
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  const int64_t element_size = is_bf16 ? 2 : 4;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kTileN * K * element_size));
  parallel_ranges(tiles, grain, 4, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kTileN, n1 = std::min(N, t1 * kTileN);
#if defined(__x86_64__) && defined(__GNUC__)
    if (fast_bf16) return linear_bf16_range(a, n0, n1);
#endif
    if (is_bf16) return linear_bf16_portable_range(a, n0, n1);
    linear_f32_range(a, n0, n1);
  });
}

void rope_kernel(void* x, bool is_bf16, const float* cos, const float* sin, int64_t T,
                 int64_t H, int64_t D, int64_t sx_t, int64_t sx_h, int64_t sc, int64_t ss) {
  auto run = [&](int64_t t0, int64_t t1) {
    if (!is_bf16)
      rope_rows_f32(static_cast<float*>(x), cos, sin, t0, t1, H, D, sx_t, sx_h, sc, ss);
    else
      rope_rows_bf16(static_cast<bf16*>(x), cos, sin, t0, t1, H, D, sx_t, sx_h, sc, ss);
  };
  if (T * H * D < (1 << 16)) return run(0, T);
  parallel_ranges(T, 8, 2, run);
}

void rms_norm_kernel(const void* x, const void* residual, const void* w, void* out,
                     void* new_res, bool is_bf16, int64_t R, int64_t D, float eps) {
  parallel_ranges(R, 16, 1, [&](int64_t r0, int64_t r1) {
    if (!is_bf16)
      rms_rows_f32(static_cast<const float*>(x), static_cast<const float*>(residual),
                   static_cast<const float*>(w), static_cast<float*>(out),
                   static_cast<float*>(new_res), r0, r1, D, eps);
    else
      rms_rows_bf16(static_cast<const bf16*>(x), static_cast<const bf16*>(residual),
                    static_cast<const bf16*>(w), static_cast<bf16*>(out),
                    static_cast<bf16*>(new_res), r0, r1, D, eps);
  });
}

void silu_and_mul_kernel(const void* x, void* out, bool is_bf16, int64_t R, int64_t d) {
  parallel_ranges(R, 16, 1, [&](int64_t r0, int64_t r1) {
    if (!is_bf16)
      silu_mul_rows(static_cast<const float*>(x), static_cast<float*>(out), r0, r1, d);
    else
      silu_mul_rows(static_cast<const bf16*>(x), static_cast<bf16*>(out), r0, r1, d);
  });
}

}  // namespace specengine
