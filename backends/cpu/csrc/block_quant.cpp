// Linears over block-scaled quantized weights for the cpu backend (block_quant.py), as a torch operator:
//
//   portside_cpu_native::block_quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias,
//       int fmt, int block_n, int block_k) -> Tensor
//     y [T, N] = x [T, K] @ W^T + bias in x's dtype (fp32 or bf16 in, computed in fp32), W decoded
//     from its codes inside the kernel, 32 columns at a time (portside.quant.weight's layouts):
//     fmt 0, block-wise fp8: qweight e4m3 bytes [N, K], scales fp32 [ceil(N / block_n),
//       ceil(K / block_k)] (DeepSeek-V3's weight_scale_inv; block_k a multiple of 32);
//     fmt 1, mxfp4: qweight uint8 [N, K / 2] (two e2m1 codes a byte, column 2j low), scales uint8
//       e8m0 [N, K / 32] (2^(s - 127)).
//   portside_cpu_native::block_quant_isa() -> str: "avx512", "avx2" or "portable" (what this
//     build decodes with: the library is compiled with -march=native, so the macros below are
//     this CPU's flags).
//
// Up to SMALL_T token rows (decode) the weight is read once: each thread takes a range of output
// rows, decodes each 32-column chunk into registers-sized scratch (L1) and multiplies it into
// every token row's accumulators. More rows (prefill) are compute-bound: a thread decodes a tile
// of TILE_N weight rows into fp32 scratch (L2) and multiplies it with at::linear (oneDNN/MKL,
// single-threaded inside the parallel region), as quant_gemm.cpp does; no dequantized copy of
// the whole matrix is ever made.
//
// fp8 e4m3fn: a code's 7 magnitude bits placed at bits 7-13 of an fp16 (sign at 15) are the same
// number times 2^-8, subnormals included, so F16C / AVX-512 convert 16 at a time and the scale
// absorbs the 2^8. mxfp4: the 16 e2m1 values are a table (AVX-512: one vpermps on the 4-bit
// code; AVX2: vpermps on the magnitude, the sign bit moved into the float's), times the block's
// 2^(s - 127) from a 256-entry table. Its columns come out as each byte's low codes then its high
// ones (evens, then odds of the chunk); x is permuted the same way once per call instead of
// interleaving every decoded chunk, dot products and GEMM tiles not caring about the order.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PS_BQ_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PS_BQ_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t FMT_FP8_BLOCK = 0, FMT_MXFP4 = 1;
constexpr int64_t SMALL_T = 8;
constexpr int64_t TILE_N = 64;
constexpr float FP4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

struct Tables {
  float fp8[256];  // e4m3fn value of each byte (NaN codes: whatever the fp16 trick gives; checkpoints have none)
  float e8m0[256];  // 2^(s - 127)
  Tables() {
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, e = (b >> 3) & 15, m = b & 7;
      const float mag = e == 0 ? std::ldexp(float(m) / 8.f, -6) : std::ldexp(1.f + float(m) / 8.f, e - 7);
      fp8[b] = sign ? -mag : mag;
      e8m0[b] = std::ldexp(1.f, b - 127);
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

// ---- decoding 32 columns of one row into fp32 (kernel order) ----------------------------------

struct Fp8Block {
  const uint8_t* q;
  const float* s;
  int64_t K, bn, bk, sc;  // sc: scale columns
  float scale(int64_t n, int64_t c) const { return s[(n / bn) * sc + (c * 32) / bk]; }
  void decode(int64_t n, int64_t c, float* out) const {
    const uint8_t* p = q + n * K + c * 32;
    const float a = scale(n, c);
#if defined(PS_BQ_AVX512)
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i h = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(v, 7), _mm512_set1_epi16(0x3F80)),
                                      _mm512_and_si512(_mm512_slli_epi16(v, 8), _mm512_set1_epi16(int16_t(0x8000))));
    const __m512 av = _mm512_set1_ps(a * 256.f);
    _mm512_storeu_ps(out, _mm512_mul_ps(av, _mm512_cvtph_ps(_mm512_castsi512_si256(h))));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(av, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1))));
