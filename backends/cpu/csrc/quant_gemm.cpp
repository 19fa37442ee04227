// Quantized linears for the cpu backend's ModelOps (quant.py), as torch operators:
//
//   portside_cpu_native::quant_linear(Tensor x, Tensor qweight, Tensor? scales, Tensor? zeros,
//       Tensor? bias, int fmt, int group_size) -> Tensor
//     weight-only: y [T, N] = x [T, K] @ W^T + bias in x's dtype (fp32 or bf16, computed in fp32),
//     W decoded from its stored codes inside the kernel. fmt (FMT_* below): int8 and int4 codes in
//     portside's canonical layout (portside.quant.weight: uint8 [N, K] / [N, K/2] low nibble
//     first, fp32 scales [N, G], fp32 zeros [N, G] or none for 2^(bits-1)), fp8 e4m3 [N, K] with
//     fp32 scales [N, 1], or llama.cpp's raw GGUF blocks [N, row_bytes] (Q8_0, Q4_0, Q4_K, Q5_K,
//     Q6_K).
//   portside_cpu_native::quant_linear_w8a8(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros,
//       Tensor? input_scale, Tensor? bias, int group_size) -> Tensor
//     int8 weights (canonical uint8 codes) x int8 activations: x rounded per token (or by the
//     static input_scale) as portside.quant.weight.quantize_activation does, integer dot
//     products per group (exact), scaled in fp32.
//   portside_cpu_native::quant_isa() -> str: the instruction-set paths compiled in ("" when none:
//     the Python side then keeps the reference).
//
// Every format is W[n, k] = a[n, g] * q[n, k] + b[n, g] over groups g of consecutive columns, q a
// small integer (or an fp8 value) decoded to fp32 in registers, so one kernel serves them all:
// y = sum_g a_g * (q_g . x_g) + b_g * sum(x_g). b is nonzero only for the K-quants' minimums;
// zero points are subtracted from q before the multiply (exact in fp32), so the symmetric and
// asymmetric int formats lose nothing to cancellation.
//
// Batch-1 decode (and up to SMALL_T rows) is bound by reading the codes once: each thread takes a
// contiguous range of output rows; one token row walks two weight rows side by side, more token
// rows share each decoded weight chunk (up to 4 at a time, the weight row then in L1). More rows
// (prefill) are compute-bound: a thread dequantizes a tile of TILE_N weight rows into fp32 scratch
// that stays in its L2 and multiplies it with at::linear (MKL/oneDNN, single-threaded inside the
// parallel region); measured against dequantizing the whole matrix and one multi-threaded GEMM in
// docs/cpu.md.
//
// W8A8: AVX2 multiplies u8 x s8 pairs with _mm256_maddubs_epi16 after moving the weight's sign
// onto the activation (|w| <= 128, |x| <= 127: a pair sum fits int16, as llama.cpp does);
// AVX512-VNNI uses _mm512_dpbusd_epi32 on the unsigned codes and subtracts 128 * sum(x) in int32; AMX-INT8
// (Sapphire Rapids and later, when the kernel grants the tile state) multiplies 16x64 tiles of
// codes by the activations packed VNNI-style, for 16 or more rows. Each path is compiled only
// under its own -march=native macro (__AVX512VNNI__, __AMX_INT8__), chosen at run time by what
// the build has and, for AMX, whether arch_prctl grants XTILEDATA.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PORTSIDE_QUANT_AVX2 1
#include <immintrin.h>
#endif
#if defined(PORTSIDE_QUANT_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PORTSIDE_QUANT_VNNI 1
#endif
#if defined(PORTSIDE_QUANT_AVX2) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PORTSIDE_QUANT_AMX 1
#include "amx_tiles.h"
#endif
#include "gguf_dot.h"  // gguf_tile.cpp's tiles, for many token rows of symmetric W8A8

namespace {

enum Fmt : int64_t {
  FMT_INT8 = 0,
  FMT_INT4 = 1,
  FMT_FP8 = 2,
  FMT_GGUF = 100,  // + ggml type
  FMT_Q4_0 = 102,
  FMT_Q8_0 = 108,
  FMT_Q4_K = 112,
  FMT_Q5_K = 113,
  FMT_Q6_K = 114,
};

constexpr int64_t SMALL_T = 8;  // up to this many rows: the decode kernels; more: tiles + GEMM
constexpr int64_t TILE_N = 64;  // weight rows a thread dequantizes per GEMM call
// Path overrides or'ed into fmt, for the benchmark (ci/bench/quant.py) to compare the choices:
constexpr int64_t PATH_TILES = 1 << 12;  // the tiled GEMM whatever the row count
constexpr int64_t PATH_DENSE = 1 << 13;  // the whole matrix dequantized, then one multi-threaded GEMM
constexpr int64_t PATH_MASK = PATH_TILES | PATH_DENSE;

// Software prefetch of the codes `prefetch_rows()` rows after the last row a kernel is reading
// (0: none; option for the benchmark: quant_set_prefetch, registered whatever the build). Measured
// in docs/cpu.md.
std::atomic<int64_t> g_prefetch_rows{2};

inline int64_t prefetch_rows() { return g_prefetch_rows.load(std::memory_order_relaxed); }

int64_t quant_set_prefetch(int64_t rows) { return g_prefetch_rows.exchange(rows); }

#ifdef PORTSIDE_QUANT_AVX2

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline int32_t hsum_i32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Codes to fp32 without a conversion instruction: an unsigned byte q as the low bits of the float
// 0x4B0000qq is 2^23 + q exactly, so (2^23 + q) - (2^23 + zero) is q - zero, exact. The unpacks
// work within 128-bit lanes, so the 32 bytes come out lane-interleaved: vector v holds bytes
// 4v..4v+3 and 16+4v..16+4v+3 (`lane_order`); x is permuted the same way once per call (`run`),
// and dot products do not care about the order. 15 vector ops per 32 codes and row with the
// FMAs, against 20 for zero-extending 8 bytes at a time and converting.
constexpr float MAGIC = 8388608.f;  // 2^23

inline void bytes32_to_ps(__m256i b, __m256 zv, __m256* w) {
  const __m256i zero = _mm256_setzero_si256(), magic = _mm256_set1_epi16(0x4B00);
  const __m256i lo = _mm256_unpacklo_epi8(b, zero), hi = _mm256_unpackhi_epi8(b, zero);
  w[0] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(lo, magic)), zv);
  w[1] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(lo, magic)), zv);
  w[2] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(hi, magic)), zv);
  w[3] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(hi, magic)), zv);
}

