// GGUF Q8_0 and Q4_0 weights times activations quantized per 32 (Q8_0-style): scalar, AVX2 and
// AVX-512 VNNI kernels (gguf_dot.cpp says how; portside.quant.gguf_dot_ref is the arithmetic).

#include "gguf_dot.h"

namespace portside_gguf {
namespace {

// ---- scalar ---------------------------------------------------------------------------------------

struct ScalarQ8_0 {
  template <int NR, int R>
  PORTSIDE_GD_SCALAR static void rows(const Ctx& c, int64_t n, int64_t t) {
    const int64_t B = c.K / 32;
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) {
        const uint8_t* row = c.w + (n + i) * c.rb;
        const int8_t* x = c.xq + (t + r) * c.K;
        float acc = 0.f;
        for (int64_t b = 0; b < B; ++b) {
          const uint8_t* blk = row + b * 34;
          int32_t s = 0;
          for (int j = 0; j < 32; ++j) s += int32_t(int8_t(blk[2 + j])) * x[b * 32 + j];
          acc += (f16(blk) * c.xd[(t + r) * B + b]) * float(s);
        }
        c.y[(t + r) * c.N + n + i] = acc;
      }
  }
};

struct ScalarQ4_0 {
  template <int NR, int R>
  PORTSIDE_GD_SCALAR static void rows(const Ctx& c, int64_t n, int64_t t) {
    const int64_t B = c.K / 32;
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) {
        const uint8_t* row = c.w + (n + i) * c.rb;
        const int8_t* x = c.xq + (t + r) * c.K;
        float acc = 0.f;
        for (int64_t b = 0; b < B; ++b) {
          const uint8_t* blk = row + b * 18;
          int32_t s = 0;
          for (int j = 0; j < 16; ++j) {
            s += (int32_t(blk[2 + j] & 0x0F) - 8) * x[b * 32 + j];
            s += (int32_t(blk[2 + j] >> 4) - 8) * x[b * 32 + 16 + j];
          }
          acc += (f16(blk) * c.xd[(t + r) * B + b]) * float(s);
        }
        c.y[(t + r) * c.N + n + i] = acc;
      }
  }
};

// ---- AVX2 -----------------------------------------------------------------------------------------

#ifdef PORTSIDE_GD_AVX2

template <bool Q4>
struct Avx2Q8Q4 {  // Q4 false: Q8_0 (34-byte blocks), true: Q4_0 (18-byte blocks)
  template <int NR, int R>
  static void rows(const Ctx& c, int64_t n, int64_t t) {
    constexpr int64_t BB = Q4 ? 18 : 34;
    const int64_t B = c.K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      prefetch<NR, R>(c, n, b * BB, BB);
      __m256i wu[NR], ws[NR];
      float dw[NR];
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = c.w + (n + i) * c.rb + b * BB;
        dw[i] = h2f(blk);
        if constexpr (Q4) {
          wu[i] = nibbles16(blk + 2);
        } else {
          ws[i] = load256(blk + 2);
          wu[i] = _mm256_abs_epi8(ws[i]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = load256(c.xq + (t + r) * c.K + b * 32);
        const float dx = c.xd[(t + r) * B + b];
        for (int i = 0; i < NR; ++i) {
          __m256i s;
          if constexpr (Q4) {  // nibble . x - 8 * sum(x), per lane of 4 codes
            s = _mm256_madd_epi16(_mm256_maddubs_epi16(wu[i], xv), ones);
            s = _mm256_add_epi32(s, load256(c.lb + (t + r) * (c.K / 4) + b * 8));
          } else {  // |w| . (x with w's sign): |w| <= 128, |x| <= 127, a pair fits int16
            s = _mm256_madd_epi16(_mm256_maddubs_epi16(wu[i], _mm256_sign_epi8(xv, ws[i])), ones);
          }
          acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[i] * dx), _mm256_cvtepi32_ps(s), acc[i][r]);
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) c.y[(t + r) * c.N + n + i] = hsum256(acc[i][r]);
  }
};

#endif  // PORTSIDE_GD_AVX2

// ---- AVX-512 VNNI ---------------------------------------------------------------------------------

