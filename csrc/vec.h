// Portable 16-lane float vectors (GCC/Clang vector extensions). Code written with them is
// compiled once per ISA by the callers' target_clones (AVX-512 -> zmm, AVX2 -> ymm pairs,
// baseline -> SSE), so one source serves every CPU; the AVX-512 clone is picked at load time.
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

namespace specengine {

#define SE_INLINE inline __attribute__((always_inline))
// Clones of hot functions for AVX-512, AVX2+FMA and the x86-64 baseline.
#if defined(__x86_64__) && defined(__GNUC__)
#define SE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SE_CLONES
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

SE_INLINE f32x16 splat(float v) { return f32x16{} + v; }

SE_INLINE f32x16 load16(const float* p) {
  f32x16 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

// bf16 is the top half of a float: widen and shift.
SE_INLINE f32x16 load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
}

SE_INLINE void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// Fixed-order horizontal sum (pairwise halves: v[i] + v[i + 8], then + [i + 4], [i + 2], [i + 1]),
// identical on every ISA clone; shuffles instead of a store/reload round trip.
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x2 __attribute__((vector_size(8)));

SE_INLINE float hsum(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f32x2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

// exp(x) on 16 lanes (Cephes expf polynomial, ~2 ulp), x clamped to [-87.3, 88.3]
// (so exp of a very negative x is ~1e-38, not 0; callers mask where exactly 0 matters).
SE_INLINE f32x16 vexp(f32x16 x) {
  const f32x16 lo = splat(-87.3f), hi = splat(88.3f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f32x16 magic = splat(12582912.f);  // 1.5 * 2^23: round to nearest integer
  const f32x16 n = (x * 1.44269504088896341f + magic) - magic;
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  // 2^n in two factors so n = 128 (x near 88.3) does not overflow the exponent field
  const i32x16 ni = __builtin_convertvector(n, i32x16);
  const i32x16 e1 = ((ni >> 1) + 127) << 23, e2 = ((ni - (ni >> 1)) + 127) << 23;
  f32x16 s1, s2;
  std::memcpy(&s1, &e1, sizeof(s1));
  std::memcpy(&s2, &e2, sizeof(s2));
  return y * s1 * s2;
}

// SiLU g / (1 + exp(-g)) on 16 lanes; shared by silu_and_mul and the fused AMX epilogue so
// both round identically.
SE_INLINE f32x16 vsilu(f32x16 g) { return g / (1.f + vexp(-g)); }

SE_INLINE float to_float(float v) { return v; }
SE_INLINE float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

}  // namespace specengine
