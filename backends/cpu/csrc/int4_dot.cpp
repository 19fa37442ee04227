// 4-bit integer weights (GPTQ, AWQ, compressed-tensors int4 in portside's canonical layout) times
// activations quantized to int8 on the fly, as a torch operator (quant.py's ``cpu_int4_act=int8``):
//
//   portside_cpu_native::int4_dot(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int group_size,
//                                 Tensor? bias, int isa) -> Tensor
//     y [T, N] = x [T, K] . W^T (+ bias) in x's dtype (fp32 or bf16); qweight uint8 [N, K / 2] (column
//     2j in the low nibble of byte j), scales fp32 [N, G], zeros fp32 [N, G] whole numbers or None
//     (8), G = K / group_size groups of consecutive columns (act order: the caller sorts the
//     columns by group first, as quant.py does): W[n, k] = (q[n, k] - z[n, g]) * s[n, g].
//
// The arithmetic is portside.quant.int4_dot_ref's (read it first): x is quantized per activation
// block of ab = gcd(group_size, 128) columns (scale = amax / 127, codes = round-half-even(x /
// scale) in [-127, 127], gguf_dot's rounding); each block's sum_k (q - z) * x_code is an exact
// integer, scaled once in fp32 by s * d_x; a row is the fp32 sum of its blocks' terms.
//
// Paths (`isa` as gguf_dot's: 0 the best here, 1 scalar, 2 AVX2, 3 AVX-512 VNNI; checked against
// the CPU's flags at run time):
//   - scalar: portable C++ (not auto-vectorized: gguf_dot.h's PORTSIDE_GD_SCALAR);
//   - AVX2 / AVX-512 VNNI: 64 columns per step from 32 packed bytes, the low nibbles (the even
//     columns) and the high ones (the odd columns) as unsigned bytes against the activation codes
//     laid out per 64 columns as [even 32 | odd 32] (once per call), maddubs + madd (AVX2) or
//     vpdpbusd on 256-bit vectors (AVX-512 VL VNNI) into 8 int32 lanes; per activation block each
//     lane then takes off z times its own codes' sum (precomputed per call), so every lane holds
//     its codes' true signed dot product before it is converted to fp32 and scaled (no large
//     unsigned bias left to cancel in fp32). A row whose K is an odd number of 32s reads its last
//     16 bytes alone (the codes padded with zeros). Activation blocks of 32 (group size 32): a
//     64-column step spans two blocks; its lanes 0-3 and 4-7 carry each one's scale and zero point.
// Decode (one token row) streams two weight rows side by side and prefetches the rows it reads next;
// several token rows share each loaded weight step, 4 at a time; output rows split across threads.

#include "gguf_dot.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <numeric>
#include <vector>

namespace portside_int4 {
namespace {

using portside_gguf::ISA_AVX2;
using portside_gguf::ISA_BEST;
using portside_gguf::ISA_SCALAR;
using portside_gguf::ISA_VNNI;
using portside_gguf::best_isa;
using portside_gguf::drive;
using portside_gguf::isa_runs;
using portside_gguf::quantize_blocks;

struct Ctx {
  const uint8_t* w;  // codes [N, rb = K / 2]
  int64_t rb, K, N, T, gs, ab, G;
  const float* s;  // [N, G]
  const float* z;  // [N, G] or null (8)
  const int8_t* xq;  // activation codes [T, K] (scalar) or [T, K64] laid out per 64 as [even | odd] (SIMD)
  int64_t K64, U, nU;  // SIMD: padded K, columns per unit (max(ab, 64)), units per row
  const float* xd;  // activation scales [T, K / ab]
  const int32_t* ls;  // SIMD: per unit and int32 lane, the sum of that lane's codes [T, nU, 8]
  const float* dl;  // SIMD: per unit and int32 lane, its activation block's scale [T, nU, 8] (0: padding)
  const int32_t* ug;  // SIMD: per unit, the weight groups of its two halves [nU, 2]
  float* y;  // [T, N]
};

inline int32_t zero_at(const Ctx& c, int64_t n, int64_t g) { return c.z ? int32_t(c.z[n * c.G + g]) : 8; }

constexpr int64_t PREFETCH_ROWS = 2;


// ---- scalar ---------------------------------------------------------------------------------------

struct Scalar {
  template <int NR, int R>
  PORTSIDE_GD_SCALAR static void rows(const Ctx& c, int64_t n, int64_t t) {
    const int64_t nb = c.K / c.ab;
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) {
        const uint8_t* row = c.w + (n + i) * c.rb;
        const int8_t* x = c.xq + (t + r) * c.K;
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t g = b * c.ab / c.gs;
          const int32_t z = zero_at(c, n + i, g);
          int32_t s = 0;
          for (int64_t k = b * c.ab; k < (b + 1) * c.ab; ++k)
            s += (int32_t((row[k >> 1] >> (4 * (k & 1))) & 0x0F) - z) * x[k];
          acc += (c.s[(n + i) * c.G + g] * c.xd[(t + r) * nb + b]) * float(s);
        }
        c.y[(t + r) * c.N + n + i] = acc;
      }
  }
};