#ifdef PORTSIDE_GD_VNNI

// Two blocks' fp16 scales as 16 floats: 8 lanes of the first, 8 of the second.
inline __m512 two_scales(const uint8_t* b0, const uint8_t* b1) {
  uint16_t h0, h1;
  std::memcpy(&h0, b0, 2);
  std::memcpy(&h1, b1, 2);
  const __m256i h = _mm256_set_m128i(_mm_set1_epi16(short(h1)), _mm_set1_epi16(short(h0)));
  return _mm512_cvtph_ps(h);
}

#ifdef PORTSIDE_GD_VBMI

// Q4_0, four blocks at 18-byte steps from one row pointer: the vpermb index of the zmm of blocks
// 2p and 2p + 1 (byte j: code byte j % 16 of block 2p + j / 32, past its 2-byte scale; indices from
// 64 read the second source, the 8 bytes after the first 64).
inline __m512i q4_index(int p) {
  alignas(64) uint8_t v[64];
  for (int j = 0; j < 64; ++j) v[j] = uint8_t(18 * (2 * p + j / 32) + 2 + j % 16);
  return _mm512_load_si512(v);
}

// Per 16-bit word: 4 for the second 16 bytes of each 32 (the high nibbles), else 0.
inline __m512i q4_shifts() {
  alignas(64) uint16_t v[32];
  for (int w = 0; w < 32; ++w) v[w] = uint16_t((2 * w) % 32 >= 16 ? 4 : 0);
  return _mm512_load_si512(v);
}

// vpermw index: the four blocks' fp16 scales (words 0, 9, 18, 27), each 8 times.
inline __m512i q4_scale_index() {
  alignas(64) uint16_t v[32];
  for (int w = 0; w < 32; ++w) v[w] = uint16_t(9 * (w / 8));
  return _mm512_load_si512(v);
}

#endif  // PORTSIDE_GD_VBMI

template <bool Q4>
struct VnniQ8Q4 {
  static constexpr int DECODE_ROWS = Q4 ? 4 : 1, PREFILL_ROWS = Q4 ? 2 : 4;  // (gguf_dot.h's decode_rows, prefill_rows)
  template <int NR, int R>
  static void rows(const Ctx& c, int64_t n, int64_t t) {
    constexpr int64_t BB = Q4 ? 18 : 34;
    const int64_t B = c.K / 32, K4 = c.K / 4;
    const __m512i flip = _mm512_set1_epi8(int8_t(0x80)), m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[NR][R];
    float tail[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps(), tail[i][r] = 0.f;
    int64_t b = 0;
#ifdef PORTSIDE_GD_VBMI
    if constexpr (Q4) {  // four blocks (72 bytes) per pass: one load (and 8 bytes more, masked) per row;
                         // vpermb puts each block's 16 code bytes twice in a 32-byte half, vpsrlvw
                         // shifts the second copy's words by 4 (the high nibbles)
      const __m512i i0 = q4_index(0), i1 = q4_index(1), sh = q4_shifts(), is = q4_scale_index();
      for (; b + 4 <= B; b += 4) {
        prefetch<NR, R>(c, n, b * BB, 4 * BB);
        __m512i wv[2][NR];
        __m512 dw[2][NR];
        for (int i = 0; i < NR; ++i) {
          const uint8_t* blk = c.w + (n + i) * c.rb + b * BB;
          const __m512i a = _mm512_loadu_si512(blk), e = _mm512_maskz_loadu_epi8(0xFF, blk + 64);
          wv[0][i] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi8(i0, a), sh), m4);
          wv[1][i] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutex2var_epi8(a, i1, e), sh), m4);
          const __m512i h = _mm512_permutexvar_epi16(is, a);  // the 4 fp16 scales, each 8 times
          dw[0][i] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
          dw[1][i] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
        }
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < 2; ++p) {
            __m512i xv = _mm512_loadu_si512(c.xq + (t + r) * c.K + (b + 2 * p) * 32);
            const __m512i bias = _mm512_loadu_si512(c.lb + (t + r) * K4 + (b + 2 * p) * 8);
            __m512 dx = _mm512_loadu_ps(c.xdl + (t + r) * K4 + (b + 2 * p) * 8);
            __asm__("" : "+v"(xv), "+v"(dx));  // in registers for the NR rows (as in the two-block loop)
            for (int i = 0; i < NR; ++i) {
              const __m512i s = _mm512_dpbusd_epi32(bias, wv[p][i], xv);
              acc[i][r] = _mm512_fmadd_ps(_mm512_mul_ps(dw[p][i], dx), _mm512_cvtepi32_ps(s), acc[i][r]);
            }
          }
      }
    }
