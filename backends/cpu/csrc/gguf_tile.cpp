// GGUF weights times 8-bit activations, many token rows at once (prefill, batched decode), on
// AVX-512 VNNI: the weights regrouped per thread into tiles of 16 interleaved rows, as llama.cpp's
// x86 build repacks Q4_0 for its GEMM, but in a buffer a chunk at a time (nothing is kept: the
// file's blocks stay the one copy in memory, and the decode kernels read them as they are).
//
// Why: the kernels of gguf_dot_q8.cpp / gguf_dot_k.cpp put a block's codes along a register's
// lanes, so every vpdpbusd (64 codes of one weight row and one token row) is followed by its own
// conversion to fp32 and scaling: three more instructions per one that multiplies. In a tile the
// 16 int32 lanes are 16 weight rows: a lane accumulates its row's 4-code dot products over a whole
// block of 32 (or 16) values, the token's 4 codes broadcast to all lanes, and only then is the
// block converted and scaled, once for 16 rows; 8 token rows share each loaded weight register.
// Regrouping a tile (the rows decoded one after another, then transposed in registers) costs about
// what 8-16 token rows' products do, hence TILE_TOKENS. On the Zen 5 (one thread, W 5632 x 2048,
// `ci/bench/gguf_act_kernels.py --rows 128`): 128 token rows took 13-16.5 ms in the row kernels
// (Q8_0, Q4_0, Q4_K, Q6_K), 5.5-7.4 ms here; 16 rows 2.0-3.1 ms -> 1.7-2.3 ms.
//
// The arithmetic is portside.quant.gguf_dot_ref's, term by term: each weight value becomes an
// unsigned byte u = code + 128 with a per-(row, block) fp32 scale s (and for Q4_K/Q5_K a
// per-(row, sub-block) minimum m): w = s * (u - 128) - m. The lanes start at -128 times the token
// block's code sum, so after a block each holds the exact signed integer dot product (as the
// row-wise VNNI kernels' lanes do); its fp32 term is (s * x_scale) * dot, the reference's
// (d_x * d_w) * dot for Q8_0/Q4_0. The 256-value formats' sub-block scales are folded into s in
// fp32 (d * sc: an 11-bit mantissa times an integer of at most 8 bits, exact), so their terms are
// taken per sub-block where the reference sums the sub-blocks in integers first: the same value up
// to the fp32 rounding of each term (a few ulps of the sum of |terms|, the tests' tolerance).
//
//   format  u (code + 128)          s per block              m
//   Q8_0    w ^ 0x80                d                         -
//   Q4_0    nibble + 120            d                         -
//   Q4_K    nibble + 128            d * sc_j (32)             dmin * mn_j
//   Q5_K    5-bit code + 128        d * sc_j (32)             dmin * mn_j
//   Q6_K    6-bit code + 96         d * sc_j (16: blocks 16)  -
//   IQ4_XS  value + 128             d * (ls_j - 32) (32)      -

#include "gguf_dot.h"