#elif defined(PS_BQ_AVX2)
    const __m256 av = _mm256_set1_ps(a * 256.f);
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * half)));
      const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16(0x3F80)),
                                        _mm256_and_si256(_mm256_slli_epi16(v, 8), _mm256_set1_epi16(int16_t(0x8000))));
      _mm256_storeu_ps(out + 16 * half, _mm256_mul_ps(av, _mm256_cvtph_ps(_mm256_castsi256_si128(h))));
      _mm256_storeu_ps(out + 16 * half + 8, _mm256_mul_ps(av, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))));
    }
#else
    const float* t = tables().fp8;
    for (int j = 0; j < 32; ++j) out[j] = a * t[p[j]];
#endif
  }
  static constexpr bool PERMUTED = false;
};

struct Mxfp4 {
  const uint8_t* q;
  const uint8_t* s;
  int64_t K;
  // out[0..15]: columns 0, 2, .., 30 of the chunk (low nibbles); out[16..31]: 1, 3, .., 31
  void decode(int64_t n, int64_t c, float* out) const {
    const uint8_t* p = q + n * (K / 2) + c * 16;
    const float a = tables().e8m0[s[n * (K / 32) + c]];
#if defined(PS_BQ_AVX512)
    const __m512 lut = _mm512_loadu_ps(FP4);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512 av = _mm512_set1_ps(a);
    _mm512_storeu_ps(out, _mm512_mul_ps(av, _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), lut)));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(av, _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut)));
#elif defined(PS_BQ_AVX2)
    const __m256 mags = _mm256_loadu_ps(FP4);
    const __m256 av = _mm256_set1_ps(a);
    for (int half = 0; half < 2; ++half) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half)));
      for (int hi = 0; hi < 2; ++hi) {
        const __m256i code = hi ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
        const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(code, 3), 31);
        const __m256 v = _mm256_xor_ps(_mm256_permutevar8x32_ps(mags, code), _mm256_castsi256_ps(sign));
        _mm256_storeu_ps(out + 16 * hi + 8 * half, _mm256_mul_ps(av, v));
      }
    }
#else
    for (int j = 0; j < 16; ++j) {
      out[j] = a * FP4[p[j] & 15];
      out[16 + j] = a * FP4[p[j] >> 4];
    }
#endif
  }
  static constexpr bool PERMUTED = true;
};

// ---- dot products ---------------------------------------------------------------------------

// y[r * ldy + n] = W[n] . x_r for R token rows (x_r = x + r * K): each 32-column chunk decoded
// once into L1 scratch, multiplied into R vector accumulators, reduced at the end of the row
template <class D, int R>
inline void rows_dot(const D& d, int64_t n, const float* x, int64_t K, float* y, int64_t ldy) {
  alignas(64) float w[32];
#if defined(PS_BQ_AVX512)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / 32; ++c) {
    d.decode(n, c, w);
    const __m512 w0 = _mm512_load_ps(w), w1 = _mm512_load_ps(w + 16);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + c * 32;
      acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r]));
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy + n] = _mm512_reduce_add_ps(acc[r]);
#elif defined(PS_BQ_AVX2)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; ++c) {
    d.decode(n, c, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + c * 32;
      for (int v = 0; v < 4; ++v) acc[r] = _mm256_fmadd_ps(_mm256_load_ps(w + 8 * v), _mm256_loadu_ps(xr + 8 * v), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    y[r * ldy + n] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
#else
  float acc[R][8] = {};
  for (int64_t c = 0; c < K / 32; ++c) {
    d.decode(n, c, w);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 32; ++j) acc[r][j % 8] += w[j] * x[r * K + c * 32 + j];
  }
  for (int r = 0; r < R; ++r) {
    float s = 0.f;
    for (int j = 0; j < 8; ++j) s += acc[r][j];
    y[r * ldy + n] = s;
  }
#endif
}