#endif
    for (; b + 2 <= B; b += 2) {
      prefetch<NR, R>(c, n, b * BB, 2 * BB);
      __m512i wv[NR];
      __m512 dw[NR];
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = c.w + (n + i) * c.rb + b * BB;
        if constexpr (Q4) {  // [q0 q0 q1 q1] per 128-bit lane, upper copies shifted: the high nibbles
          __m512i a = _mm512_castsi128_si512(load128(blk + 2));
          a = _mm512_inserti32x4(a, load128(blk + BB + 2), 2);
          a = _mm512_shuffle_i32x4(a, a, _MM_SHUFFLE(2, 2, 0, 0));
          wv[i] = _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, a, _mm512_srli_epi16(a, 4)), m4);
        } else {  // w + 128 (unsigned)
          const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(load256(blk + 2)), load256(blk + BB + 2), 1);
          wv[i] = _mm512_xor_si512(a, flip);
        }
        dw[i] = two_scales(blk, blk + BB);
      }
      for (int r = 0; r < R; ++r) {
        __m512i xv = _mm512_loadu_si512(c.xq + (t + r) * c.K + b * 32);
        const __m512i bias = _mm512_loadu_si512(c.lb + (t + r) * K4 + b * 8);
        __m512 dx = _mm512_loadu_ps(c.xdl + (t + r) * K4 + b * 8);
        __asm__("" : "+v"(xv), "+v"(dx));  // loaded once for the NR rows (GCC spilled xv, reloaded dx per row)
        for (int i = 0; i < NR; ++i) {
          const __m512i s = _mm512_dpbusd_epi32(bias, wv[i], xv);
          acc[i][r] = _mm512_fmadd_ps(_mm512_mul_ps(dw[i], dx), _mm512_cvtepi32_ps(s), acc[i][r]);
        }
      }
    }
    if (b < B) {  // an odd last block, 256-bit
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = c.w + (n + i) * c.rb + b * BB;
        __m256i wv;
        if constexpr (Q4) wv = nibbles16(blk + 2);
        else wv = _mm256_xor_si256(load256(blk + 2), _mm256_set1_epi8(int8_t(0x80)));
        for (int r = 0; r < R; ++r) {
          const __m256i bias = load256(c.lb + (t + r) * K4 + b * 8);
          const __m256i s = _mm256_dpbusd_epi32(bias, wv, load256(c.xq + (t + r) * c.K + b * 32));
          tail[i][r] = (h2f(blk) * c.xd[(t + r) * B + b]) * hsum256(_mm256_cvtepi32_ps(s));
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) c.y[(t + r) * c.N + n + i] = _mm512_reduce_add_ps(acc[i][r]) + tail[i][r];
  }
};

#endif  // PORTSIDE_GD_VNNI

}  // namespace

void dot_q8_q4(const Ctx& c, int64_t isa, bool q4, int64_t n0, int64_t n1) {
  switch (isa) {
#ifdef PORTSIDE_GD_VNNI
    case ISA_VNNI: return q4 ? drive<VnniQ8Q4<true>>(c, n0, n1) : drive<VnniQ8Q4<false>>(c, n0, n1);
#endif
#ifdef PORTSIDE_GD_AVX2
    case ISA_AVX2: return q4 ? drive<Avx2Q8Q4<true>>(c, n0, n1) : drive<Avx2Q8Q4<false>>(c, n0, n1);
#endif
    default: return q4 ? drive<ScalarQ4_0>(c, n0, n1) : drive<ScalarQ8_0>(c, n0, n1);
  }
}

}  // namespace portside_gguf