// 16 bytes: vector v holds bytes 4v..4v+3 and 8+4v..8+4v+3.
inline void bytes16_to_ps(__m128i b, __m256 zv, __m256* w) {
  const __m256i v = _mm256_cvtepu8_epi16(b), magic = _mm256_set1_epi16(0x4B00);
  w[0] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(v, magic)), zv);
  w[1] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(v, magic)), zv);
}

// Which byte of a CH-byte chunk float j of the decoded vectors comes from.
constexpr int lane_order(int ch, int j) {
  const int v = j / 8, i = j % 8;
  return i < 4 ? 4 * v + i : ch / 2 + 4 * v + i - 4;
}

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline __m256i nibbles256(__m256i b, bool high) {
  return _mm256_and_si256(high ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(0x0F));
}

// 16 bytes of two nibbles -> 32 bytes: the low nibbles, then the high ones.
inline __m256i split_nibbles(__m128i b) {
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// ---- formats: W[n, k] = a * q + b per group; decode() gives q of one chunk as fp32 vectors -----
// Each format says which element of its chunk float j of decode() is (`elem`); `run` permutes x
// to match when that is not the identity.

// Canonical int8: uint8 codes [N, K], W = scale * (q - zero), zero per group or 2^7.
struct FmtInt8 {
  static constexpr int CH = 32, NV = 4;
  static constexpr bool HAS_B = false;
  static constexpr bool CHUNK_SCALE = false;
  static constexpr int elem(int j) { return lane_order(32, j); }
  const uint8_t* q;
  int64_t K, G, gs;
  const float *s, *z;
  float zdef;
  struct Grp {
    const uint8_t* p;
    __m256 zv;
    float a, b;
  };
  int64_t groups() const { return G; }
  int64_t chunks() const { return gs / CH; }
  int64_t row_bytes() const { return K; }
  Grp group(int64_t n, int64_t g) const {
    return {q + n * K + g * gs, _mm256_set1_ps(MAGIC + (z ? z[n * G + g] : zdef)), s[n * G + g], 0.f};
  }
  void decode(const Grp& gp, int64_t c, __m256* w) const { bytes32_to_ps(load256(gp.p + c * CH), gp.zv, w); }
};

// Canonical int4: [N, K/2], column 2j in the low nibble of byte j, 2j + 1 in the high one.
struct FmtInt4 : FmtInt8 {
  // byte j of split_nibbles: column 2j (j < 16) or 2(j - 16) + 1
  static constexpr int elem(int j) { return lane_order(32, j) < 16 ? 2 * lane_order(32, j) : 2 * (lane_order(32, j) - 16) + 1; }
  int64_t row_bytes() const { return K / 2; }
  Grp group(int64_t n, int64_t g) const {
    return {q + n * (K / 2) + g * (gs / 2), _mm256_set1_ps(MAGIC + (z ? z[n * G + g] : zdef)), s[n * G + g], 0.f};
  }
  void decode(const Grp& gp, int64_t c, __m256* w) const { bytes32_to_ps(split_nibbles(load128(gp.p + c * (CH / 2))), gp.zv, w); }
};

// fp8 e4m3fn [N, K], scale per row. A code's 7 magnitude bits placed at bits 7-13 of an fp16
// (sign at 15) are the same number times 2^-8, subnormals included: F16C converts, `a` has 256.
struct FmtFp8 {
  static constexpr int CH = 32, NV = 4;
  static constexpr bool HAS_B = false;
  static constexpr bool CHUNK_SCALE = false;
  static constexpr int elem(int j) { return j; }
  const uint8_t* q;
  int64_t K;
  const float* s;
  struct Grp {
    const uint8_t* p;
    float a, b;
  };
  int64_t groups() const { return 1; }
  int64_t chunks() const { return K / CH; }
  int64_t row_bytes() const { return K; }
  Grp group(int64_t n, int64_t) const { return {q + n * K, s[n] * 256.f, 0.f}; }
  static void half16(__m128i b, __m256* w) {
    const __m256i v = _mm256_cvtepu8_epi16(b);
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16(0x3F80)),
                                      _mm256_and_si256(_mm256_slli_epi16(v, 8), _mm256_set1_epi16(int16_t(0x8000))));
    w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    w[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  void decode(const Grp& gp, int64_t c, __m256* w) const {
    half16(load128(gp.p + c * CH), w);
    half16(load128(gp.p + c * CH + 16), w + 2);
  }
};

// GGUF Q8_0: blocks of 32, {fp16 d, int8 qs[32]}: W = d * q (q ^ 0x80 = q + 128, unsigned).
struct FmtQ8_0 {
  static constexpr int CH = 32, NV = 4;
  static constexpr bool HAS_B = false;
  static constexpr bool CHUNK_SCALE = false;
  static constexpr int elem(int j) { return lane_order(32, j); }
  const uint8_t* q;
  int64_t K, rb;
  int64_t row_bytes() const { return rb; }
  struct Grp {
    const uint8_t* p;
    float a, b;
  };
  int64_t groups() const { return K / 32; }
  int64_t chunks() const { return 1; }
  Grp group(int64_t n, int64_t g) const {
    const uint8_t* blk = q + n * rb + g * 34;
    return {blk + 2, half_to_float(blk), 0.f};
  }
  void decode(const Grp& gp, int64_t, __m256* w) const {
    bytes32_to_ps(_mm256_xor_si256(load256(gp.p), _mm256_set1_epi8(int8_t(0x80))), _mm256_set1_ps(MAGIC + 128.f), w);
  }
};

// GGUF Q4_0: blocks of 32, {fp16 d, uint8 qs[16]}: element j in qs[j]'s low nibble, j + 16 in its
// high one; W = d * (nibble - 8).
struct FmtQ4_0 {
  static constexpr int CH = 32, NV = 4;
  static constexpr bool HAS_B = false;
  static constexpr bool CHUNK_SCALE = false;
  static constexpr int elem(int j) { return lane_order(32, j); }
  const uint8_t* q;
  int64_t K, rb;
  int64_t row_bytes() const { return rb; }
  struct Grp {
    const uint8_t* p;
    float a, b;
  };
  int64_t groups() const { return K / 32; }
  int64_t chunks() const { return 1; }
  Grp group(int64_t n, int64_t g) const {
    const uint8_t* blk = q + n * rb + g * 18;
    return {blk + 2, half_to_float(blk), 0.f};
  }
  void decode(const Grp& gp, int64_t, __m256* w) const {
    bytes32_to_ps(split_nibbles(load128(gp.p)), _mm256_set1_ps(MAGIC + 8.f), w);
  }
};

// K-quants' 6-bit (scale, min) pair j of a super-block (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// K-quants: a group is a super-block of 256 (its scales decoded once), a chunk one of its
// sub-blocks with its own scale and min (CHUNK_SCALE).

// GGUF Q4_K: {fp16 d, fp16 dmin, scales[12], qs[128]}; sub-block j (32 elements) is
// qs[32 * (j / 2) ..] low (j even) or high nibbles, W = d * sc_j * q - dmin * m_j.
struct FmtQ4_K {
  static constexpr int CH = 32, NV = 4;
  static constexpr bool HAS_B = true, CHUNK_SCALE = true;
  static constexpr int elem(int j) { return lane_order(32, j); }
  const uint8_t* q;
  int64_t K, rb;
  int64_t row_bytes() const { return rb; }
  struct Grp {
    const uint8_t* blk;
    float a[8], b[8];
  };
  int64_t groups() const { return K / 256; }
  int64_t chunks() const { return 8; }
  // The 8 6-bit scales and mins unpacked 4 bytes at a time (llama.cpp's kmask trick), then
  // converted 8 at a time: a super-block's scalar work would otherwise rival its codes'.
  static void scales(const uint8_t* blk, Grp& gp) {
    uint32_t u[4];
    std::memcpy(u, blk + 4, 12);
    constexpr uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    const uint32_t mins_lo = u[1] & m1;
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    u[2] = mins_lo;
    u[0] &= m1;  // bytes of u[0..1]: the 8 scales, of u[2..3]: the 8 mins
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    _mm256_storeu_ps(gp.a, _mm256_mul_ps(sc, _mm256_set1_ps(half_to_float(blk))));
    _mm256_storeu_ps(gp.b, _mm256_mul_ps(mn, _mm256_set1_ps(-half_to_float(blk + 2))));
  }
  Grp group(int64_t n, int64_t g) const {
    Grp gp;
    gp.blk = q + n * rb + g * 144;
    scales(gp.blk, gp);
    return gp;
  }
  void decode(const Grp& gp, int64_t c, __m256* w) const {
    bytes32_to_ps(nibbles256(load256(gp.blk + 16 + 32 * (c / 2)), c & 1), _mm256_set1_ps(MAGIC), w);
  }
};

// GGUF Q5_K: {fp16 d, fp16 dmin, scales[12], qh[32], qs[128]}: Q4_K's nibbles plus bit j of
// qh[l] as bit 4 of element l of sub-block j.
struct FmtQ5_K : FmtQ4_K {
  Grp group(int64_t n, int64_t g) const {
    Grp gp;
    gp.blk = q + n * rb + g * 176;
    scales(gp.blk, gp);
    return gp;
  }
  void decode(const Grp& gp, int64_t c, __m256* w) const {
    const __m256i nib = nibbles256(load256(gp.blk + 48 + 32 * (c / 2)), c & 1);
    const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(load256(gp.blk + 16), _mm_cvtsi32_si128(int(c))), _mm256_set1_epi8(1));
    bytes32_to_ps(_mm256_or_si256(nib, _mm256_slli_epi16(hb, 4)), _mm256_set1_ps(MAGIC), w);
  }
};