namespace portside_gguf {

#ifdef PORTSIDE_GD_VNNI

namespace {

constexpr int TILE_ROWS = 16;  // weight rows per tile: the int32 lanes of a zmm
constexpr int PASS_TOKENS = 8;  // token rows per pass over a tile

// Where things lie. A tile, per block of BS values: the codes [BS / 4 groups][16 rows][4 bytes]
// (a zmm per group), the rows' fp32 scales [16], with minimums their fp32 minimums [16]. The
// packed activations, per group of 8 token rows and block: their codes [BS / 4][8 tokens][4
// bytes], the lanes' start (-128 x the block's code sum) [8] int32, the block's scale [8] fp32,
// with minimums the scale times the code sum [8] fp32.
struct Layout {
  int bs;  // values per block: 32, or 16 (Q6_K)
  bool min;
  int64_t blocks;  // per row: K / bs
  int64_t wstride() const { return bs / 4 * 64 + 64 + (min ? 64 : 0); }
  int64_t xstride() const { return bs / 4 * 32 + 64 + (min ? 32 : 0); }
};

// ---- the activations -------------------------------------------------------------------------

// Token rows [T] of codes xq [T, K] and scales xd [T, K / act_block] into xp (per group of 8 token
// rows, blocks of L.bs; rows past T are zeros).
void pack_activations(const Ctx& c, int64_t act_block, const Layout& L, uint8_t* xp) {
  const int G = L.bs / 4;
  const int64_t groups = (c.T + PASS_TOKENS - 1) / PASS_TOKENS, xs = L.xstride();
  at::parallel_for(0, groups * L.blocks, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t tg = i / L.blocks, b = i % L.blocks;
      uint8_t* dst = xp + i * xs;
      int32_t* codes = reinterpret_cast<int32_t*>(dst);
      int32_t* start = codes + G * PASS_TOKENS;
      float* scale = reinterpret_cast<float*>(start + PASS_TOKENS);
      float* msum = scale + PASS_TOKENS;
      for (int t = 0; t < PASS_TOKENS; ++t) {
        const int64_t tt = tg * PASS_TOKENS + t;
        if (tt >= c.T) {
          for (int g = 0; g < G; ++g) codes[g * PASS_TOKENS + t] = 0;
          start[t] = 0, scale[t] = 0.f;
          if (L.min) msum[t] = 0.f;
          continue;
        }
        const int8_t* src = c.xq + tt * c.K + b * L.bs;
        int32_t sum = 0;
        for (int j = 0; j < L.bs; ++j) sum += src[j];
        for (int g = 0; g < G; ++g) std::memcpy(codes + g * PASS_TOKENS + t, src + 4 * g, 4);
        start[t] = -128 * sum;
        scale[t] = c.xd[tt * (c.K / act_block) + b * L.bs / act_block];
        if (L.min) msum[t] = scale[t] * float(sum);
      }
    }
  });
}

// ---- the weights: one 32-value segment of one row as 32 unsigned codes -------------------------

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

