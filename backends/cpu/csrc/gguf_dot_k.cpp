// GGUF's 256-value formats (Q4_K, Q5_K, Q6_K, IQ4_XS) times activations quantized per 256
// (Q8_K-style, with the codes' sums per 16): scalar, AVX2 and AVX-512 VNNI kernels for each.
// gguf_dot.cpp says how; portside.quant.gguf_dot_ref is the arithmetic.
//
// Q4_K / Q5_K: unsigned 4/5-bit codes times x per sub-block of 32, by the sub-block's 6-bit
// scale; the minimums come from x's per-16 sums. Q6_K: unsigned 6-bit codes (the -32 offset
// also from the per-16 sums) by the int8 scale of each 16. IQ4_XS: the 16 non-linear values
// looked up per nibble (pshufb), signed times signed with llama.cpp's sign trick (|v| . x
// carrying v's sign), by the sub-block's 6-bit scale minus 32.

#include "gguf_dot.h"

namespace portside_gguf {
namespace {

// ---- scalar -------------------------------------------------------------------------------------

template <bool Q5>
struct ScalarQ45_K {  // Q5 false: Q4_K (144-byte blocks), true: Q5_K (176)
  template <int NR, int R>
  PORTSIDE_GD_SCALAR static void rows(const Ctx& c, int64_t n, int64_t t) {
    constexpr int64_t BB = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
    const int64_t S = c.K / 256;
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) {
        const uint8_t* row = c.w + (n + i) * c.rb;
        const int8_t* x = c.xq + (t + r) * c.K;
        const int16_t* bs = c.bs + (t + r) * (c.K / 16);
        float acc = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const uint8_t* blk = row + s * BB;
          uint8_t sc[8], mn[8];
          k_scales(blk + 4, sc, mn);
          int32_t isum = 0, msum = 0;
          for (int j = 0; j < 8; ++j) {
            const uint8_t* qs = blk + QS + 32 * (j / 2);
            const int shift = 4 * (j & 1);
            const int8_t* xj = x + s * 256 + 32 * j;
            int32_t dot = 0;
            for (int l = 0; l < 32; ++l) {
              int32_t q = (qs[l] >> shift) & 0x0F;
              if constexpr (Q5) q |= ((blk[16 + l] >> j) & 1) << 4;
              dot += q * xj[l];
            }
            isum += int32_t(sc[j]) * dot;
            msum += int32_t(mn[j]) * (int32_t(bs[s * 16 + 2 * j]) + bs[s * 16 + 2 * j + 1]);
          }
          const float dx = c.xd[(t + r) * S + s];
          acc += (dx * f16(blk)) * float(isum) - (dx * f16(blk + 2)) * float(msum);
        }
        c.y[(t + r) * c.N + n + i] = acc;
      }
  }
};

struct ScalarQ6_K {
  template <int NR, int R>
  PORTSIDE_GD_SCALAR static void rows(const Ctx& c, int64_t n, int64_t t) {
    const int64_t S = c.K / 256;
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) {
        const uint8_t* row = c.w + (n + i) * c.rb;
        const int8_t* x = c.xq + (t + r) * c.K;
        float acc = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const uint8_t *blk = row + s * 210, *ql = blk, *qh = blk + 128;
          const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
          int32_t isum = 0;
          for (int e = 0; e < 256; e += 16) {  // sub-blocks of 16: half h, quarter q, from l
            const int h = e / 128, q = (e % 128) / 32, l0 = e % 32;
            int32_t dot = 0;
            for (int l = l0; l < l0 + 16; ++l) {
              const int32_t lo = (ql[64 * h + 32 * (q & 1) + l] >> (4 * (q >> 1))) & 0x0F;
              const int32_t hi = (qh[32 * h + l] >> (2 * q)) & 3;
              dot += ((lo | (hi << 4)) - 32) * x[s * 256 + e + l - l0];
            }
            isum += int32_t(sc[e / 16]) * dot;
          }
          acc += (c.xd[(t + r) * S + s] * f16(blk + 208)) * float(isum);
        }
        c.y[(t + r) * c.N + n + i] = acc;
      }
  }
};

