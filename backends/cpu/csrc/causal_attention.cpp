// Causal self-attention of bf16 prompts that attend to themselves only (a request's first prefill
// chunk: its keys are its own rows of the step) on AMX tiles, for the cpu backend's native
// attention backend: portside_cpu_native::causal_attention(Tensor q, Tensor k, Tensor v, int seqs,
// float scale) -> Tensor, and causal_attention_supported(int head_size) -> bool (built with AMX-BF16
// here, the tile state granted, and a head size it takes: a multiple of 32 up to 256).
//
// q [seqs * L, H, D], k / v [seqs * L, KVH, D] bf16: `seqs` sequences of L tokens, any token
// stride, each token's heads dense; H a multiple of KVH (GQA). The output [seqs * L, H, D] bf16 is
// for query i the softmax over keys 0..i: fp32 scores and softmax, the probabilities rounded to
// bf16 for the value products (as torch's flash kernel does), fp32 sums, bf16 output.
//
// One task per (sequence, KV head), spread over threads. Its keys are packed once as the B tiles of
// Q K^T (for 16 tokens, 16 rows of channel pairs x 16 tokens) and its values as the B tiles of P V
// (for 32 keys, 16 rows of key pairs x 16 channels); then for each query head of the group, 16
// query tokens at a time: their scores against the keys up to the last of them (16 x 16 tiles),
// the causal mask and the softmax row by row (AVX-512), and the probabilities times the values,
// 4 accumulator tiles of 16 channels at a time.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PORTSIDE_CAUSAL_AMX 1
#include "amx_tiles.h"
#endif

namespace {

#ifdef PORTSIDE_CAUSAL_AMX

// exp(x) for x <= 0 (softmax numerators after the max is subtracted): x = n ln2 + r, exp(r) by a
// degree-6 polynomial, times 2^n; inputs below -87 (masked keys: -inf) give ~0.
inline __m512 exp_le0(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182f), x);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Scratch {
  std::vector<uint16_t> keys;    // [ceil(L / 16)][D / 2][16 tokens][2]: B tiles of Q K^T
  std::vector<uint16_t> values;  // [ceil(L / 32)][16 key pairs][D][2]: B tiles of P V
  std::vector<float> scores;     // [16][W]
  std::vector<uint16_t> probs;   // [16][W] bf16: A tiles of P V
  std::vector<uint16_t> query;   // [16][D]: A tiles of Q K^T
};