template <int NR, int R>
inline void prefetch(const Ctx& c, int64_t n, int64_t u) {
  if constexpr (R == 1) {
    const int64_t off = u * c.U / 2;
    if ((off & 63) == 0)
      for (int i = 0; i < NR; ++i)
        __builtin_prefetch(reinterpret_cast<const char*>(c.w) + (n + i + PREFETCH_ROWS * NR) * c.rb + off, 0, 3);
  }
}

#ifdef PORTSIDE_GD_AVX2

// 64 columns' codes from 32 bytes (16 at a row's odd last 32 columns): even columns' nibbles, odd ones'.
inline void nibbles64(const uint8_t* p, bool half, __m256i& lo, __m256i& hi) {
  const __m256i b = half ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                         : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i m = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(b, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}

// The SIMD kernels: 8 int32 lanes per (weight row, token row), lane m holding the codes of slots
// 4m..4m+3 and 32+4m..32+4m+3 of each 64-column step. VNNI (AVX-512 VL): vpdpbusd on 256-bit
// vectors, one instruction per 32 codes (Zen 4 runs 512-bit operations as two 256-bit halves:
// 64 codes per zmm measured no faster); AVX2: maddubs, the int16 pairs summed over the unit (at
// most 4 x 2 x 15 x 127), then madd. PAIR (activation blocks of 32): lanes 0-3 hold the step's
// first 32 columns, 4-7 its last 32 (their own scale and zero point); else the unit is one block.
template <bool VNNI, bool PAIR>
struct Simd {
  template <int NR, int R>
  static void rows(const Ctx& c, int64_t n, int64_t t) {
    __m256 f[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) f[i][r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t u = 0; u < c.nU; ++u) {
      prefetch<NR, R>(c, n, u);
      __m256i acc[NR][R];
      for (int i = 0; i < NR; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_si256();
      for (int64_t col = u * c.U; col < (u + 1) * c.U; col += 64) {
        const bool half = PAIR && col + 64 > c.K;
        for (int i = 0; i < NR; ++i) {
          __m256i lo, hi;
          nibbles64(c.w + (n + i) * c.rb + col / 2, half, lo, hi);
          for (int r = 0; r < R; ++r) {
            const int8_t* xp = c.xq + (t + r) * c.K64 + col;
            if constexpr (VNNI) {
              acc[i][r] = _mm256_dpbusd_epi32(acc[i][r], lo, portside_gguf::load256(xp));
              acc[i][r] = _mm256_dpbusd_epi32(acc[i][r], hi, portside_gguf::load256(xp + 32));
            } else {
              acc[i][r] = _mm256_add_epi16(acc[i][r], _mm256_maddubs_epi16(lo, portside_gguf::load256(xp)));
              acc[i][r] = _mm256_add_epi16(acc[i][r], _mm256_maddubs_epi16(hi, portside_gguf::load256(xp + 32)));
            }
          }
        }
      }
      // each lane less z times its codes' sum: the lane's true signed dot product, then scaled
      const int32_t g0 = c.ug[2 * u], g1 = c.ug[2 * u + 1];
      for (int i = 0; i < NR; ++i) {
        const float* s = c.s + (n + i) * c.G;
        __m256i zv;
        __m256 sv;
        if constexpr (PAIR) {
          zv = _mm256_blend_epi32(_mm256_set1_epi32(zero_at(c, n + i, g0)), _mm256_set1_epi32(zero_at(c, n + i, g1)), 0xF0);
          sv = _mm256_blend_ps(_mm256_set1_ps(s[g0]), _mm256_set1_ps(s[g1]), 0xF0);
        } else {
          zv = _mm256_set1_epi32(zero_at(c, n + i, g0));
          sv = _mm256_set1_ps(s[g0]);
        }
        for (int r = 0; r < R; ++r) {
          const int64_t at = ((t + r) * c.nU + u) * 8;
          const __m256i dot = VNNI ? acc[i][r] : _mm256_madd_epi16(acc[i][r], ones);
          const __m256i d = _mm256_sub_epi32(dot, _mm256_mullo_epi32(zv, portside_gguf::load256(c.ls + at)));
          const __m256 scale = _mm256_mul_ps(sv, _mm256_loadu_ps(c.dl + at));
          f[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, f[i][r]);
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) c.y[(t + r) * c.N + n + i] = portside_gguf::hsum256(f[i][r]);
  }
};

#endif  // PORTSIDE_GD_AVX2


at::Tensor int4_dot(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const std::optional<at::Tensor>& zeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                    int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_dot: x must be a 2-D fp32 or bf16 cpu tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte && qweight.device().is_cpu(),
              "int4_dot: qweight must be contiguous 2-D uint8 on the cpu");
  if (isa == ISA_BEST) isa = best_isa();
  TORCH_CHECK(isa_runs(isa), "int4_dot: instruction-set path ", isa, " is not built in or not on this CPU");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t T = xf.size(0), K = xf.size(1), N = qweight.size(0);
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0 && qweight.size(1) * 2 == K,
              "int4_dot: ", K, " input features, rows of ", qweight.size(1), " bytes and groups of ", group_size,
              " do not fit (K = 2 x row bytes, a whole number of groups, groups a multiple of 32)");
  const int64_t G = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == G,
              "int4_dot: scales must be contiguous fp32 [", N, ", ", G, "]");
  TORCH_CHECK(!zeros.has_value() || (zeros->scalar_type() == at::kFloat && zeros->is_contiguous() &&
                                     zeros->sizes() == scales.sizes()),
              "int4_dot: zeros must be contiguous fp32 [", N, ", ", G, "]");
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "int4_dot: bias must have ", N, " values");
  at::Tensor out = at::empty({T, N}, xf.options());
  if (T > 0 && N > 0 && K > 0) {
    const int64_t ab = std::gcd(group_size, int64_t(128)), nb = K / ab;
    std::vector<int8_t> xq(T * K);
    std::vector<float> xd(T * nb);
    quantize_blocks(xf.data_ptr<float>(), T, K, ab, xq.data(), xd.data());
    Ctx c{qweight.data_ptr<uint8_t>(), K / 2, K, N, T, group_size, ab, G, scales.data_ptr<float>(),
          zeros.has_value() ? zeros->data_ptr<float>() : nullptr, xq.data(), 0, 0, 0, xd.data(), nullptr,
          nullptr, nullptr, out.data_ptr<float>()};
    if (portside_gguf::tiles_apply(isa, portside_gguf::GGML_Q4_0, T)) {  // many token rows: gguf_tile.cpp's tiles
      const portside_gguf::Ctx g{nullptr, 0, K, N, T, xq.data(), xd.data(), nullptr, nullptr, nullptr, nullptr, c.y};
      portside_gguf::dot_tiles_int4(g, isa, {c.w, group_size, c.s, c.z}, ab);
    } else if (isa == ISA_SCALAR) {
      drive<Scalar>(c);
    } else {
      // [even | odd] per 64 columns (zeros past K); per unit and lane the codes' sums and the
      // activation scale; per unit the groups of its halves
      const int64_t K64 = (K + 63) / 64 * 64, U = std::max<int64_t>(ab, 64), nU = K64 / U;
      std::vector<int8_t> xp(T * K64, 0);
      std::vector<int32_t> ls(T * nU * 8, 0), ug(2 * nU);
      std::vector<float> dl(T * nU * 8);
      for (int64_t u = 0; u < nU; ++u) {
        const int64_t b0 = u * U / ab, b1 = ab == 32 ? std::min(b0 + 1, nb - 1) : b0;
        ug[2 * u] = int32_t(b0 * ab / group_size);
        ug[2 * u + 1] = int32_t(b1 * ab / group_size);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t m = 0; m < 8; ++m)
            dl[(t * nU + u) * 8 + m] = ab == 32 && m >= 4 ? (b0 + 1 < nb ? xd[t * nb + b0 + 1] : 0.f) : xd[t * nb + b0];
      }
      for (int64_t t = 0; t < T; ++t) {
        const int8_t* q = xq.data() + t * K;
        int8_t* p = xp.data() + t * K64;
        for (int64_t col = 0; col < K64; col += 64)
          for (int64_t j = 0; j < 32; ++j) {
            if (col + 2 * j < K) p[col + j] = q[col + 2 * j];
            if (col + 2 * j + 1 < K) p[col + 32 + j] = q[col + 2 * j + 1];
          }
        for (int64_t u = 0; u < nU; ++u)
          for (int64_t col = u * U; col < (u + 1) * U; col += 64)
            for (int64_t lane = 0; lane < 16; ++lane) {
              int32_t s = 0;
              for (int64_t j = 0; j < 4; ++j) s += p[col + 4 * lane + j];
              ls[(t * nU + u) * 8 + lane % 8] += s;
            }
      }
      c.xq = xp.data();
      c.K64 = K64;
      c.U = U;
      c.nU = nU;
      c.ls = ls.data();
      c.dl = dl.data();
      c.ug = ug.data();
#ifdef PORTSIDE_GD_AVX2
      const bool pair = ab == 32;
#ifdef PORTSIDE_GD_VNNI
      if (isa == ISA_VNNI) pair ? drive<Simd<true, true>>(c) : drive<Simd<true, false>>(c);
#endif
      if (isa == ISA_AVX2) pair ? drive<Simd<false, true>>(c) : drive<Simd<false, false>>(c);
#endif
    }
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat).reshape({1, N}));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace
}  // namespace portside_int4

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("int4_dot(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int group_size, Tensor? bias, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) { m.impl("int4_dot", &portside_int4::int4_dot); }