// GGUF Q6_K: {ql[128], qh[64], int8 scales[16], fp16 d}; sub-blocks of 16, W = d * scale *
// (q - 32), q = 4 low bits from ql, 2 high bits from qh (llama.cpp's order): element e of the
// super-block is in half e / 128, quarter (e % 128) / 32 of it, at l = e % 32.
struct FmtQ6_K {
  static constexpr int CH = 16, NV = 2;
  static constexpr bool HAS_B = false, CHUNK_SCALE = true;
  static constexpr int elem(int j) { return lane_order(16, j); }
  const uint8_t* q;
  int64_t K, rb;
  int64_t row_bytes() const { return rb; }
  struct Grp {
    const uint8_t* blk;
    float a[16];
  };
  int64_t groups() const { return K / 256; }
  int64_t chunks() const { return 16; }
  Grp group(int64_t n, int64_t g) const {
    Grp gp;
    gp.blk = q + n * rb + g * 210;
    // chunk c's scale is scales[8 * (c / 8) + (c % 2) + 2 * ((c % 8) / 2)] = scales[c]
    const __m256 d = _mm256_set1_ps(half_to_float(gp.blk + 208));
    const __m128i sc = load128(gp.blk + 192);
    _mm256_storeu_ps(gp.a, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(gp.a + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    return gp;
  }
  void decode(const Grp& gp, int64_t c, __m256* w) const {
    const int half = int(c) / 8, quad = (int(c) % 8) / 2, l0 = (int(c) % 2) * 16;
    const __m128i b = load128(gp.blk + 64 * half + 32 * (quad & 1) + l0);
    const __m128i lo = _mm_and_si128(quad >= 2 ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0F));
    const __m128i hb = _mm_and_si128(_mm_srl_epi16(load128(gp.blk + 128 + 32 * half + l0), _mm_cvtsi32_si128(2 * quad)),
                                     _mm_set1_epi8(3));
    bytes16_to_ps(_mm_or_si128(lo, _mm_slli_epi16(hb, 4)), _mm256_set1_ps(MAGIC + 32.f), w);
  }
};

// ---- kernels ------------------------------------------------------------------------------------

// y[r * ldy + n + i] = W[n + i] . x_r for NR weight rows and R token rows (x_r = x + r * K);
// xc [R][K / 32]: each token's column sums per 32 (formats with b only).
template <class F, int NR, int R>
inline void dot_rows(const F& f, int64_t n, const float* x, int64_t K, const float* xc, float* y, int64_t ldy) {
  const int64_t rb = f.row_bytes(), pf = prefetch_rows();
  const uint8_t* ahead = f.q + (n + NR - 1 + pf) * rb;  // the same bytes, pf rows after the last row here
  const int64_t step16 = (rb << 16) / (f.groups() * f.chunks());  // bytes per chunk, 16.16 fixed point
  __m256 tot[NR][R];
  float bs[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) tot[i][r] = _mm256_setzero_ps(), bs[i][r] = 0.f;
  const int64_t G = f.groups(), C = f.chunks();
  for (int64_t g = 0; g < G; ++g) {
    typename F::Grp gp[NR];
    for (int i = 0; i < NR; ++i) gp[i] = f.group(n + i, g);
    // one weight and token row: an accumulator per decoded vector (more spill out of the 16 ymm)
    constexpr int NA = NR * R == 1 ? F::NV : 2;
    __m256 acc[NR][R][NA];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r)
        for (int a = 0; a < NA; ++a) acc[i][r][a] = _mm256_setzero_ps();
    const float* xg = x + g * C * F::CH;
    for (int64_t c = 0; c < C; ++c) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(ahead + (((g * C + c) * step16) >> 16)), _MM_HINT_T0);
      for (int i = 0; i < NR; ++i) {  // one row's codes decoded and used before the next's (16 ymm)
        __m256 w[F::NV];
        f.decode(gp[i], c, w);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int v = 0; v < F::NV; ++v)
            acc[i][r][v % NA] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + r * K + c * F::CH + 8 * v), w[v], acc[i][r][v % NA]);
      }
      if constexpr (F::CHUNK_SCALE) {  // each chunk its own scale (and min: times x's sum over the chunk)
        for (int i = 0; i < NR; ++i)
          for (int r = 0; r < R; ++r) {
            __m256 sum = acc[i][r][0];
            for (int a = 1; a < NA; ++a) sum = _mm256_add_ps(sum, acc[i][r][a]);
            tot[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(gp[i].a[c]), sum, tot[i][r]);
            if constexpr (F::HAS_B) bs[i][r] += gp[i].b[c] * xc[r * (K / 32) + g * C + c];
            for (int a = 0; a < NA; ++a) acc[i][r][a] = _mm256_setzero_ps();
          }
      }
    }
    if constexpr (!F::CHUNK_SCALE) {
      for (int i = 0; i < NR; ++i)
        for (int r = 0; r < R; ++r) {
          __m256 sum = acc[i][r][0];
          for (int a = 1; a < NA; ++a) sum = _mm256_add_ps(sum, acc[i][r][a]);
          tot[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(gp[i].a), sum, tot[i][r]);
        }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) y[r * ldy + n + i] = hsum(tot[i][r]) + bs[i][r];
}

