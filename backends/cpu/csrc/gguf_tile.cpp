// GGUF weights times 8-bit activations, many token rows at once (prefill, batched decode), on
// AVX-512 VNNI (and AVX2): the weights regrouped per thread into tiles of 16 (8) interleaved rows, as llama.cpp's
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
// AVX2 without VNNI (Zen 3) has the same tiles at 8 rows (ymm lanes), the codes stored signed and
// multiplied with llama.cpp's sign trick (maddubs of |w| by x carrying w's sign, madd to int32),
// 4 token rows a pass (its 16 registers); the conversion and scaling are still once per block and
// 8 rows, where the AVX2 row kernels spend two per maddubs.
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
#include "gguf_tile_rows.h"

namespace portside_gguf {

#ifdef PORTSIDE_GD_AVX2

namespace {

using namespace tile_rows;  // the row sources (gguf_tile_rows.h)

constexpr int PASS_TOKENS = 8;  // token rows per packed group (a pass over a tile: VNNI 8, AVX2 4)

// Where things lie. A tile of ROWS weight rows (16 with VNNI: the int32 lanes of a zmm; 8 with
// AVX2: of a ymm), per block of BS values: the codes [BS / 4 groups][ROWS][4 bytes] (a register
// per group), the rows' fp32 scales [ROWS], with minimums their fp32 minimums [ROWS]. The packed
// activations, per group of 8 token rows and block: their codes [BS / 4][8 tokens][4 bytes], the
// lanes' start (-128 x the block's code sum) [8] int32, the block's scale [8] fp32, with minimums
// the scale times the code sum [8] fp32.
struct Layout {
  int bs;  // values per block: 32, or 16 (Q6_K)
  bool min;
  int64_t blocks;  // per row: K / bs
  int rows;  // per tile
  int64_t group_bytes() const { return 4 * rows; }
  int64_t wstride() const { return bs / 4 * group_bytes() + 4 * rows + (min ? 4 * rows : 0); }
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

#ifdef PORTSIDE_GD_VNNI
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
#endif  // PORTSIDE_GD_VNNI

// AVX2's tiles: the codes of 8 rows' segment (row r's 32 bytes at rc + r * stride) as 8 ymm of
// 8 rows x 4 bytes, signed (u - 128: the kernel's sign trick wants the codes themselves): groups
// 0..3 to lo, 4..7 to hi, 32 bytes apart. An 8 x 8 transposition of dwords.
inline void interleave8(const uint8_t* rc, int64_t stride, uint8_t* lo, uint8_t* hi) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  __m256i r[8], t[8], v[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_xor_si256(load256(rc + i * stride), flip);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  // per 128-bit lane, v[i] (i < 4): dword i of rows 0..3 (v[i + 4]: of rows 4..7); the lanes: bytes
  // 0..15, bytes 16..31
  for (int k = 0; k < 2; ++k) {
    v[4 * k + 0] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    v[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    v[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    v[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lo + 32 * i), _mm256_permute2x128_si256(v[i], v[i + 4], 0x20));
    _mm256_store_si256(reinterpret_cast<__m256i*>(hi + 32 * i), _mm256_permute2x128_si256(v[i], v[i + 4], 0x31));
  }
}

// A thread's scratch for `fill_tile`: a tile's rows' codes [ROWS][K] and scales [ROWS][K / 16]
// (two per segment) and minimums [ROWS][K / 32].
struct Rows {
  uint8_t* codes;
  float *s, *m;
};

// Rows [n0, n0 + rows) (rows <= ROWS; the others: codes 128 and scale 0, a zero weight) into a
// tile: each row decoded whole first (one sequential stream at a time: 16 rows read side by side,
// 34 bytes of each per segment, left the hardware prefetcher behind), then the rows interleaved.
template <class F, int ROWS>
void fill_tile(const Ctx& c, const F& f, int64_t n0, int rows, const Layout& L, const Rows& R, uint8_t* tile) {
  const int64_t J = c.K / 32, ws = L.wstride(), gb = L.group_bytes();
  for (int r = 0; r < ROWS; ++r) {
    uint8_t* u = R.codes + r * c.K;
    float *s = R.s + r * 2 * J, *m = R.m + r * J;
    if (r < rows) {
      f.row(n0 + r, u, s, m);
    } else {
      std::memset(u, 128, c.K);
      std::fill(s, s + 2 * J, 0.f);
      std::fill(m, m + J, 0.f);
    }
  }
  for (int64_t j = 0; j < J; ++j) {
    uint8_t* b0 = tile + (F::BS == 32 ? j : 2 * j) * ws;
    uint8_t* b1 = F::BS == 32 ? b0 + 4 * gb : b0 + ws;  // codes 16..31: the second half of the block, or the next block
#ifdef PORTSIDE_GD_VNNI
    if constexpr (ROWS == 16) interleave16(R.codes + 32 * j, c.K, b0, b1);
#endif
    if constexpr (ROWS == 8) interleave8(R.codes + 32 * j, c.K, b0, b1);
    float* s0 = reinterpret_cast<float*>(b0 + F::BS / 4 * gb);
    for (int r = 0; r < ROWS; ++r) s0[r] = R.s[r * 2 * J + 2 * j];
    if constexpr (F::BS == 16) {
      float* s1 = reinterpret_cast<float*>(b1 + 4 * gb);
      for (int r = 0; r < ROWS; ++r) s1[r] = R.s[r * 2 * J + 2 * j + 1];
    }
    if constexpr (F::MIN)
      for (int r = 0; r < ROWS; ++r) s0[ROWS + r] = R.m[r * J + j];
  }
}

// ---- the product -----------------------------------------------------------------------------

#ifdef PORTSIDE_GD_VNNI

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

#endif  // PORTSIDE_GD_VNNI

// AVX2 (no VNNI): a tile of 8 rows, 4 token rows a pass (16 ymm registers: 4 integer and 4 fp32
// accumulators, the codes, their magnitudes and the temporaries). A group's 4 codes of 8 rows times
// a token's 4 codes: llama.cpp's sign trick (|w| unsigned times x carrying w's sign: |w| <= 128,
// |x| <= 127, so a pair's sum fits maddubs' int16), madd to the rows' int32 lanes.
template <int G, bool MIN, int NT>
void tile_pass8(const uint8_t* tile, const uint8_t* xp, int toff, const Layout& L, float* y, int64_t ldy, __m256i keep) {
  const int64_t ws = L.wstride(), xs = L.xstride();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < L.blocks; ++b, tile += ws, xp += xs) {
    const int32_t* xc = reinterpret_cast<const int32_t*>(xp) + toff;
    const float* xd = reinterpret_cast<const float*>(xp + G * 32 + 32) + toff;
    __m256i ia[NT];
    for (int t = 0; t < NT; ++t) ia[t] = _mm256_setzero_si256();
    for (int g = 0; g < G; ++g) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(tile + 32 * g)), aw = _mm256_abs_epi8(w);
      for (int t = 0; t < NT; ++t) {
        const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(xc[g * PASS_TOKENS + t]), w);
        ia[t] = _mm256_add_epi32(ia[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
        __asm__("" : "+v"(ia[t]));  // summed as it goes (GCC had kept all 32 products of a block, spilled)
      }
    }
    const __m256 s = _mm256_load_ps(reinterpret_cast<const float*>(tile + 32 * G));
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t]), _mm256_mul_ps(s, _mm256_set1_ps(xd[t])), acc[t]);
    if constexpr (MIN) {
      const __m256 m = _mm256_load_ps(reinterpret_cast<const float*>(tile + 32 * G + 32));
      for (int t = 0; t < NT; ++t) acc[t] = _mm256_fnmadd_ps(m, _mm256_set1_ps(xd[PASS_TOKENS + t]), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_maskstore_ps(y + t * ldy, keep, acc[t]);
}

template <int G, bool MIN>
void tile_tokens8(const uint8_t* tile, const uint8_t* xp, const Layout& L, float* y, int64_t ldy, __m256i keep, int nt) {
  for (int toff = 0; toff < nt; toff += 4) {
    float* yt = y + toff * ldy;
    switch (std::min(4, nt - toff)) {
      case 4: tile_pass8<G, MIN, 4>(tile, xp, toff, L, yt, ldy, keep); break;
      case 3: tile_pass8<G, MIN, 3>(tile, xp, toff, L, yt, ldy, keep); break;
      case 2: tile_pass8<G, MIN, 2>(tile, xp, toff, L, yt, ldy, keep); break;
      default: tile_pass8<G, MIN, 1>(tile, xp, toff, L, yt, ldy, keep);
    }
  }
}

// 64-byte aligned scratch of a thread (or of a call), grown as needed.
uint8_t* aligned(std::vector<uint8_t>& buf, int64_t bytes) {
  if (int64_t(buf.size()) < bytes + 64) buf.resize(bytes + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}

template <class F, int ROWS>
void run(const Ctx& c, const F& f, int64_t act_block) {
  const Layout L{F::BS, F::MIN, c.K / F::BS, ROWS};
  std::vector<uint8_t> xbuf;
  uint8_t* xp = aligned(xbuf, (c.T + PASS_TOKENS - 1) / PASS_TOKENS * L.blocks * L.xstride());
  pack_activations(c, act_block, L, xp);
  const int64_t tiles = (c.N + ROWS - 1) / ROWS, xgroup = L.blocks * L.xstride();
  at::parallel_for(0, tiles, 1, [&](int64_t a0, int64_t a1) {
    thread_local std::vector<uint8_t> tbuf, rbuf;
    thread_local std::vector<float> fbuf;
    uint8_t* tile = aligned(tbuf, L.blocks * L.wstride());
    const int64_t J = c.K / 32;
    fbuf.resize(ROWS * 3 * J);
    const Rows R{aligned(rbuf, ROWS * c.K), fbuf.data(), fbuf.data() + ROWS * 2 * J};
    for (int64_t i = a0; i < a1; ++i) {
      const int64_t n0 = i * ROWS;
      const int rows = int(std::min<int64_t>(ROWS, c.N - n0));
      fill_tile<F, ROWS>(c, f, n0, rows, L, R, tile);
      for (int64_t t = 0; t < c.T; t += PASS_TOKENS) {
        const uint8_t* xt = xp + t / PASS_TOKENS * xgroup;
        float* y = c.y + t * c.N + n0;
        const int nt = int(std::min<int64_t>(PASS_TOKENS, c.T - t));
#ifdef PORTSIDE_GD_VNNI
        if constexpr (ROWS == 16) tile_tokens<F::BS / 4, F::MIN>(tile, xt, L, y, c.N, __mmask16((1u << rows) - 1), nt);
#endif
        if constexpr (ROWS == 8) {
          const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
          tile_tokens8<F::BS / 4, F::MIN>(tile, xt, L, y, c.N, keep, nt);
        }
      }
    }
  });
}

template <int ROWS>
void dispatch(const Ctx& c, int64_t ggml_type) {
  switch (ggml_type) {
    case GGML_Q8_0: return run<GgufRows<TQ8_0>, ROWS>(c, {c.w, c.rb, c.K}, 32);
    case GGML_Q4_0: return run<GgufRows<TQ4_0>, ROWS>(c, {c.w, c.rb, c.K}, 32);
    case GGML_Q4_K: return run<GgufRows<TQ45_K<false>>, ROWS>(c, {c.w, c.rb, c.K}, 256);
    case GGML_Q5_K: return run<GgufRows<TQ45_K<true>>, ROWS>(c, {c.w, c.rb, c.K}, 256);
    case GGML_Q6_K: return run<GgufRows<TQ6_K>, ROWS>(c, {c.w, c.rb, c.K}, 256);
    case GGML_IQ4_XS: return run<GgufRows<TIQ4_XS>, ROWS>(c, {c.w, c.rb, c.K}, 256);
  }
}

}  // namespace

bool tiles_apply(int64_t isa, int64_t ggml_type, int64_t T) {
  return (isa == ISA_VNNI || isa == ISA_AVX2) && T >= TILE_TOKENS && block_shape(ggml_type).first > 0;
}

void dot_tiles(const Ctx& c, int64_t isa, int64_t ggml_type) {
#ifdef PORTSIDE_GD_VNNI
  if (isa == ISA_VNNI) return dispatch<16>(c, ggml_type);
#endif
  dispatch<8>(c, ggml_type);
}

void dot_tiles_int4(const Ctx& c, int64_t isa, const Int4Weights& q, int64_t act_block) {
#ifdef PORTSIDE_GD_VNNI
  if (isa == ISA_VNNI) return run<Int4Rows, 16>(c, {q, c.K}, act_block);
#endif
  run<Int4Rows, 8>(c, {q, c.K}, act_block);
}

void dot_tiles_int8(const Ctx& c, int64_t isa, const Int8Weights& q, int64_t act_block) {
#ifdef PORTSIDE_GD_VNNI
  if (isa == ISA_VNNI) return run<Int8Rows, 16>(c, {q, c.K}, act_block);
#endif
  run<Int8Rows, 8>(c, {q, c.K}, act_block);
}

#else

bool tiles_apply(int64_t, int64_t, int64_t) { return false; }
void dot_tiles(const Ctx&, int64_t, int64_t) {}
void dot_tiles_int4(const Ctx&, int64_t, const Int4Weights&, int64_t) {}
void dot_tiles_int8(const Ctx&, int64_t, const Int8Weights&, int64_t) {}

#endif  // PORTSIDE_GD_AVX2

}  // namespace portside_gguf