struct ScalarIQ4_XS {
  template <int NR, int R>
  PORTSIDE_GD_SCALAR static void rows(const Ctx& c, int64_t n, int64_t t) {
    const int64_t S = c.K / 256;
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) {
        const uint8_t* row = c.w + (n + i) * c.rb;
        const int8_t* x = c.xq + (t + r) * c.K;
        float acc = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const uint8_t* blk = row + s * 136;
          int16_t ls[8];
          iq4_scales(blk, ls);
          int32_t isum = 0;
          for (int j = 0; j < 8; ++j) {
            const uint8_t* qs = blk + 8 + 16 * j;
            const int8_t* xj = x + s * 256 + 32 * j;
            int32_t dot = 0;
            for (int l = 0; l < 16; ++l)
              dot += int32_t(IQ4_VALUES[qs[l] & 0x0F]) * xj[l] + int32_t(IQ4_VALUES[qs[l] >> 4]) * xj[16 + l];
            isum += int32_t(ls[j]) * dot;
          }
          acc += (c.xd[(t + r) * S + s] * f16(blk)) * float(isum);
        }
        c.y[(t + r) * c.N + n + i] = acc;
      }
  }
};

// ---- AVX2 ---------------------------------------------------------------------------------------

#ifdef PORTSIDE_GD_AVX2

template <bool Q5>
struct Avx2Q45_K {
  template <int NR, int R>
  static void rows(const Ctx& c, int64_t n, int64_t t) {
    constexpr int64_t BB = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
    const int64_t S = c.K / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[NR][R], accm[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = accm[i][r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      prefetch<NR, R>(c, n, s * BB, BB);
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = c.w + (n + i) * c.rb + s * BB;
        alignas(16) uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        __m256i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
        __m256i hb = _mm256_setzero_si256();
        if constexpr (Q5) hb = load256(blk + 16);
        for (int p = 0; p < 4; ++p) {
          const __m256i q = load256(blk + QS + 32 * p);
          __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
          if constexpr (Q5) {  // bit 2p (low nibbles' sub-block) and 2p + 1 of each qh byte, as bit 4
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p + 1), one), 4));
          }
          const __m256i slo = _mm256_set1_epi16(sc[2 * p]), shi = _mm256_set1_epi16(sc[2 * p + 1]);
          for (int r = 0; r < R; ++r) {
            const int8_t* x = c.xq + (t + r) * c.K + s * 256 + 64 * p;
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(x)), slo));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(x + 32)), shi));
          }
        }
        const __m256i mp = pairs16(mn);
        const float d = h2f(blk), dmin = h2f(blk + 2);
        for (int r = 0; r < R; ++r) {
          const float dx = c.xd[(t + r) * S + s];
          const __m256i m = _mm256_madd_epi16(load256(c.bs + (t + r) * (c.K / 16) + s * 16), mp);
          acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * d), _mm256_cvtepi32_ps(isum[r]), acc[i][r]);
          accm[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dmin), _mm256_cvtepi32_ps(m), accm[i][r]);
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) c.y[(t + r) * c.N + n + i] = hsum256(acc[i][r]) - hsum256(accm[i][r]);
  }
};

struct Avx2Q6_K {
  template <int NR, int R>
  static void rows(const Ctx& c, int64_t n, int64_t t) {
    const int64_t S = c.K / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    __m256 acc[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      prefetch<NR, R>(c, n, s * 210, 210);
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = c.w + (n + i) * c.rb + s * 210;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        __m256i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h) {
          const __m256i l0 = load256(blk + 64 * h), l1 = load256(blk + 64 * h + 32), hb = load256(blk + 128 + 32 * h);
          for (int q = 0; q < 4; ++q) {  // 32 values: the low (q < 2) or high nibbles of l0 / l1, 2 bits of qh
            const __m256i b = (q & 1) ? l1 : l0;
            const __m256i lo = _mm256_and_si256(q < 2 ? b : _mm256_srli_epi16(b, 4), m4);
            const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * q), m3), 4);
            const __m256i u = _mm256_or_si256(lo, hi);
            const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * q + 1]), _mm_set1_epi16(sc[8 * h + 2 * q]));
            for (int r = 0; r < R; ++r) {
              const __m256i xv = load256(c.xq + (t + r) * c.K + s * 256 + 128 * h + 32 * q);
              isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), scv));
            }
          }
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(load128(sc));
        const float d = h2f(blk + 208);
        for (int r = 0; r < R; ++r) {  // the codes' offset: 32 * sum_j sc_j * (x's sum over sub-block j)
          const __m256i off = _mm256_madd_epi16(load256(c.bs + (t + r) * (c.K / 16) + s * 16), sc16);
          const __m256i v = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(off, 5));
          acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(c.xd[(t + r) * S + s] * d), _mm256_cvtepi32_ps(v), acc[i][r]);
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) c.y[(t + r) * c.N + n + i] = hsum256(acc[i][r]);
  }
};