// Row n of W as fp32 (K floats).
template <class F>
inline void dequant_row(const F& f, int64_t n, float* out) {
  const int64_t G = f.groups(), C = f.chunks();
  for (int64_t g = 0; g < G; ++g) {
    const typename F::Grp gp = f.group(n, g);
    for (int64_t c = 0; c < C; ++c) {
      __m256 a, b = _mm256_setzero_ps();
      if constexpr (F::CHUNK_SCALE) a = _mm256_set1_ps(gp.a[c]);
      else a = _mm256_set1_ps(gp.a);
      if constexpr (F::HAS_B) b = _mm256_set1_ps(gp.b[c]);
      __m256 w[F::NV];
      f.decode(gp, c, w);
      for (int v = 0; v < F::NV; ++v) _mm256_storeu_ps(out + (g * C + c) * F::CH + 8 * v, _mm256_fmadd_ps(a, w[v], b));
    }
  }
}

template <class F>
void run(const F& f, const float* x_in, int64_t T, int64_t K, int64_t N, const float* xc, float* y, int64_t path) {
  // x in the order decode() yields each chunk's codes (F::elem)
  std::vector<float> xperm;
  const float* x = x_in;
  bool identity = true;
  for (int j = 0; j < F::CH; ++j) identity = identity && F::elem(j) == j;
  if (!identity) {
    int perm[F::CH];
    for (int j = 0; j < F::CH; ++j) perm[j] = F::elem(j);
    xperm.resize(T * K);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < K; c += F::CH)
        for (int j = 0; j < F::CH; ++j) xperm[t * K + c + j] = x_in[t * K + c + perm[j]];
    x = xperm.data();
  }
  if (path & PATH_DENSE) {
    at::Tensor w = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
    float* wp = w.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) dequant_row(f, n, wp + n * K);
    });
    const at::Tensor xt = at::from_blob(const_cast<float*>(x), {T, K}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor o = at::linear(xt, w);
    std::memcpy(y, o.data_ptr<float>(), T * N * sizeof(float));
    return;
  }
  if (T == 1 && !path) {
    // Two weight rows side by side (two streams in flight per thread, as linear_row).
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      int64_t n = n0;
      for (; n + 2 <= n1; n += 2) dot_rows<F, 2, 1>(f, n, x, K, xc, y, N);
      if (n < n1) dot_rows<F, 1, 1>(f, n, x, K, xc, y, N);
    });
    return;
  }
  if (T <= SMALL_T && !path) {
    // Each weight row once from memory, then from L1 for the next blocks of (up to 4) token rows.
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t t = 0; t < T; t += 4) {
          const float* xt = x + t * K;
          const float* ct = xc ? xc + t * (K / 32) : nullptr;
          float* yt = y + t * N;
          switch (std::min<int64_t>(4, T - t)) {
            case 4: dot_rows<F, 1, 4>(f, n, xt, K, ct, yt, N); break;
            case 3: dot_rows<F, 1, 3>(f, n, xt, K, ct, yt, N); break;
            case 2: dot_rows<F, 1, 2>(f, n, xt, K, ct, yt, N); break;
            default: dot_rows<F, 1, 1>(f, n, xt, K, ct, yt, N); break;
          }
        }
    });
    return;
  }
  // Prefill: per thread, tiles of TILE_N rows dequantized into scratch (in L2), one GEMM each.
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {T, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t tiles = (N + TILE_N - 1) / TILE_N;
  at::parallel_for(0, tiles, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(TILE_N * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * TILE_N, nb = std::min(TILE_N, N - n0);
      for (int64_t i = 0; i < nb; ++i) dequant_row(f, n0 + i, scratch.data() + i * K);
      const at::Tensor w = at::from_blob(scratch.data(), {nb, K}, at::TensorOptions().dtype(at::kFloat));
      const at::Tensor o = at::linear(xt, w);  // [T, nb]
      const float* op = o.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) std::memcpy(y + t * N + n0, op + t * nb, nb * sizeof(float));
    }
  });
}

