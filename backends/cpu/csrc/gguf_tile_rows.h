// The row sources of gguf_tile.cpp's tiles: each decodes one weight row whole into unsigned bytes
// u = code + 128, two fp32 scales per 32 values and (Q4_K/Q5_K) one fp32 minimum per 32; the table
// of what each format becomes is at the top of gguf_tile.cpp. One struct per source, so a format
// is a struct here and a line in gguf_tile.cpp's `dispatch`.

#pragma once

#include "gguf_dot.h"

#ifdef PORTSIDE_GD_AVX2

namespace portside_gguf::tile_rows {

inline __m256i nib_lo(__m256i q) { return _mm256_and_si256(q, _mm256_set1_epi8(0x0F)); }
inline __m256i nib_hi(__m256i q) { return _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F)); }
inline void store32(uint8_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }

// Each format: BS (values per tile block), MIN, VALUES and BYTES (per block of the file), and
// block(blk, u, s, m): a file block -> its VALUES codes u, two scales per 32 values (s[2j], s[2j +
// 1]: the halves' scales when BS is 16, else the same one twice) and one minimum per 32 (MIN).
struct TQ8_0 {
  static constexpr int BS = 32, VALUES = 32, BYTES = 34;
  static constexpr bool MIN = false;
  static void block(const uint8_t* blk, uint8_t* u, float* s, float*) {
    store32(u, _mm256_xor_si256(load256(blk + 2), _mm256_set1_epi8(char(0x80))));
    s[0] = s[1] = h2f(blk);
  }
};

struct TQ4_0 {
  static constexpr int BS = 32, VALUES = 32, BYTES = 18;
  static constexpr bool MIN = false;
  static void block(const uint8_t* blk, uint8_t* u, float* s, float*) {
    store32(u, _mm256_add_epi8(nibbles16(blk + 2), _mm256_set1_epi8(120)));
    s[0] = s[1] = h2f(blk);
  }
};

template <bool Q5>
struct TQ45_K {
  static constexpr int BS = 32, VALUES = 256, BYTES = Q5 ? 176 : 144;
  static constexpr bool MIN = true;
  static void block(const uint8_t* blk, uint8_t* u, float* s, float* m) {
    constexpr int QS = Q5 ? 48 : 16;
    uint8_t sc[8], mn[8];
    k_scales(blk + 4, sc, mn);
    const float d = h2f(blk), dmin = h2f(blk + 2);
    const __m256i hb = Q5 ? load256(blk + 16) : _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
    for (int j = 0; j < 8; ++j) {
      const __m256i q = load256(blk + QS + 32 * (j / 2));
      __m256i v = (j & 1) ? nib_hi(q) : nib_lo(q);
      if constexpr (Q5)  // bit j of each of the 32 high-bit bytes, as 16
        v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(j)), one), 4));
      store32(u + 32 * j, _mm256_add_epi8(v, _mm256_set1_epi8(char(0x80))));
      s[2 * j] = s[2 * j + 1] = d * float(sc[j]);
      m[j] = dmin * float(mn[j]);
    }
  }
};

struct TQ6_K {
  static constexpr int BS = 16, VALUES = 256, BYTES = 210;
  static constexpr bool MIN = false;
  static void block(const uint8_t* blk, uint8_t* u, float* s, float*) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = h2f(blk + 208);
    for (int j = 0; j < 8; ++j) {  // 32 values: half h, quarter q of it
      const int h = j / 4, q = j % 4;
      const __m256i ql = load256(blk + 64 * h + 32 * (q & 1));
      const __m256i lo = (q >> 1) ? nib_hi(ql) : nib_lo(ql);
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(load256(blk + 128 + 32 * h), _mm_cvtsi32_si128(2 * q)),
                                          _mm256_set1_epi8(3));
      store32(u + 32 * j, _mm256_add_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(96)));
    }
    for (int i = 0; i < 16; ++i) s[i] = d * float(sc[i]);
  }
};

struct TIQ4_XS {
  static constexpr int BS = 32, VALUES = 256, BYTES = 136;
  static constexpr bool MIN = false;
  static void block(const uint8_t* blk, uint8_t* u, float* s, float*) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_add_epi8(load128(IQ4_VALUES), _mm_set1_epi8(char(0x80))));
    int16_t ls[8];
    iq4_scales(blk, ls);
    const float d = h2f(blk);
    for (int j = 0; j < 8; ++j) {
      store32(u + 32 * j, _mm256_shuffle_epi8(table, nibbles16(blk + 8 + 16 * j)));
      s[2 * j] = s[2 * j + 1] = d * float(ls[j]);
    }
  }
};

// A tile's row source: row(n, u, s, m) decodes weight row n whole (its K codes u, two scales per
// 32 values, one minimum per 32). GGUF: the file's blocks of format F, one after another.
template <class F>
struct GgufRows {
  static constexpr int BS = F::BS;
  static constexpr bool MIN = F::MIN;
  const uint8_t* w;
  int64_t rb, K;
  void row(int64_t n, uint8_t* u, float* s, float* m) const {
    const uint8_t* r = w + n * rb;
    for (int64_t b = 0; b < K / F::VALUES; ++b)
      F::block(r + b * F::BYTES, u + b * F::VALUES, s + b * F::VALUES / 16, m + b * F::VALUES / 32);
  }
};

// int4 (int4_dot.cpp's layout: column 2i of a row in the low nibble of byte i, scales and whole
// zero points per row and group of gs columns, gs a multiple of 32): u = q - z + 128, s the
// group's scale.
struct Int4Rows {
  static constexpr int BS = 32;
  static constexpr bool MIN = false;
  Int4Weights q;
  int64_t K;
  void row(int64_t n, uint8_t* u, float* s, float*) const {
    const int64_t G = K / q.gs;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int64_t j = 0; j < K / 32; ++j) {
      const int64_t g = n * G + 32 * j / q.gs;
      const __m128i b = load128(q.w + n * (K / 2) + 16 * j);
      const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
      const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
      store32(u + 32 * j, _mm256_add_epi8(v, _mm256_set1_epi8(char(128 - (q.z ? int(q.z[g]) : 8)))));
      s[2 * j] = s[2 * j + 1] = q.s[g];
    }
  }
};

// Symmetric int8 (W8A8's canonical codes, w + 128: already u), the group's scale per 32 columns.
struct Int8Rows {
  static constexpr int BS = 32;
  static constexpr bool MIN = false;
  Int8Weights q;
  int64_t K;
  void row(int64_t n, uint8_t* u, float* s, float*) const {
    const int64_t G = K / q.gs;
    std::memcpy(u, q.w + n * K, K);
    for (int64_t j = 0; j < K / 32; ++j) s[2 * j] = s[2 * j + 1] = q.s[n * G + 32 * j / q.gs];
  }
};

}  // namespace portside_gguf::tile_rows

#endif  // PORTSIDE_GD_AVX2