struct Avx2IQ4_XS {
  template <int NR, int R>
  static void rows(const Ctx& c, int64_t n, int64_t t) {
    const int64_t S = c.K / 256;
    const __m256i table = _mm256_broadcastsi128_si256(load128(IQ4_VALUES));
    __m256 acc[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      prefetch<NR, R>(c, n, s * 136, 136);
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = c.w + (n + i) * c.rb + s * 136;
        int16_t ls[8];
        iq4_scales(blk, ls);
        __m256i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i v = _mm256_shuffle_epi8(table, nibbles16(blk + 8 + 16 * j));
          const __m256i av = _mm256_abs_epi8(v), scv = _mm256_set1_epi16(ls[j]);
          for (int r = 0; r < R; ++r) {  // |v| . (x with v's sign): |v|, |x| <= 127, a pair fits int16
            const __m256i xv = load256(c.xq + (t + r) * c.K + s * 256 + 32 * j);
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v)), scv));
          }
        }
        const float d = h2f(blk);
        for (int r = 0; r < R; ++r)
          acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(c.xd[(t + r) * S + s] * d), _mm256_cvtepi32_ps(isum[r]), acc[i][r]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) c.y[(t + r) * c.N + n + i] = hsum256(acc[i][r]);
  }
};

#endif  // PORTSIDE_GD_AVX2

// ---- AVX-512 VNNI -------------------------------------------------------------------------------

#ifdef PORTSIDE_GD_VNNI

// k_scales in a register: the 8 scales (bytes 0..7), then the 8 minimums (8..15), from one 16-byte
// load at s12 (the 4 bytes past the 12 are the block's own: its codes follow).
inline __m128i k_scales_v(const uint8_t* s12) {
  const __m128i v = load128(s12);
  const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  // u0 u2 u1 u2
  const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  // u0 u0 u1 u1
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi32(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}

template <bool Q5>
struct VnniQ45_K {  // a pair of sub-blocks (64 codes) per zmm: maddubs, then vpdpwssd by their scales
  static constexpr int DECODE_ROWS = 4;  // (gguf_dot.h's decode_rows)
  template <int NR, int R>
  static void rows(const Ctx& c, int64_t n, int64_t t) {
    constexpr int64_t BB = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
    const int64_t S = c.K / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    // int16 lane l of pair p takes scale 2p + (l >= 16): sub-blocks 2p (low nibbles), 2p + 1 (high)
    __m512i idx[4];
    for (int p = 0; p < 4; ++p)
      idx[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(short(2 * p))),
                                  _mm256_set1_epi16(short(2 * p + 1)), 1);
    __m512 acc[NR][R];
    __m256 accm[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps(), accm[i][r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      prefetch<NR, R>(c, n, s * BB, BB);
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = c.w + (n + i) * c.rb + s * BB;
        const __m128i ks = k_scales_v(blk + 4);
        const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(ks));
        __m512i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
        __m512i hb = _mm512_setzero_si512();
        if constexpr (Q5) hb = _mm512_broadcast_i64x4(load256(blk + 16));
        for (int p = 0; p < 4; ++p) {
          const __m512i q = _mm512_broadcast_i64x4(load256(blk + QS + 32 * p));
          __m512i nib = _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, q, _mm512_srli_epi16(q, 4)), m4);
          if constexpr (Q5) {
            const __m512i h = _mm512_mask_blend_epi64(0xF0, _mm512_srli_epi16(hb, 2 * p), _mm512_srli_epi16(hb, 2 * p + 1));
            nib = _mm512_or_si512(nib, _mm512_slli_epi16(_mm512_and_si512(h, one), 4));
          }
          const __m512i scv = _mm512_permutexvar_epi16(idx[p], sc16);
          for (int r = 0; r < R; ++r) {
            const __m512i xv = _mm512_loadu_si512(c.xq + (t + r) * c.K + s * 256 + 64 * p);
            isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(nib, xv), scv);
          }
        }
        const __m128i m8 = _mm_cvtepu8_epi16(_mm_srli_si128(ks, 8));
        const __m256i mp = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));  // (pairs16)
        const float d = h2f(blk), dmin = h2f(blk + 2);
        for (int r = 0; r < R; ++r) {
          const float dx = c.xd[(t + r) * S + s];
          const __m256i m = _mm256_madd_epi16(load256(c.bs + (t + r) * (c.K / 16) + s * 16), mp);
          acc[i][r] = _mm512_fmadd_ps(_mm512_set1_ps(dx * d), _mm512_cvtepi32_ps(isum[r]), acc[i][r]);
          accm[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dmin), _mm256_cvtepi32_ps(m), accm[i][r]);
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) c.y[(t + r) * c.N + n + i] = _mm512_reduce_add_ps(acc[i][r]) - hsum256(accm[i][r]);
  }
};