// Sums of each row of x over consecutive 32 columns: [T, K / 32].
std::vector<float> chunk_sums(const float* x, int64_t T, int64_t K) {
  std::vector<float> out(T * (K / 32));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < K / 32; ++c) {
      const float* p = x + t * K + c * 32;
      __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
      out[t * (K / 32) + c] = hsum(s);
    }
  return out;
}

int64_t gguf_row_bytes(int64_t fmt, int64_t K) {
  switch (fmt) {
    case FMT_Q8_0: return K / 32 * 34;
    case FMT_Q4_0: return K / 32 * 18;
    case FMT_Q4_K: return K / 256 * 144;
    case FMT_Q5_K: return K / 256 * 176;
    case FMT_Q6_K: return K / 256 * 210;
  }
  return -1;
}

#endif  // PORTSIDE_QUANT_AVX2

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, int64_t fmt,
                        int64_t group_size) {
#ifndef PORTSIDE_QUANT_AVX2
  TORCH_CHECK(false, "quant_linear: built without AVX2/FMA/F16C (use the reference)");
#else
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x must be a 2-D fp32 or bf16 cpu tensor");
  TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 2 && qweight.element_size() == 1, "quant_linear: qweight");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t T = xf.size(0), K = xf.size(1), N = qweight.size(0);
  TORCH_CHECK(K % 32 == 0, "quant_linear: K must be a multiple of 32");
  at::Tensor out = at::empty({T, N}, xf.options());
  const uint8_t* q = static_cast<const uint8_t*>(qweight.data_ptr());
  const int64_t path = fmt & PATH_MASK;
  fmt &= ~PATH_MASK;
  const float* xp = xf.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  auto fp = [](const std::optional<at::Tensor>& t) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "quant_linear: scales/zeros must be contiguous fp32");
    return t->data_ptr<float>();
  };
  if (T > 0 && N > 0) {
    if (fmt == FMT_INT8 || fmt == FMT_INT4) {
      const int64_t gs = group_size > 0 ? group_size : K;
      TORCH_CHECK(gs % 32 == 0 && K % gs == 0 && scales.has_value() && scales->numel() == N * (K / gs),
                  "quant_linear: int groups");
      TORCH_CHECK(qweight.size(1) == (fmt == FMT_INT8 ? K : K / 2), "quant_linear: int codes shape");
      FmtInt8 base{q, K, K / gs, gs, fp(scales), fp(zeros), fmt == FMT_INT8 ? 128.f : 8.f};
      if (fmt == FMT_INT8) run(base, xp, T, K, N, nullptr, yp, path);
      else run(FmtInt4{base}, xp, T, K, N, nullptr, yp, path);
    } else if (fmt == FMT_FP8) {
      TORCH_CHECK(qweight.size(1) == K && scales.has_value() && scales->numel() == N, "quant_linear: fp8 shapes");
      run(FmtFp8{q, K, fp(scales)}, xp, T, K, N, nullptr, yp, path);
    } else {
      const int64_t rb = gguf_row_bytes(fmt, K);
      TORCH_CHECK(rb > 0 && qweight.size(1) == rb && (fmt < FMT_Q4_K || K % 256 == 0),
                  "quant_linear: unsupported GGUF type or row size, fmt ", fmt);
      switch (fmt) {
        case FMT_Q8_0: run(FmtQ8_0{q, K, rb}, xp, T, K, N, nullptr, yp, path); break;
        case FMT_Q4_0: run(FmtQ4_0{q, K, rb}, xp, T, K, N, nullptr, yp, path); break;
        case FMT_Q6_K: run(FmtQ6_K{q, K, rb}, xp, T, K, N, nullptr, yp, path); break;
        default: {
          const std::vector<float> xc = chunk_sums(xp, T, K);
          if (fmt == FMT_Q4_K) run(FmtQ4_K{q, K, rb}, xp, T, K, N, xc.data(), yp, path);
          else run(FmtQ5_K{q, K, rb}, xp, T, K, N, xc.data(), yp, path);
        }
      }
    }
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat).reshape({1, N}));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
#endif
}