// The codes of 16 rows' segment (row r's 32 bytes at rc + r * stride) as 8 zmm of 16 rows x 4
// bytes (group g: bytes 4g..4g+3 of each row, row r in lane r): groups 0..3 to lo, 4..7 to hi, 64
// bytes apart. An 8 x 8 transposition of dwords in each 256-bit half (rows 0..7 | rows 8..15), then
// the halves' 128-bit lanes paired.
inline void interleave16(const uint8_t* rc, int64_t stride, uint8_t* lo, uint8_t* hi) {
  __m512i r[8], t[8], v[8];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load256(rc + i * stride)), load256(rc + (i + 8) * stride), 1);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // per 128-bit lane, v[i] (i < 4): dword i of rows 0..3 (v[i + 4]: of rows 4..7); the lanes: rows
  // 0..7's bytes 0..15, their bytes 16..31, rows 8..15's bytes 0..15, their bytes 16..31
  for (int k = 0; k < 2; ++k) {
    v[4 * k + 0] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    v[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    v[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    v[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  // group i: lanes 0 and 2 of v[i] and v[i + 4], interleaved; group i + 4: their lanes 1 and 3
  const __m512i first = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int i = 0; i < 4; ++i) {
    _mm512_store_si512(lo + 64 * i, _mm512_permutex2var_epi64(v[i], first, v[i + 4]));
    _mm512_store_si512(hi + 64 * i, _mm512_permutex2var_epi64(v[i], second, v[i + 4]));
  }
}

// A thread's scratch for `fill_tile`: 16 rows' codes [16][K] and scales [16][K / 16] (two per
// segment) and minimums [16][K / 32].
struct Rows {
  uint8_t* codes;
  float *s, *m;
};

// Rows [n0, n0 + rows) (rows <= 16; the others: codes 128 and scale 0, a zero weight) into a tile:
// each row decoded whole first (one sequential stream at a time: 16 rows read side by side, 34 bytes
// of each per segment, left the hardware prefetcher behind), then the 16 rows interleaved.
template <class F>
void fill_tile(const Ctx& c, int64_t n0, int rows, const Layout& L, const Rows& R, uint8_t* tile) {
  const int64_t J = c.K / 32, ws = L.wstride();
  for (int r = 0; r < TILE_ROWS; ++r) {
    uint8_t* u = R.codes + r * c.K;
    float *s = R.s + r * 2 * J, *m = R.m + r * J;
    if (r < rows) {
      const uint8_t* row = c.w + (n0 + r) * c.rb;
      for (int64_t b = 0; b < c.K / F::VALUES; ++b)
        F::block(row + b * F::BYTES, u + b * F::VALUES, s + b * F::VALUES / 16, m + b * F::VALUES / 32);
    } else {
      std::memset(u, 128, c.K);
      std::fill(s, s + 2 * J, 0.f);
      std::fill(m, m + J, 0.f);
    }
  }
  for (int64_t j = 0; j < J; ++j) {
    uint8_t* b0 = tile + (F::BS == 32 ? j : 2 * j) * ws;
    uint8_t* b1 = F::BS == 32 ? b0 + 256 : b0 + ws;  // codes 16..31: the second half of the block, or the next block
    interleave16(R.codes + 32 * j, c.K, b0, b1);
    float* s0 = reinterpret_cast<float*>(b0 + F::BS * 16);
    for (int r = 0; r < TILE_ROWS; ++r) s0[r] = R.s[r * 2 * J + 2 * j];
    if constexpr (F::BS == 16) {
      float* s1 = reinterpret_cast<float*>(b1 + 256);
      for (int r = 0; r < TILE_ROWS; ++r) s1[r] = R.s[r * 2 * J + 2 * j + 1];
    }
    if constexpr (F::MIN)
      for (int r = 0; r < TILE_ROWS; ++r) s0[TILE_ROWS + r] = R.m[r * J + j];
  }
}

// ---- the product -----------------------------------------------------------------------------

// NT (<= 8) token rows of a packed group against a tile: y[t][0..16) (the rows in `keep`).
template <int G, bool MIN, int NT>
void tile_pass(const uint8_t* tile, const uint8_t* xp, const Layout& L, float* y, int64_t ldy, __mmask16 keep) {
  const int64_t ws = L.wstride(), xs = L.xstride();
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < L.blocks; ++b, tile += ws, xp += xs) {
    const int32_t* xc = reinterpret_cast<const int32_t*>(xp);
    const int32_t* start = xc + G * PASS_TOKENS;
    const float* xd = reinterpret_cast<const float*>(start + PASS_TOKENS);
    __m512i ia[NT];
    for (int t = 0; t < NT; ++t) ia[t] = _mm512_set1_epi32(start[t]);
    for (int g = 0; g < G; ++g) {
      const __m512i w = _mm512_load_si512(tile + 64 * g);
      for (int t = 0; t < NT; ++t) ia[t] = _mm512_dpbusd_epi32(ia[t], w, _mm512_set1_epi32(xc[g * PASS_TOKENS + t]));
    }
    const __m512 s = _mm512_load_ps(reinterpret_cast<const float*>(tile + 64 * G));
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[t]), _mm512_mul_ps(s, _mm512_set1_ps(xd[t])), acc[t]);
    if constexpr (MIN) {
      const __m512 m = _mm512_load_ps(reinterpret_cast<const float*>(tile + 64 * G + 64));
      for (int t = 0; t < NT; ++t) acc[t] = _mm512_fnmadd_ps(m, _mm512_set1_ps(xd[PASS_TOKENS + t]), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + t * ldy, keep, acc[t]);
}

template <int G, bool MIN>
void tile_tokens(const uint8_t* tile, const uint8_t* xp, const Layout& L, float* y, int64_t ldy, __mmask16 keep, int nt) {
  switch (nt) {
    case 8: return tile_pass<G, MIN, 8>(tile, xp, L, y, ldy, keep);
    case 7: return tile_pass<G, MIN, 7>(tile, xp, L, y, ldy, keep);
    case 6: return tile_pass<G, MIN, 6>(tile, xp, L, y, ldy, keep);
    case 5: return tile_pass<G, MIN, 5>(tile, xp, L, y, ldy, keep);
    case 4: return tile_pass<G, MIN, 4>(tile, xp, L, y, ldy, keep);
    case 3: return tile_pass<G, MIN, 3>(tile, xp, L, y, ldy, keep);
    case 2: return tile_pass<G, MIN, 2>(tile, xp, L, y, ldy, keep);
    default: return tile_pass<G, MIN, 1>(tile, xp, L, y, ldy, keep);
  }
}

// 64-byte aligned scratch of a thread (or of a call), grown as needed.
uint8_t* aligned(std::vector<uint8_t>& buf, int64_t bytes) {
  if (int64_t(buf.size()) < bytes + 64) buf.resize(bytes + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}

template <class F>
void run(const Ctx& c, int64_t act_block) {
  const Layout L{F::BS, F::MIN, c.K / F::BS};
  std::vector<uint8_t> xbuf;
  uint8_t* xp = aligned(xbuf, (c.T + PASS_TOKENS - 1) / PASS_TOKENS * L.blocks * L.xstride());
  pack_activations(c, act_block, L, xp);
  const int64_t tiles = (c.N + TILE_ROWS - 1) / TILE_ROWS, xgroup = L.blocks * L.xstride();
  at::parallel_for(0, tiles, 1, [&](int64_t a0, int64_t a1) {
    thread_local std::vector<uint8_t> tbuf, rbuf;
    thread_local std::vector<float> fbuf;
    uint8_t* tile = aligned(tbuf, L.blocks * L.wstride());
    const int64_t J = c.K / 32;
    fbuf.resize(TILE_ROWS * 3 * J);
    const Rows R{aligned(rbuf, TILE_ROWS * c.K), fbuf.data(), fbuf.data() + TILE_ROWS * 2 * J};
    for (int64_t i = a0; i < a1; ++i) {
      const int64_t n0 = i * TILE_ROWS;
      const int rows = int(std::min<int64_t>(TILE_ROWS, c.N - n0));
      fill_tile<F>(c, n0, rows, L, R, tile);
      const __mmask16 keep = __mmask16((1u << rows) - 1);
      for (int64_t t = 0; t < c.T; t += PASS_TOKENS)
        tile_tokens<F::BS / 4, F::MIN>(tile, xp + t / PASS_TOKENS * xgroup, L, c.y + t * c.N + n0, c.N, keep,
                                       int(std::min<int64_t>(PASS_TOKENS, c.T - t)));
    }
  });
}

}  // namespace

bool tiles_apply(int64_t isa, int64_t ggml_type, int64_t T) {
  return isa == ISA_VNNI && T >= TILE_TOKENS && block_shape(ggml_type).first > 0;
}

void dot_tiles(const Ctx& c, int64_t ggml_type) {
  switch (ggml_type) {
    case GGML_Q8_0: return run<TQ8_0>(c, 32);
    case GGML_Q4_0: return run<TQ4_0>(c, 32);
    case GGML_Q4_K: return run<TQ45_K<false>>(c, 256);
    case GGML_Q5_K: return run<TQ45_K<true>>(c, 256);
    case GGML_Q6_K: return run<TQ6_K>(c, 256);
    case GGML_IQ4_XS: return run<TIQ4_XS>(c, 256);
  }
}

#else

bool tiles_apply(int64_t, int64_t, int64_t) { return false; }
void dot_tiles(const Ctx&, int64_t) {}

#endif  // PORTSIDE_GD_VNNI

}  // namespace portside_gguf