void attend_head(const uint16_t* q, int64_t q_tok, const uint16_t* k, int64_t k_tok, const uint16_t* v, int64_t v_tok,
                 uint16_t* out, int64_t out_tok, int64_t L, int64_t D, int64_t G, float scale, Scratch& s) {
  const int64_t P = D / 2, W = (L + 31) / 32 * 32, DT = D / 16;
  s.keys.assign((W / 16) * P * 32, 0);
  s.values.assign((W / 2) * D * 2, 0);  // (keys past L stay zero: their probabilities are zero too)
  s.scores.resize(16 * W);
  s.probs.assign(16 * W, 0);
  s.query.assign(16 * D, 0);
  // 16 tokens' channel pair p at once: a gather at the tokens' offsets (in bf16 elements, scale 2)
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32((int)k_tok));
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const __mmask16 live = (__mmask16)((1u << std::min<int64_t>(16, L - t0)) - 1);
    auto* kdst = reinterpret_cast<__m512i*>(s.keys.data() + (t0 / 16) * P * 32);
    for (int64_t p = 0; p < P; ++p)
      _mm512_storeu_si512(kdst + p, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets,
                                                                 k + t0 * k_tok + 2 * p, 2));
  }
  // key pair (t, t + 1), 16 channels at a time: (v[t][d], v[t + 1][d]) interleaved
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t t = 0; t < L; t += 2) {
    const uint16_t* a = v + t * v_tok;
    const uint16_t* b = t + 1 < L ? a + v_tok : nullptr;
    uint16_t* vdst = s.values.data() + (t / 2) * D * 2;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i lo = _mm256_loadu_si256((const __m256i*)(a + d));
      const __m256i hi = b ? _mm256_loadu_si256((const __m256i*)(b + d)) : _mm256_setzero_si256();
      _mm512_storeu_si512(vdst + d * 2, _mm512_permutexvar_epi16(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)));
    }
  }
  alignas(64) float c[4][16][16];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i0 = 0; i0 < L; i0 += 16) {
      const int64_t rows = std::min<int64_t>(16, L - i0), kend = i0 + rows, KT = (kend + 15) / 16;
      const int64_t KB = (kend + 31) / 32;
      for (int64_t r = 0; r < rows; ++r) std::memcpy(&s.query[r * D], q + (i0 + r) * q_tok + g * D, D * 2);
      // scores [16 query tokens][keys 0..kend)
      for (int64_t kt = 0; kt < KT; ++kt) {
        _tile_zero(0);
        for (int64_t kc = 0; kc < D / 32; ++kc) {
          _tile_loadd(1, s.query.data() + kc * 32, D * 2);
          _tile_loadd(2, s.keys.data() + (kt * P + kc * 16) * 32, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, s.scores.data() + kt * 16, W * 4);
      }
      // causal mask, softmax; probabilities as bf16 (zero past each row's last key)
      float inv[16];
      for (int64_t r = 0; r < rows; ++r) {
        float* sc = &s.scores[r * W];
        const int64_t n = i0 + r + 1;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < KT; ++j) {
          const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(16, n - j * 16));
          const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << valid) - 1),
                                              _mm512_loadu_ps(sc + j * 16), _mm512_set1_ps(scale));
          _mm512_storeu_ps(sc + j * 16, x);
          m = _mm512_max_ps(m, x);
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        uint16_t* pr = &s.probs[r * W];
        for (int64_t j = 0; j < KT; ++j) {
          const __m512 e = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(sc + j * 16), mx));
          const __m256bh eb = _mm512_cvtneps_pbh(e);
          _mm256_storeu_si256((__m256i*)(pr + j * 16), (__m256i)eb);
          sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(eb));  // the sum of the rounded weights the values get
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
      }
      // out[16 tokens][16 channels x 4] += P [16 x 32 keys] . V [32 keys x 16 channels], over the keys
      for (int64_t dt = 0; dt < DT; dt += 4) {
        const int64_t nd = std::min<int64_t>(4, DT - dt);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < KB; ++kb) {
          _tile_loadd(4, s.probs.data() + kb * 32, W * 2);
          const uint16_t* vb = s.values.data() + kb * 16 * D * 2 + dt * 32;
          _tile_loadd(5, vb, D * 4);
          _tile_dpbf16ps(0, 4, 5);
          if (nd > 1) { _tile_loadd(5, vb + 32, D * 4); _tile_dpbf16ps(1, 4, 5); }
          if (nd > 2) { _tile_loadd(5, vb + 64, D * 4); _tile_dpbf16ps(2, 4, 5); }
          if (nd > 3) { _tile_loadd(5, vb + 96, D * 4); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, c[0], 64);
        if (nd > 1) _tile_stored(1, c[1], 64);
        if (nd > 2) _tile_stored(2, c[2], 64);
        if (nd > 3) _tile_stored(3, c[3], 64);
        for (int64_t r = 0; r < rows; ++r) {
          uint16_t* o = out + (i0 + r) * out_tok + g * D + dt * 16;
          for (int64_t x = 0; x < nd; ++x)
            _mm256_storeu_si256((__m256i*)(o + x * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(c[x][r]), _mm512_set1_ps(inv[r]))));
        }
      }
      for (int64_t r = 0; r < rows; ++r) std::memset(&s.probs[r * W], 0, KB * 32 * 2);  // for the next tile's padding
    }
  }
}

#endif  // PORTSIDE_CAUSAL_AMX

bool supported(int64_t head_size) {
#ifdef PORTSIDE_CAUSAL_AMX
  return head_size > 0 && head_size % 32 == 0 && head_size <= 256 && portside_amx::granted();
#else
  return false;
#endif
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t seqs, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.scalar_type() == at::kBFloat16 &&
                  k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "causal_attention: q, k, v [T, heads, D] bf16");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(supported(D), "causal_attention: head size ", D, " (needs AMX-BF16 and a multiple of 32 up to 256)");
  TORCH_CHECK(seqs > 0 && T % seqs == 0 && k.size(0) == T && v.size(0) == T && v.size(1) == KVH && k.size(2) == D &&
                  v.size(2) == D && KVH > 0 && H % KVH == 0,
              "causal_attention: shapes q ", q.sizes(), " k ", k.sizes(), " v ", v.sizes(), " seqs ", seqs);
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, "causal_attention: each token's heads must be dense");
  TORCH_CHECK(k.stride(0) * 16 < (int64_t{1} << 31), "causal_attention: key rows too far apart");
  at::Tensor out = at::empty({T, H, D}, q.options());
#ifdef PORTSIDE_CAUSAL_AMX
  const int64_t L = T / seqs, G = H / KVH;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, seqs * KVH, 1, [&](int64_t t0, int64_t t1) {
    portside_amx::configure_16x64();
    Scratch s;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / KVH, h = task % KVH, row = b * L;
      attend_head(qp + row * q.stride(0) + h * G * D, q.stride(0), kp + row * k.stride(0) + h * D, k.stride(0),
                  vp + row * v.stride(0) + h * D, v.stride(0), op + row * H * D + h * G * D, H * D, L, D, G,
                  (float)scale, s);
    }
    _tile_release();
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, int seqs, float scale) -> Tensor");
  m.def("causal_attention_supported(int head_size) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) { m.impl("causal_attention", &causal_attention); }