// ---- W8A8 ---------------------------------------------------------------------------------------

#ifdef PORTSIDE_QUANT_AVX2

// x [T, K] fp32 -> int8 codes [T, K] and per-token scales: quantize_activation's rounding
// (x / scale clamped to +-127, rounded half to even), scale = amax / 127 or the static one.
void quantize_rows(const float* x, int64_t T, int64_t K, const float* static_scale, int8_t* q, float* scales) {
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = x + t * K;
      float scale;
      if (static_scale) {
        scale = *static_scale;
      } else {
        __m256 m = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        for (int64_t k = 0; k < K; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xr + k), abs_mask));
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        scale = std::max(_mm_cvtss_f32(s) / 127.f, 1e-12f);
      }
      scales[t] = scale;
      const __m256 sv = _mm256_set1_ps(scale), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
      for (int64_t k = 0; k < K; k += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(xr + k), sv);
        v = _mm256_round_ps(_mm256_min_ps(_mm256_max_ps(v, lo), hi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i i = _mm256_cvtps_epi32(v);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + t * K + k), _mm_packs_epi16(w, w));
      }
    }
  });
}

struct W8A8 {
  const uint8_t* w;  // canonical codes [N, K]
  int64_t K, G, gs;
  const float *ws, *wz;  // weight scales, zeros [N, G] (zeros: null = 128)
  const int8_t* xq;  // [T, K]
  const float* xs;  // [T]
  const int32_t* xsum;  // [T, G]: sum of the codes per group
  float* y;  // [T, N]
  int64_t N;
  float zero(int64_t n, int64_t g) const { return wz ? wz[n * G + g] : 128.f; }
};

