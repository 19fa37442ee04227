// GGUF weights times 8-bit activations: what the kernels of gguf_dot_q8.cpp (Q8_0, Q4_0) and
// gguf_dot_k.cpp (Q4_K, Q5_K, Q6_K, IQ4_XS) share with the operators of gguf_dot.cpp (read its
// header for the arithmetic and the paths).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PORTSIDE_GD_AVX2 1
#include <immintrin.h>
#endif
#if defined(PORTSIDE_GD_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define PORTSIDE_GD_VNNI 1
#endif
#if defined(PORTSIDE_GD_VNNI) && defined(__AVX512VBMI__)
#define PORTSIDE_GD_VBMI 1  // the VNNI path's Q4_0 kernel also permutes bytes (vpermb)
#endif

namespace portside_gguf {

// The scalar kernels are not auto-vectorized: GCC 12 at -march=native with AVX-512 VNNI turns the
// signed int8 x int8 sum of ScalarQ8_0 into vpdpbusd (unsigned x signed), a wrong result; the
// scalar path is the portable one anyway (the SIMD paths are written out).
#if defined(__GNUC__) && !defined(__clang__)
#define PORTSIDE_GD_SCALAR __attribute__((optimize("no-tree-vectorize")))
#else
#define PORTSIDE_GD_SCALAR
#endif

enum Isa : int64_t { ISA_BEST = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_VNNI = 3 };
constexpr int64_t GGML_Q4_0 = 2, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_XS = 23;

inline bool isa_runs(int64_t isa) {
  switch (isa) {
    case ISA_SCALAR: return true;
#ifdef PORTSIDE_GD_AVX2
    case ISA_AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
#ifdef PORTSIDE_GD_VNNI
    case ISA_VNNI:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")
#ifdef PORTSIDE_GD_VBMI
             && __builtin_cpu_supports("avx512vbmi")
#endif
          ;
#endif
  }
  return false;
}

// IEEE half -> float, portable and exact (as F16C's conversion).
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) {
    const float f = std::ldexp(float(man), -24);  // zero or subnormal
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7F800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K / Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit minimums (the same unpacking as
// quant_gemm.cpp's FmtQ4_K::scales, four bytes at a time; little-endian).
inline void k_scales(const uint8_t* s12, uint8_t* sc, uint8_t* mn) {
  uint32_t u[3], o[4];
  std::memcpy(u, s12, 12);
  o[0] = u[0] & 0x3f3f3f3fu;
  o[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  o[2] = u[1] & 0x3f3f3f3fu;
  o[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
  std::memcpy(sc, o, 8);
  std::memcpy(mn, o + 2, 8);
}

// IQ4_XS: the 8 sub-block scales (6 bits: 4 low from scales_l, 2 high from scales_h) minus 32.
inline void iq4_scales(const uint8_t* blk, int16_t* ls) {
  uint16_t h;
  std::memcpy(&h, blk + 2, 2);
  for (int j = 0; j < 8; ++j) ls[j] = int16_t((((blk[4 + j / 2] >> (4 * (j & 1))) & 0x0F) | (((h >> (2 * j)) & 3) << 4)) - 32);
}

// The 16 IQ4_NL code values.
inline constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct Ctx {
  const uint8_t* w;  // GGUF blocks [N, rb]
  int64_t rb, K, N, T;
  const int8_t* xq;  // activation codes [T, K]
  const float* xd;  // their scales [T, K / 32] (Q8_0, Q4_0) or [T, K / 256] (the 256-value formats)
  const int32_t* lb;  // Q8_0/Q4_0: per int32 lane (4 codes), -bias * their sum [T, K / 4]
  const float* xdl;  // Q8_0/Q4_0: the block's scale per int32 lane [T, K / 4]
  const int16_t* bs;  // 256-value formats: code sums per 16 [T, K / 16]
  const int16_t* ps;  // Q6_K: -32 * the codes' pair sums [T, K / 2] (AVX-512 VNNI)
  float* y;  // [T, N]
};

// Decode (one token row): software prefetch of the bytes [off, off + len) of each of the NR rows
// `PREFETCH_ROWS` calls ahead (the rows the thread reads next; a prefetch past the end is dropped).
// The weight stream is the cost of a decode step; the hardware prefetcher alone leaves bandwidth
// unused on the EPYC VMs measured (as quant_gemm.cpp's kernels found). 4 passes ahead, not 2: on
// the Zen 5 (one thread, W 5632 x 2048, `ci/bench/gguf_act_kernels.py --rows 1`, runs alternated)
// Q6_K 345 -> 262 us, Q4_0 236 -> 210-248, Q8_0 (one row a pass) 353-377 -> 299-313; 8 no better.
constexpr int64_t PREFETCH_ROWS = 4;
template <int NR, int R>
inline void prefetch(const Ctx& c, int64_t n, int64_t off, int64_t len) {
  if constexpr (R == 1) {
    for (int i = 0; i < NR; ++i) {
      const char* p = reinterpret_cast<const char*>(c.w) + (n + i + PREFETCH_ROWS * NR) * c.rb + off;
      for (int64_t b = 0; b < len; b += 64) __builtin_prefetch(p + b, 0, 3);
    }
  }
}

// Weight rows per pass of a decode kernel: its DECODE_ROWS (4: the VNNI Q4_0, Q4_K/Q5_K and Q6_K
// kernels, whose decoding of the weights, not the memory, bounds them at 2: 4 independent
// accumulator chains and the activation loads shared 4 ways run them 1.1-1.4x faster on Zen 5),
// 1 (the VNNI Q8_0 kernel: one stream, read at ~40 GB/s on the Zen 5 where two side by side read
// ~27: 300 against 450-490 us in the bench above), else 2.
template <class Kern>
constexpr int decode_rows() {
  if constexpr (requires { Kern::DECODE_ROWS; }) return Kern::DECODE_ROWS;
  else return 2;
}

// Weight rows per pass of the several-token path (`drive`): the kernel's PREFILL_ROWS (4: the VNNI
// Q8_0 kernel, 1.15x; the others gain nothing measurable), else 2.
template <class Kern>
constexpr int prefill_rows() {
  if constexpr (requires { Kern::PREFILL_ROWS; }) return Kern::PREFILL_ROWS;
  else return 2;
}

// One token row (decode), weight rows [n0, n1) on the calling thread: `decode_rows` weight rows
// side by side (that many streams in flight), then pairs, then one.
template <class Kern, class C>
void rows_range(const C& c, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if constexpr (decode_rows<Kern>() == 1)
    for (; n < n1; ++n) Kern::template rows<1, 1>(c, n, 0);
  if constexpr (decode_rows<Kern>() == 4)
    for (; n + 4 <= n1; n += 4) Kern::template rows<4, 1>(c, n, 0);
  for (; n + 2 <= n1; n += 2) Kern::template rows<2, 1>(c, n, 0);
  if (n < n1) Kern::template rows<1, 1>(c, n, 0);
}

// Kern::rows<NR, R>(c, n, t) for R (1..4) token rows.
template <class Kern, int NR, class C>
inline void tokens(const C& c, int64_t n, int64_t t, int64_t R) {
  switch (R) {
    case 4: return Kern::template rows<NR, 4>(c, n, t);
    case 3: return Kern::template rows<NR, 3>(c, n, t);
    case 2: return Kern::template rows<NR, 2>(c, n, t);
    default: return Kern::template rows<NR, 1>(c, n, t);
  }
}

// Weight rows per chunk of the several-token-rows path (`drive`): 32 rows of Q8_0 at K 2048 are
// 70 KB, in L2 while every token row passes over them.
constexpr int64_t CHUNK_ROWS = 32;

// Weight rows [r0, r1) (a chunk in L2) against every token row: 4 token rows by `prefill_rows`
// weight rows per pass.
template <class Kern, class C>
void chunk_rows(const C& c, int64_t r0, int64_t r1) {
  for (int64_t t = 0; t < c.T; t += 4) {
    const int64_t R = std::min<int64_t>(4, c.T - t);
    int64_t n = r0;
    if constexpr (prefill_rows<Kern>() == 4)
      for (; n + 4 <= r1; n += 4) tokens<Kern, 4>(c, n, t, R);
    for (; n + 2 <= r1; n += 2) tokens<Kern, 2>(c, n, t, R);
    if (n < r1) tokens<Kern, 1>(c, n, t, R);
  }
}

// Runs Kern::rows<NR, R>(c, n, t) (NR weight rows from n, R token rows from t, writing y) over
// the whole output, split across threads by weight rows; or, with n1 >= 0 (one token row only),
// over the weight rows [n0, n1) on the calling thread (csrc/fused_decode.cpp's quantized step,
// which splits the rows across its own threads).
template <class Kern, class C>  // C: gguf_dot's Ctx, or int4_dot's
void drive(const C& c, int64_t n0 = 0, int64_t n1 = -1) {
  if (n1 >= 0) return rows_range<Kern>(c, n0, n1);
  if (c.T == 1) {  // decode: the output rows split across threads
    at::parallel_for(0, c.N, 16, [&](int64_t r0, int64_t r1) { rows_range<Kern>(c, r0, r1); });
    return;
  }
  // Several token rows: per thread, chunks of CHUNK_ROWS weight rows (read from memory once, then
  // from L2) against every token row, 4 token rows by `prefill_rows` weight rows per pass (the 4 rows'
  // activations stay in L1 while the chunk's rows go by; each decoded weight block serves 4 tokens).
  at::parallel_for(0, c.N, CHUNK_ROWS, [&](int64_t a0, int64_t a1) {
    for (int64_t r0 = a0; r0 < a1; r0 += CHUNK_ROWS) chunk_rows<Kern>(c, r0, std::min(a1, r0 + CHUNK_ROWS));
  });
}

#ifdef PORTSIDE_GD_AVX2

inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 u = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 bytes -> 32 codes 0..15: low nibbles are elements 0..15, high ones 16..31 (Q4_0, IQ4_XS).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i b = load128(p), m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// 8 unsigned bytes as 16 int16, each twice (lanes 2j, 2j + 1): Q4_K/Q5_K's minimums against the
// per-16 sums of sub-block j.
inline __m256i pairs16(const uint8_t* mn) {
  const __m128i m = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
  return _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
}

#endif  // PORTSIDE_GD_AVX2

// The kernels, per file: Q8_0 (q4 false) and Q4_0 (q4 true); the 256-value formats.
// x [T, K] fp32 -> codes [T, K] and scales [T, K / block]: the reference's rounding exactly (IEEE
// division, round half to even under the default rounding mode, no fast-math); gguf_dot.cpp.
void quantize_blocks(const float* x, int64_t T, int64_t K, int64_t block, int8_t* q, float* d);

// The fastest path compiled in and runnable here: VNNI, else AVX2, else scalar.
inline int64_t best_isa() {
  for (int64_t isa : {ISA_VNNI, ISA_AVX2})
    if (isa_runs(isa)) return isa;
  return ISA_SCALAR;
}

// n1 >= 0: weight rows [n0, n1) of one token row on the calling thread (`drive`).
void dot_q8_q4(const Ctx& c, int64_t isa, bool q4, int64_t n0 = 0, int64_t n1 = -1);
void dot_k(const Ctx& c, int64_t isa, int64_t ggml_type, int64_t n0 = 0, int64_t n1 = -1);

// (values per block, bytes per block) of a type with a kernel; (0, 0) for any other.
std::pair<int64_t, int64_t> block_shape(int64_t ggml_type);

// The activations as the kernels of `ggml_type` read them, for x [T, K] fp32: the codes and
// scales and what that type's kernels take besides (Ctx's x fields). Owned by the caller, reused
// across calls (resized as needed).
struct Activations {
  std::vector<int8_t> xq;
  std::vector<float> xd, xdl;
  std::vector<int32_t> lb;
  std::vector<int16_t> bs, ps;
};

// Quantizes x [T, K] into `a` for `ggml_type` (K whole blocks of it) and returns a Ctx with its x
// fields set (w, rb, N and y left for the caller). `parallel`: the blocks split across threads
// (at::parallel_for); false on a thread that is one of several already (the fused step).
// codes_only: xq and xd alone (what `dot_tiles` reads).
Ctx quantize_activations(const float* x, int64_t T, int64_t K, int64_t ggml_type, Activations& a, bool parallel,
                         bool codes_only = false);

// Many token rows on AVX-512 VNNI or AVX2 (gguf_tile.cpp): the weights regrouped a chunk at a
// time into tiles of 16 (AVX2: 8) interleaved rows. `tiles_apply`: whether `dot_tiles` takes a call
// of T token rows on the path `isa` (VNNI or AVX2, at least TILE_TOKENS rows); dot_tiles reads only
// c's codes and scales (xq, xd: `quantize_activations` with codes_only) and writes all of c.y,
// over all threads.
constexpr int64_t TILE_TOKENS = 16;
bool tiles_apply(int64_t isa, int64_t ggml_type, int64_t T);
void dot_tiles(const Ctx& c, int64_t isa, int64_t ggml_type);
// The same tiles over int4 weights (int4_dot.cpp's layout: codes [N, K / 2], column 2i in the low
// nibble of byte i; fp32 scales and whole zero points [N, K / gs], zeros null: 8), c's codes
// quantized per act_block (a multiple of 32 dividing gs); tiles_apply(isa, GGML_Q4_0, T) says when.
struct Int4Weights {
  const uint8_t* w;
  int64_t gs;
  const float *s, *z;
};
void dot_tiles_int4(const Ctx& c, int64_t isa, const Int4Weights& q, int64_t act_block);
// And over symmetric int8 weights (quant_gemm.cpp's W8A8: codes [N, K] uint8 = w + 128, fp32 scales
// [N, K / gs], gs a multiple of 32), c's codes quantized per act_block (K: one scale per token row).
struct Int8Weights {
  const uint8_t* w;
  int64_t gs;
  const float* s;
};
void dot_tiles_int8(const Ctx& c, int64_t isa, const Int8Weights& q, int64_t act_block);

// y[n] = x . W[n] for the weight rows [n0, n1) of c (one token row: c.T == 1) on the calling
// thread, with the path `isa` (not ISA_BEST: resolve it once with best_isa()).
void dot_rows(const Ctx& c, int64_t isa, int64_t ggml_type, int64_t n0, int64_t n1);

}  // namespace portside_gguf