template <class D>
void run(const D& d, const float* x, int64_t T, int64_t K, int64_t N, float* y) {
  if (T <= SMALL_T) {
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t t = 0; t < T; t += 4) {
          const float* xt = x + t * K;
          float* yt = y + t * N;
          switch (std::min<int64_t>(4, T - t)) {
            case 4: rows_dot<D, 4>(d, n, xt, K, yt, N); break;
            case 3: rows_dot<D, 3>(d, n, xt, K, yt, N); break;
            case 2: rows_dot<D, 2>(d, n, xt, K, yt, N); break;
            default: rows_dot<D, 1>(d, n, xt, K, yt, N); break;
          }
        }
    });
    return;
  }
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {T, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t tiles = (N + TILE_N - 1) / TILE_N;
  at::parallel_for(0, tiles, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(TILE_N * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * TILE_N, nb = std::min(TILE_N, N - n0);
      for (int64_t i = 0; i < nb; ++i)
        for (int64_t c = 0; c < K / 32; ++c) d.decode(n0 + i, c, scratch.data() + i * K + c * 32);
      const at::Tensor w = at::from_blob(scratch.data(), {nb, K}, at::TensorOptions().dtype(at::kFloat));
      const at::Tensor o = at::linear(xt, w);  // [T, nb]
      const float* op = o.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) std::memcpy(y + t * N + n0, op + t * nb, nb * sizeof(float));
    }
  });
}

at::Tensor block_quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& bias, int64_t fmt, int64_t block_n, int64_t block_k) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "block_quant_linear: x must be a 2-D fp32 or bf16 cpu tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1 && scales.is_contiguous(),
              "block_quant_linear: qweight must be a contiguous 2-D byte tensor, scales contiguous");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t T = xf.size(0), K = xf.size(1), N = qweight.size(0);
  TORCH_CHECK(K % 32 == 0, "block_quant_linear: K must be a multiple of 32");
  at::Tensor out = at::empty({T, N}, xf.options());
  const uint8_t* q = static_cast<const uint8_t*>(qweight.data_ptr());
  if (T > 0 && N > 0) {
    if (fmt == FMT_FP8_BLOCK) {
      TORCH_CHECK(block_n > 0 && block_k > 0 && block_k % 32 == 0 && qweight.size(1) == K &&
                      scales.scalar_type() == at::kFloat && scales.dim() == 2 &&
                      scales.size(0) == (N + block_n - 1) / block_n && scales.size(1) == (K + block_k - 1) / block_k,
                  "block_quant_linear: fp8 block shapes");
      run(Fp8Block{q, scales.data_ptr<float>(), K, block_n, block_k, scales.size(1)}, xf.data_ptr<float>(), T, K, N,
          out.data_ptr<float>());
    } else {
      TORCH_CHECK(fmt == FMT_MXFP4 && qweight.size(1) == K / 2 && scales.scalar_type() == at::kByte &&
                      scales.numel() == N * (K / 32),
                  "block_quant_linear: mxfp4 shapes (or an unknown fmt)");
      // x in the decoded order: per chunk of 32, the even columns then the odd ones
      at::Tensor xp = xf.view({T, K / 32, 16, 2}).transpose(2, 3).contiguous();
      run(Mxfp4{q, static_cast<const uint8_t*>(scales.data_ptr()), K}, xp.data_ptr<float>(), T, K, N,
          out.data_ptr<float>());
    }
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat).reshape({1, N}));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

std::string block_quant_isa() {
#if defined(PS_BQ_AVX512)
  return "avx512";
#elif defined(PS_BQ_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("block_quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int fmt, int block_n, int block_k) -> Tensor");
  m.def("block_quant_isa() -> str", &block_quant_isa);
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) { m.impl("block_quant_linear", &block_quant_linear); }