struct VnniQ6_K {  // two quarters (64 codes) per zmm: maddubs of the unsigned codes, each int16 pair's
                   // -32 offset added (Ctx::ps: lanes then hold true signed dots), vpdpwssd by the scales
  static constexpr int DECODE_ROWS = 4;  // (gguf_dot.h's decode_rows)
  template <int NR, int R>
  static void rows(const Ctx& c, int64_t n, int64_t t) {
    const int64_t S = c.K / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
    __m512i idx[4];  // int16 lane l of pair p (codes 64p .. 64p + 63) takes scale 4p + l / 8
    for (int p = 0; p < 4; ++p) {
      alignas(64) int16_t v[32];
      for (int l = 0; l < 32; ++l) v[l] = int16_t(4 * p + l / 8);
      idx[p] = _mm512_load_si512(v);
    }
    __m512 acc[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      prefetch<NR, R>(c, n, s * 210, 210);
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = c.w + (n + i) * c.rb + s * 210;
        const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(load128(blk + 192)));
        __m512i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
          const __m512i l = _mm512_loadu_si512(blk + 64 * h);
          const __m512i hb = _mm512_broadcast_i64x4(load256(blk + 128 + 32 * h));
          for (int half = 0; half < 2; ++half) {  // quarters 2 half (from l's first 32 bytes), 2 half + 1
            const __m512i lo = _mm512_and_si512(half ? _mm512_srli_epi16(l, 4) : l, m4);
            const __m512i hi = _mm512_mask_blend_epi64(0xF0, _mm512_srli_epi16(hb, 4 * half), _mm512_srli_epi16(hb, 4 * half + 2));
            const __m512i u = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(hi, m3), 4));
            const int p = 2 * h + half;
            const __m512i scv = _mm512_permutexvar_epi16(idx[p], sc16);
            for (int r = 0; r < R; ++r) {
              const int64_t e = (t + r) * c.K + s * 256 + 64 * p;
              const __m512i pr = _mm512_add_epi16(_mm512_maddubs_epi16(u, _mm512_loadu_si512(c.xq + e)),
                                                  _mm512_loadu_si512(c.ps + e / 2));
              isum[r] = _mm512_dpwssd_epi32(isum[r], pr, scv);
            }
          }
        }
        const float d = h2f(blk + 208);
        for (int r = 0; r < R; ++r)
          acc[i][r] = _mm512_fmadd_ps(_mm512_set1_ps(c.xd[(t + r) * S + s] * d), _mm512_cvtepi32_ps(isum[r]), acc[i][r]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) c.y[(t + r) * c.N + n + i] = _mm512_reduce_add_ps(acc[i][r]);
  }
};

