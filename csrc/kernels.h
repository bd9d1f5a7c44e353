// The CPU kernels behind the ops of ops.h, in plain C++ over raw pointers: no torch header, so
// each kernel file compiles in seconds. ops.cpp checks the tensors, allocates the outputs and
// calls these; every pointer here is to contiguous memory unless a stride says otherwise.
// bf16 data is passed as its uint16_t bits or as c10::BFloat16 (vec.h), never converted here.
#pragma once

#include <cstdint>

namespace specengine {

// ---- paged attention (attention.cpp) -------------------------------------------------------
struct AttnArgs {
  const float* q;          // [T, H, D] float32, already multiplied by scale
  const void* k_cache;     // [NB, BS, KVH, D]
  const void* v_cache;
  const int32_t* block_tables;  // [S, MB]
  const int32_t* query_seq;     // [T]
  const int32_t* kv_lens;       // [T]
  const int32_t* tree_base;     // [T] or nullptr
  const bool* tree_mask;        // [T, W] or nullptr
  float* out;                   // [T, H, D] float32
  int64_t T, H, KVH, D, NB, BS, MB, W;
  // bf16 paths only: elements between tokens of q_bf16 (heads D apart), and, when set, the
  // output as bf16 [T, H, D] (rounded as c10::BFloat16: nearest even) instead of `out`
  int64_t q_stride = 0;
  uint16_t* out_bf16 = nullptr;
};

// True when bf16 query and caches of head_dim D take the AVX-512 BF16 path
// (paged_attention_bf16_fast); x86-64 CPUs with AVX-512 BF16 only.
bool paged_attention_fast_available(int64_t D);
// AVX-512 BF16 path: q_bf16 [T, H, D] bf16 bits (token stride a.q_stride), unscaled (a.q is
// not read); the output in a.out (float32) or a.out_bf16.
void paged_attention_bf16_fast(const AttnArgs& a, const uint16_t* q_bf16, float scale);
// True when bf16 query and caches of head_dim D take the AMX path (paged_attention_amx).
bool paged_attention_amx_available(int64_t D);
// AMX path (attention_amx.cpp): arguments as paged_attention_bf16_fast.
void paged_attention_amx(const AttnArgs& a, const uint16_t* q_bf16, float scale);
// Portable path over float32 (bf16_cache false) or bf16 caches; a.q float32, scaled.
void paged_attention_generic(const AttnArgs& a, bool bf16_cache);
// float32 caches on x86-64 CPUs with AVX-512F, head_dim % 16 == 0 and <= 128, at most 64 query
// heads per KV head (attention.cpp); a.q is the scaled float32 query, as for the generic path.
bool paged_attention_f32_fast_available(int64_t D, int64_t group);
void paged_attention_f32_fast(const AttnArgs& a);
// float32 or bf16 caches on x86-64 CPUs with AVX2 + FMA, head_dim % 8 == 0 and <= 128, at most
// 64 query heads per KV head (attention.cpp); a.q the scaled float32 query.
bool paged_attention_avx2_available(int64_t D, int64_t group);
void paged_attention_avx2(const AttnArgs& a, bool bf16_cache);

// ---- linear, norms, RoPE, SiLU (cpu_ops.cpp) ------------------------------------------------
struct LinearArgs {
  const void* x;     // [M, K]
  const void* w;     // [N, K]
  const float* b;    // [N] float32 or nullptr
  float* y;          // [M, N] float32
  int64_t M, N, K;
};

// y = x @ w^T + b for bf16 (is_bf16) or float32 x and w; batch-invariant rows.
void linear_kernel(const LinearArgs& a, bool is_bf16);
// Rotate-half RoPE in place on x [T, H, D] (row strides sx_t, sx_h; D contiguous) with float32
// cos/sin rows of stride sc/ss; x is float32, or bf16 when is_bf16.
void rope_kernel(void* x, bool is_bf16, const float* cos, const float* sin, int64_t T,
                 int64_t H, int64_t D, int64_t sx_t, int64_t sx_h, int64_t sc, int64_t ss);
// RMSNorm of R rows of D into out; with residual (non-null), first new_res = x + residual.
void rms_norm_kernel(const void* x, const void* residual, const void* w, void* out,
                     void* new_res, bool is_bf16, int64_t R, int64_t D, float eps);
// silu(x[:, :d]) * x[:, d:] for R rows of 2d -> out [R, d].
void silu_and_mul_kernel(const void* x, void* out, bool is_bf16, int64_t R, int64_t d);
// "avx512_bf16", "avx512", "avx2" or "generic".
const char* cpu_isa();

// ---- AMX-BF16 linear (linear_amx.cpp) -------------------------------------------------------
struct AmxArgs {
  const uint16_t* x;      // [M, xs] bf16 bits; K % 32 == 0 or (M <= 16) K padded with zeros
  int64_t xs;             // row stride of x in elements
  const uint16_t* w;      // packed [P, Kb, 2, 16, 32]
  const float* bias;      // [N] or nullptr (not in glu mode)
  void* y;                // [M, ldy]: bf16 bits, or float32 with out_f32
  int64_t ldy, M, N, Kb;  // N: valid output features (glu: I)
  bool glu, out_f32;      // out_f32: not in glu mode
  uint16_t* xt;           // M > 16: scratch for x in tile order, [2 ceil(M/32), Kb, 16, 32]
  bool stream = false;    // out_f32: write whole lines past the caches (no read for ownership)
};

bool amx_available();  // the CPU has AMX-BF16 (amx_supported) and the cap allows it
bool amx_supported();  // AMX-BF16 tiles usable on this CPU and OS, whatever the cap
// [N, K] bf16 bits -> dst [P, Kb, 2, 16, 32] (zero-filled by the caller).
void amx_pack(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, bool glu);
// The P packed feature pairs of a.w over K input features; only when amx_available().
void amx_linear_kernel(const AmxArgs& a, int64_t P, int64_t K);

// ---- AVX-512 linear (linear_avx512.cpp) -----------------------------------------------------
struct Avx512LinearArgs {
  const void* x;     // [M, xs]: bf16 (K padded to even with zeros) or f32
  int64_t xs;        // row stride of x in elements
  const void* w;     // packed
  const float* bias;  // [N] or nullptr
  void* y;           // [M, ldy] bf16 or f32
  int64_t ldy, M, N, K;  // N: valid output features (glu: I); K: padded K (bf16: even)
  bool glu, out_f32;
  bool bf16;  // x and w are bf16: the glu epilogue rounds its intermediates to bf16
};

constexpr int64_t kAvx512Group = 64;  // output features per packed group
bool avx512_linear_available(bool bf16);
// [N, K] weights -> groups of 64 features: bf16 bits into dst [G, ceil(K/2), 64, 2], float32
// into dst [G, K, 64]; dst zero-filled by the caller.
void avx512_pack_bf16(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, bool glu);
void avx512_pack_f32(const float* src, float* dst, int64_t N, int64_t K, bool glu);
// The G packed groups of a.w (element_size: 2 for bf16, 4 for float32); only when
// avx512_linear_available(a.bf16).
void avx512_linear_kernel(const Avx512LinearArgs& a, int64_t G, int64_t element_size);

// ---- instruction-set cap (isa.cpp) --------------------------------------------------------
// The highest instruction set the run-time dispatch may pick: generic < avx2 < avx512 (AVX-512
// and AVX-512 BF16) < amx (AMX tiles too). Default kIsaAmx (whatever the CPU has); lowered to
// test and benchmark the AVX-512, AVX2 or portable paths on a bigger CPU. The target_clones of
// vec.h (resolved at load time) are not affected.
constexpr int kIsaGeneric = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAmx = 3;
void set_isa_cap(int level);  // clamped to [kIsaGeneric, kIsaAmx]
int isa_cap();

// ---- AVX2 + FMA linear (linear_avx2.cpp) ----------------------------------------------------
// Over the same packed weights as the AVX-512 kernel (avx512_pack_*): 8-wide FMA, bf16 widened
// to float32 by shifting. float32 results equal the AVX-512 kernel's bit for bit; bf16 ones too
// (VDPBF16PS adds the odd then the even exact product, as this kernel's two FMAs do) except
// for denormals, which VDPBF16PS flushes.
bool avx2_linear_available();
void avx2_linear_kernel(const Avx512LinearArgs& a, int64_t G, int64_t element_size);

// ---- sampling noise (noise.cpp) -------------------------------------------------------------
// out [P, vocab] float32 = Exp(1) noise of stream `key` at output positions [P].
void exponential_noise_kernel(int64_t key, const int64_t* positions, int64_t P, int64_t vocab,
                              float* out);
// Row r of out [P, vocab]: the noise of stream keys[r * key_step] at positions[r] (key_step 0:
// one key for all rows).
void exponential_noise_rows_kernel(const int64_t* keys, int64_t key_step,
                                   const int64_t* positions, int64_t P, int64_t vocab,
                                   float* out);
// out[r] = argmax(probs[r] / noise of (keys[r], positions[r])) over [V], torch.argmax's ties
// and NaN rule, the noise never stored; probs [S, V] float32.
void exponential_race_kernel(const float* probs, const int64_t* keys, const int64_t* positions,
                             int64_t S, int64_t V, int64_t* out);
// out[r] = the index of the largest of x[r] over [V] (x [R, V] float32): the first among
// equals, a NaN counting as the largest (the first NaN), as torch.argmax.
void argmax_rows_kernel(const float* x, int64_t R, int64_t V, int64_t* out);
// out[r] = softmax(x[r]) over [V] (x, out [R, V] float32) with one definition whatever R or the
// thread count: m the row's max, e = exp(x - m) (0 below exp(-87.3)), S the sum of e over
// 8192-value chunks (each summed on 16 lanes in order), chunk sums in order; out = e * (1 / S).
// A row holding NaN, or whose max is +-inf, is all NaN (as torch.softmax gives).
void softmax_rows_kernel(const float* x, int64_t R, int64_t V, float* out);
// out[r] = exponential_race_kernel's token of softmax_rows_kernel's row r of x [S, V] float32,
// bit for bit, without the probabilities in memory: with at least two rows per pool thread
// each row's softmax and race run on one thread, so the row stays in its core's cache. With
// `rows` (S row indices), race r reads row rows[r] of x instead of row r (no gathered copy).
void softmax_race_kernel(const float* x, const int64_t* rows, const int64_t* keys,
                         const int64_t* positions, int64_t S, int64_t V, int64_t* out);
// Per row r of logits [R, Vd] float32: the k largest of z - logsumexp(z), best first (ties:
// lower index; -inf / 0 past the row's finite entries), into values [R, k] / indices [R, k],
// with z = logits[r] when temperature[r] == 0, else logits[r] / temperature[r] - log E, E the
// noise of (keys[r], positions[r]) at token vocab_map[i] (i when vocab_map is null).
void coupled_topk_kernel(const float* logits, int64_t R, int64_t Vd, const float* temperature,
                         const int64_t* keys, const int64_t* positions, const int64_t* vocab_map,
                         int64_t k, float* values, int64_t* indices);

}  // namespace specengine