// AVX2: signed weights (code ^ 0x80 = code - 128), |w| u8 x sign-moved x s8 -> int16 pairs
// (no saturation: |w| <= 128, |x| <= 127) -> int32. Zero points: sum x (c - (z - 128)).
template <int NR, int R>
inline void w8a8_rows_avx2(const W8A8& p, int64_t n, int64_t t) {
  const int64_t pf = prefetch_rows();
  const uint8_t* ahead = p.w + (n + NR - 1 + pf) * p.K;
  const __m256i flip = _mm256_set1_epi8(int8_t(0x80)), ones = _mm256_set1_epi16(1);
  __m256 tot[NR][R];
  float bs[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) tot[i][r] = _mm256_setzero_ps(), bs[i][r] = 0.f;
  for (int64_t g = 0; g < p.G; ++g) {
    __m256i acc[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_si256();
    const int64_t k0 = g * p.gs;
    for (int64_t k = k0; k < k0 + p.gs; k += 32) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T0);
      __m256i wv[NR], wa[NR];
      for (int i = 0; i < NR; ++i) {
        wv[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.w + (n + i) * p.K + k)), flip);
        wa[i] = _mm256_abs_epi8(wv[i]);
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xq + (t + r) * p.K + k));
        for (int i = 0; i < NR; ++i) {
          const __m256i prod = _mm256_maddubs_epi16(wa[i], _mm256_sign_epi8(xv, wv[i]));
          acc[i][r] = _mm256_add_epi32(acc[i][r], _mm256_madd_epi16(prod, ones));
        }
      }
    }
    for (int i = 0; i < NR; ++i) {
      const float a = p.ws[(n + i) * p.G + g];
      const float zc = p.wz ? p.wz[(n + i) * p.G + g] - 128.f : 0.f;
      for (int r = 0; r < R; ++r) {
        tot[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(a), _mm256_cvtepi32_ps(acc[i][r]), tot[i][r]);
        if (zc != 0.f) bs[i][r] -= a * zc * float(p.xsum[(t + r) * p.G + g]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) p.y[(t + r) * p.N + n + i] = p.xs[t + r] * (hsum(tot[i][r]) + bs[i][r]);
}

#ifdef PORTSIDE_QUANT_VNNI
// AVX512-VNNI: dpbusd(u8 codes, s8 x) = sum q x per lane. The codes are unsigned (w + 128), so a
// lane's sum is dominated by 128 * sum x; the group's sum is reduced and 128 * sum x subtracted in
// int32 (exact: |q x| <= 255 * 127, K < 2^16) before anything is rounded to fp32, leaving the
// same signed dot product the AVX2 path gets. Converting the biased lanes to fp32 and subtracting
// zero * sum x afterwards cancels catastrophically (a relative error of ~1e-6 of the output, 10x
// the reference's, enough to flip greedy near-ties). Zero points: sum x (c - (z - 128)) as AVX2.
template <int NR, int R>
inline void w8a8_rows_vnni(const W8A8& p, int64_t n, int64_t t) {
  const int64_t pf = prefetch_rows();
  const uint8_t* ahead = p.w + (n + NR - 1 + pf) * p.K;
  float tot[NR][R], bs[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) tot[i][r] = 0.f, bs[i][r] = 0.f;
  for (int64_t g = 0; g < p.G; ++g) {
    __m512i acc[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_si512();
    const int64_t k0 = g * p.gs, k1 = k0 + p.gs;
    for (int64_t k = k0; k < k1; k += 64) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T0);
      const __mmask64 m = k + 64 <= k1 ? ~__mmask64(0) : (__mmask64(1) << (k1 - k)) - 1;
      __m512i wv[NR];
      for (int i = 0; i < NR; ++i) wv[i] = _mm512_maskz_loadu_epi8(m, p.w + (n + i) * p.K + k);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_maskz_loadu_epi8(m, p.xq + (t + r) * p.K + k);
        for (int i = 0; i < NR; ++i) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], wv[i], xv);
      }
    }
    for (int i = 0; i < NR; ++i) {
      const float a = p.ws[(n + i) * p.G + g];
      const float zc = p.wz ? p.wz[(n + i) * p.G + g] - 128.f : 0.f;
      for (int r = 0; r < R; ++r) {
        const int32_t xs = p.xsum[(t + r) * p.G + g];
        tot[i][r] += a * float(_mm512_reduce_add_epi32(acc[i][r]) - 128 * xs);
        if (zc != 0.f) bs[i][r] -= a * zc * float(xs);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) p.y[(t + r) * p.N + n + i] = p.xs[t + r] * (tot[i][r] + bs[i][r]);
}
#endif

#ifdef PORTSIDE_QUANT_AMX
// AMX-INT8: C [16 n x 16 t] += A [16 n x 64 k] (u8 codes, rows of the canonical matrix) .
// B [16 k/4 x (16 t x 4)] (s8 activations packed VNNI-style per call).
using portside_amx::granted;

// xq [T, K] -> per 16-token tile and 64-column step, 16 rows of (16 tokens x 4 codes) (zero-padded).
std::vector<int8_t> pack_vnni(const int8_t* xq, int64_t T, int64_t K) {
  const int64_t TT = (T + 15) / 16, KK = K / 64;
  std::vector<int8_t> b(TT * KK * 1024, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t tt = t / 16, kk = k / 64, r = (k % 64) / 4;
      b[(tt * KK + kk) * 1024 + r * 64 + (t % 16) * 4 + k % 4] = xq[t * K + k];
    }
  return b;
}

void w8a8_amx(const W8A8& p, int64_t T) {
  const int64_t KK = p.K / 64, TT = (T + 15) / 16, kpg = p.gs / 64;
  const std::vector<int8_t> xb = pack_vnni(p.xq, T, p.K);
  at::parallel_for(0, p.N / 16, 1, [&](int64_t b0, int64_t b1) {
    portside_amx::configure_16x64();
    alignas(64) int32_t c[16][16];
    std::vector<float> acc(16 * 16);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t n0 = nb * 16;
      for (int64_t tt = 0; tt < TT; ++tt) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t g = 0; g < p.G; ++g) {
          _tile_zero(0);
          for (int64_t kk = g * kpg; kk < (g + 1) * kpg; ++kk) {
            _tile_loadd(1, p.w + n0 * p.K + kk * 64, p.K);
            _tile_loadd(2, xb.data() + (tt * KK + kk) * 1024, 64);
            _tile_dpbusd(0, 1, 2);
          }
          _tile_stored(0, c, 64);
          for (int i = 0; i < 16; ++i) {
            const float a = p.ws[(n0 + i) * p.G + g], z = p.zero(n0 + i, g);
            for (int j = 0; j < 16 && tt * 16 + j < T; ++j)
              acc[i * 16 + j] += a * (float(c[i][j]) - z * float(p.xsum[(tt * 16 + j) * p.G + g]));
          }
        }
        for (int i = 0; i < 16; ++i)
          for (int j = 0; j < 16 && tt * 16 + j < T; ++j) p.y[(tt * 16 + j) * p.N + n0 + i] = p.xs[tt * 16 + j] * acc[i * 16 + j];
      }
    }
    _tile_release();
  });
}
#endif