struct VnniIQ4_XS {  // two sub-blocks (64 codes) per zmm: the looked-up values + 128 (unsigned) by x
                     // with vpdpbusd, x's bias (-128 x the lane's 4 codes) preloaded (Ctx::lb), times
                     // the sub-block scales in int32; one conversion per block
  template <int NR, int R>
  static void rows(const Ctx& c, int64_t n, int64_t t) {
    const int64_t S = c.K / 256;
    const __m512i table = _mm512_broadcast_i32x4(_mm_add_epi8(load128(IQ4_VALUES), _mm_set1_epi8(char(0x80))));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      prefetch<NR, R>(c, n, s * 136, 136);
      for (int i = 0; i < NR; ++i) {
        const uint8_t* blk = c.w + (n + i) * c.rb + s * 136;
        int16_t ls[8];
        iq4_scales(blk, ls);
        __m512i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) {  // sub-blocks 2p, 2p + 1: [low, high nibbles of 2p | of 2p + 1]
          const __m256i q = load256(blk + 8 + 32 * p);
          __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(q), q, 1);
          a = _mm512_shuffle_i32x4(a, a, _MM_SHUFFLE(1, 1, 0, 0));
          const __m512i v = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, a, _mm512_srli_epi16(a, 4)), m4));
          const __m512i sc = _mm512_inserti64x4(_mm512_set1_epi32(ls[2 * p]), _mm256_set1_epi32(ls[2 * p + 1]), 1);
          for (int r = 0; r < R; ++r) {  // |lane| <= 4 * 127 * 127, times |scale| <= 32: int32 exact
            const int64_t e = (t + r) * c.K + s * 256 + 64 * p;
            const __m512i lane = _mm512_dpbusd_epi32(_mm512_loadu_si512(c.lb + e / 4), v, _mm512_loadu_si512(c.xq + e));
            isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(lane, sc));
          }
        }
        const float d = h2f(blk);
        for (int r = 0; r < R; ++r)
          acc[i][r] = _mm512_fmadd_ps(_mm512_set1_ps(c.xd[(t + r) * S + s] * d), _mm512_cvtepi32_ps(isum[r]), acc[i][r]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) c.y[(t + r) * c.N + n + i] = _mm512_reduce_add_ps(acc[i][r]);
  }
};

#endif  // PORTSIDE_GD_VNNI

template <template <bool> class K45, class K6, class KIQ4>
void run(const Ctx& c, int64_t ggml_type, int64_t n0, int64_t n1) {
  switch (ggml_type) {
    case GGML_Q4_K: return drive<K45<false>>(c, n0, n1);
    case GGML_Q5_K: return drive<K45<true>>(c, n0, n1);
    case GGML_Q6_K: return drive<K6>(c, n0, n1);
    default: return drive<KIQ4>(c, n0, n1);
  }
}

}  // namespace

void dot_k(const Ctx& c, int64_t isa, int64_t ggml_type, int64_t n0, int64_t n1) {
#ifdef PORTSIDE_GD_VNNI
  // IQ4_XS decode: the AVX2 kernel (its table lookups and scale products cost more as zmm operations
  // than the bytes they save: 0.65 vs 1.0 ms for a 5632 x 2048 decode on a Zen 4, whose 512-bit
  // operations are two 256-bit halves; the VNNI kernel is 1.4x faster at 64 rows)
  if (isa == ISA_VNNI && !(ggml_type == GGML_IQ4_XS && c.T == 1)) return run<VnniQ45_K, VnniQ6_K, VnniIQ4_XS>(c, ggml_type, n0, n1);
  if (isa == ISA_VNNI) isa = ISA_AVX2;
#endif
#ifdef PORTSIDE_GD_AVX2
  if (isa == ISA_AVX2) return run<Avx2Q45_K, Avx2Q6_K, Avx2IQ4_XS>(c, ggml_type, n0, n1);
#endif
  run<ScalarQ45_K, ScalarQ6_K, ScalarIQ4_XS>(c, ggml_type, n0, n1);
}

}  // namespace portside_gguf