template <int NR, int R>
inline void w8a8_rows(const W8A8& p, int64_t n, int64_t t) {
#ifdef PORTSIDE_QUANT_VNNI
  w8a8_rows_vnni<NR, R>(p, n, t);
#else
  w8a8_rows_avx2<NR, R>(p, n, t);
#endif
}

#endif  // PORTSIDE_QUANT_AVX2

// From this many token rows symmetric W8A8 takes gguf_tile.cpp's tiles: on the Zen 5 (1 thread,
// 5632 x 2048, `ci/bench/int4_act_kernels.py`) the row kernel took 1.3 / 3.0 / 4.1 / 12.9 ms at 16 /
// 24 / 32 / 128 rows, the tiles 1.95 / 2.2 / 2.4 / 5.3.
constexpr int64_t kW8A8TileTokens = 24;

at::Tensor quant_linear_w8a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& input_scale,
                             const std::optional<at::Tensor>& bias, int64_t group_size) {
#ifndef PORTSIDE_QUANT_AVX2
  TORCH_CHECK(false, "quant_linear_w8a8: built without AVX2 (use the reference)");
#else
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear_w8a8: x must be a 2-D fp32 or bf16 cpu tensor");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t T = xf.size(0), K = xf.size(1), N = qweight.size(0);
  const int64_t gs = group_size > 0 ? group_size : K, G = K / gs;
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == at::kByte && qweight.size(1) == K && gs % 32 == 0 &&
                  K % gs == 0 && scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * G,
              "quant_linear_w8a8: shapes");
  TORCH_CHECK(!zeros.has_value() || (zeros->scalar_type() == at::kFloat && zeros->is_contiguous()), "quant_linear_w8a8: zeros");
  at::Tensor out = at::empty({T, N}, xf.options());
  std::vector<int8_t> xq(T * K);
  std::vector<float> xs(T);
  std::vector<int32_t> xsum(T * G);
  float static_scale = 0.f;
  if (input_scale.has_value()) static_scale = input_scale->to(at::kFloat).reshape({-1})[0].item<float>();
  quantize_rows(xf.data_ptr<float>(), T, K, input_scale.has_value() ? &static_scale : nullptr, xq.data(), xs.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      int32_t s = 0;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) s += xq[t * K + k];
      xsum[t * G + g] = s;
    }
  const W8A8 p{static_cast<const uint8_t*>(qweight.data_ptr()), K, G, gs, scales.data_ptr<float>(),
               zeros.has_value() ? zeros->data_ptr<float>() : nullptr, xq.data(), xs.data(), xsum.data(),
               out.data_ptr<float>(), N};
  bool done = false;
#ifdef PORTSIDE_QUANT_AMX
  if (T >= 16 && N % 16 == 0 && gs % 64 == 0 && granted()) {
    w8a8_amx(p, T);
    done = true;
  }
#endif
  if (!done && T >= kW8A8TileTokens && portside_gguf::tiles_apply(portside_gguf::best_isa(), portside_gguf::GGML_Q8_0, T) &&
      (!zeros.has_value() || zeros->eq(128.0).all().item<bool>())) {
    // many token rows, symmetric (zero points 128 or none): the tiles of interleaved rows
    // (gguf_tile.cpp), the same integers per group
    const portside_gguf::Ctx c{nullptr, 0, K, N, T, xq.data(), xs.data(), nullptr, nullptr, nullptr, nullptr,
                               out.data_ptr<float>()};
    portside_gguf::dot_tiles_int8(c, portside_gguf::best_isa(), {p.w, gs, p.ws}, K);
    done = true;
  }
  if (!done && T == 1) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      int64_t n = n0;
      for (; n + 2 <= n1; n += 2) w8a8_rows<2, 1>(p, n, 0);
      if (n < n1) w8a8_rows<1, 1>(p, n, 0);
    });
  } else if (!done) {
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t t = 0; t < T; t += 4) {
          switch (std::min<int64_t>(4, T - t)) {
            case 4: w8a8_rows<1, 4>(p, n, t); break;
            case 3: w8a8_rows<1, 3>(p, n, t); break;
            case 2: w8a8_rows<1, 2>(p, n, t); break;
            default: w8a8_rows<1, 1>(p, n, t); break;
          }
        }
    });
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat).reshape({1, N}));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
#endif
}

std::string quant_isa() {
  std::string s;
#ifdef PORTSIDE_QUANT_AVX2
  s = "avx2";
#endif
#ifdef PORTSIDE_QUANT_VNNI
  s += ",avx512vnni";
#endif
#ifdef PORTSIDE_QUANT_AMX
  if (granted()) s += ",amx";
#endif
  return s;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor? scales, Tensor? zeros, Tensor? bias, int fmt, int group_size) -> Tensor");
  m.def("quant_linear_w8a8(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? input_scale, Tensor? bias, "
        "int group_size) -> Tensor");
  m.def("quant_isa() -> str", &quant_isa);
  m.def("quant_set_prefetch(int rows) -> int", &quant_set_prefetch);
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_w8a8", &quant_linear_w8a8);
}
