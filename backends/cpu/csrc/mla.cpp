// Multi-head latent attention (MLA, DeepSeek-V2/V3) decode over the paged latent cache, the cpu
// backend's fast path (backends/cpu/mla.py): portside_cpu_native::mla_decode.
//
// Each decode's query holds H heads of D = latent_dim + rope_dim values (the absorbed form); its
// sequence's cached rows are one [D] row per token, shared by every head: score = q_h . row,
// value = row[:latent_dim]. The point of the format is that a row is read once for all heads, so
// a task (one sequence's range of tokens) walks its rows CHUNK at a time: the chunk's rows are
// read from the paged cache once (bf16 widened to fp32 by a shift) into a scratch tile, then
//  - the scores have the heads in the vector lanes: the queries are kept transposed ([D][heads],
//    scaled), so a token's scores are D fused multiply-adds of a query column with one row value
//    broadcast, four tokens at a time (no horizontal sums); with AVX512-BF16 and bf16 queries
//    over a bf16 cache, the pairs of values go through vdpbf16ps instead (half the instructions,
//    the same exact products, fp32 sums);
//  - the softmax is online, per head lane (running max and sum, fp32);
//  - the values are accumulated per head, the latent dimension in the lanes, eight heads at a
//    time over the chunk's rows (one row load for eight FMAs).
// A sequence longer than its share of the work is split over the OpenMP threads (flash-decoding:
// each split keeps its own max, sum and accumulator, merged at the end), so batch-1 decode uses
// every thread. Vectors are GCC vector extensions of recurrent.h's width (16 lanes with AVX-512,
// else 8, scalar code on other targets), so the same source compiles for AVX-512, AVX2 and any
// other CPU; the library is built with -march=native and its cache key holds the CPU's flags.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PS_MLA_DPBF16 1
#endif

#include "recurrent.h"

namespace {

using portside_recurrent::W;
using portside_recurrent::vf;
using portside_recurrent::vload;
using portside_recurrent::vstore;
using portside_recurrent::splat;
using portside_recurrent::vexp;
using portside_recurrent::ld;
using portside_recurrent::st;

constexpr int64_t CHUNK = 32;  // tokens whose rows a task holds in its fp32 tile at once
constexpr int64_t MIN_TASK_WORK = 1 << 15;  // fused multiply-adds (vectors) a split is worth at least

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

struct Shape {
  int64_t H, D, L, NV;  // heads, row values, latent values, head vectors (H / W rounded up)
  int64_t Lp, ldr;      // L rounded up to W; a tile row's floats (>= D and Lp, a multiple of W)
};

struct Task {
  int64_t seq, t0, t1;
};

// The queries transposed and scaled: qT[b][d][v * W + lane] = q[b][v * W + lane][d] * scale (0 past H).
template <typename Q>
void transpose_queries(const Q* q, int64_t sb, int64_t sh, int64_t B, const Shape& s, float scale, float* qT) {
  const int64_t ldq = s.NV * W;
  std::fill(qT, qT + B * s.D * ldq, 0.f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t d = 0; d < s.D; ++d) qT[(b * s.D + d) * ldq + h] = ld(q[b * sb + h * sh + d]) * scale;
}

// S[i][v0 + g] (vectors of heads) = the scores of tile rows i < n, head vectors v0 .. v0 + G.
template <int G>
void scores(const float* qT, int64_t ldq, int64_t v0, const float* rows, int64_t ldr, int64_t n, int64_t D, vf* S,
            int64_t lds) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    vf a[4][G] = {};
    const float* r = rows + i * ldr;
    for (int64_t d = 0; d < D; ++d) {
      vf qv[G];
      for (int g = 0; g < G; ++g) qv[g] = vload(qT + d * ldq + (v0 + g) * W);
      for (int k = 0; k < 4; ++k) {
        const float x = r[k * ldr + d];
        for (int g = 0; g < G; ++g) a[k][g] += qv[g] * x;
      }
    }
    for (int k = 0; k < 4; ++k)
      for (int g = 0; g < G; ++g) S[(i + k) * lds + v0 + g] = a[k][g];
  }
  for (; i < n; ++i) {
    vf a[G] = {};
    const float* r = rows + i * ldr;
    for (int64_t d = 0; d < D; ++d)
      for (int g = 0; g < G; ++g) a[g] += vload(qT + d * ldq + (v0 + g) * W) * r[d];
    for (int g = 0; g < G; ++g) S[i * lds + v0 + g] = a[g];
  }
}

#ifdef PS_MLA_DPBF16
// The same scores from bf16 operands: qP[b][d / 2][head] holds the pair (q[head][d], q[head][d + 1])
// in one 32-bit lane (16 heads a vector), each cached row's pair of values is broadcast as one
// 32-bit word, and vdpbf16ps adds both products to the fp32 lane. D is even (pairs); the scale
// is applied to the scores afterwards (a bf16 query cannot carry it exactly).
template <int G>
void scores_bf16(const uint32_t* qP, int64_t ldq, int64_t v0, const uint16_t* const* rows, int64_t n, int64_t D,
                 float scale, vf* S, int64_t lds) {
  static_assert(W == 16, "vdpbf16ps takes 16 fp32 lanes");
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m512 a[4][G];
    for (int k = 0; k < 4; ++k)
      for (int g = 0; g < G; ++g) a[k][g] = _mm512_setzero_ps();
    const uint32_t* r[4];
    for (int k = 0; k < 4; ++k) r[k] = reinterpret_cast<const uint32_t*>(rows[i + k]);
    for (int64_t d = 0; d < D / 2; ++d) {
      __m512bh qv[G];
      for (int g = 0; g < G; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(qP + d * ldq + (v0 + g) * W);
      for (int k = 0; k < 4; ++k) {
        uint32_t word;
        std::memcpy(&word, r[k] + d, 4);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
        for (int g = 0; g < G; ++g) a[k][g] = _mm512_dpbf16_ps(a[k][g], qv[g], x);
      }
    }
    for (int k = 0; k < 4; ++k)
      for (int g = 0; g < G; ++g) {
        __m512 v = _mm512_mul_ps(a[k][g], sc);
        std::memcpy(&S[(i + k) * lds + v0 + g], &v, sizeof(v));
      }
  }
  for (; i < n; ++i) {
    const uint32_t* r0 = reinterpret_cast<const uint32_t*>(rows[i]);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < D / 2; ++d) {
        uint32_t word;
        std::memcpy(&word, r0 + d, 4);
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qP + d * ldq + (v0 + g) * W),
                             (__m512bh)_mm512_set1_epi32(static_cast<int>(word)));
      }
      a = _mm512_mul_ps(a, sc);
      std::memcpy(&S[i * lds + v0 + g], &a, sizeof(a));
    }
  }
}
#endif

// acc[h][j] += sum_i P[i][h] * rows[i][j] for heads h0 .. h0 + HB, j < Lp (a multiple of W).
template <int HB>
void values(const float* P, int64_t ldp, int64_t h0, const float* rows, int64_t ldr, int64_t n, int64_t Lp, float* acc,
            int64_t lda) {
  for (int64_t j = 0; j < Lp; j += W) {
    vf a[HB];
    for (int k = 0; k < HB; ++k) a[k] = vload(acc + (h0 + k) * lda + j);
    for (int64_t i = 0; i < n; ++i) {
      const vf r = vload(rows + i * ldr + j);
      const float* p = P + i * ldp + h0;
      for (int k = 0; k < HB; ++k) a[k] += r * p[k];
    }
    for (int k = 0; k < HB; ++k) vstore(acc + (h0 + k) * lda + j, a[k]);
  }
}

// One task: tokens [t0, t1) of one sequence, leaving its running max and sum per head (m, l:
// NV * W floats each) and its unnormalised output acc [H][Lp].
template <typename C>
void run_task(const Task& t, const Shape& s, const C* cache, int64_t sblk, int64_t soff, int64_t bs, const int32_t* table,
              const float* qT, const uint32_t* qP, float scale, float* m, float* l, float* acc, float* tile, vf* S,
              const C** rowp) {
  const int64_t ldq = s.NV * W, lds = s.NV, ldp = s.NV * W;
  float* P = reinterpret_cast<float*>(S);  // the probabilities overwrite the scores, lane for lane
  for (int64_t v = 0; v < s.NV; ++v) {
    vstore(m + v * W, splat(-std::numeric_limits<float>::infinity()));
    vstore(l + v * W, splat(0.f));
  }
  std::fill(acc, acc + s.H * s.Lp, 0.f);
  for (int64_t c0 = t.t0; c0 < t.t1; c0 += CHUNK) {
    const int64_t n = std::min(CHUNK, t.t1 - c0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = c0 + i;
      rowp[i] = cache + table[pos / bs] * sblk + (pos % bs) * soff;
    }
    // the chunk's rows, widened: the values always, the whole rows when the scores read them here
    const bool dp = qP != nullptr;
    const int64_t width = dp ? s.L : s.D;
    for (int64_t i = 0; i < n; ++i) {
      float* dst = tile + i * s.ldr;
      const C* src = rowp[i];
      for (int64_t d = 0; d < width; ++d) dst[d] = ld(src[d]);
    }
    for (int64_t v = 0; v < s.NV;) {
#ifdef PS_MLA_DPBF16
      if (dp) {
        if constexpr (sizeof(C) == 2) {
          const uint16_t* const* rb = reinterpret_cast<const uint16_t* const*>(rowp);
          if (v + 2 <= s.NV) scores_bf16<2>(qP, ldq, v, rb, n, s.D, scale, S, lds), v += 2;
          else scores_bf16<1>(qP, ldq, v, rb, n, s.D, scale, S, lds), v += 1;
          continue;
        }
      }
#endif
      if (v + 2 <= s.NV) scores<2>(qT, ldq, v, tile, s.ldr, n, s.D, S, lds), v += 2;
      else scores<1>(qT, ldq, v, tile, s.ldr, n, s.D, S, lds), v += 1;
    }
    // online softmax, per head lane
    for (int64_t v = 0; v < s.NV; ++v) {
      vf mx = S[v];
      for (int64_t i = 1; i < n; ++i) mx = vmax(mx, S[i * lds + v]);
      const vf m_old = vload(m + v * W), m_new = vmax(m_old, mx);
      const vf alpha = vexp(m_old - m_new);
      vf sum = splat(0.f);
      for (int64_t i = 0; i < n; ++i) {
        const vf p = vexp(S[i * lds + v] - m_new);
        S[i * lds + v] = p;
        sum += p;
      }
      vstore(l + v * W, vload(l + v * W) * alpha + sum);
      vstore(m + v * W, m_new);
      if (c0 > t.t0) {  // rescale what the earlier chunks accumulated
        float al[W];
        vstore(al, alpha);
        for (int64_t k = 0; k < W && v * W + k < s.H; ++k) {
          float* a = acc + (v * W + k) * s.Lp;
          const vf f = splat(al[k]);
          for (int64_t j = 0; j < s.Lp; j += W) vstore(a + j, vload(a + j) * f);
        }
      }
    }
    int64_t h = 0;
    for (; h + 8 <= s.H; h += 8) values<8>(P, ldp, h, tile, s.ldr, n, s.Lp, acc, s.Lp);
    for (; h + 4 <= s.H; h += 4) values<4>(P, ldp, h, tile, s.ldr, n, s.Lp, acc, s.Lp);
    for (; h < s.H; ++h) values<1>(P, ldp, h, tile, s.ldr, n, s.Lp, acc, s.Lp);
  }
}

template <typename C, typename Q>
void decode(const at::Tensor& q, const at::Tensor& cache, const int32_t* tables, int64_t stride_bt, const int32_t* lens,
            const Shape& s, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), bs = cache.size(1);
  const int64_t ldq = s.NV * W;
  const C* cp = reinterpret_cast<const C*>(cache.const_data_ptr());
  const int64_t sblk = cache.stride(0), soff = cache.stride(1);
  std::vector<float> qT;
  std::vector<uint32_t> qP;
  bool dp = false;
#ifdef PS_MLA_DPBF16
  dp = sizeof(C) == 2 && sizeof(Q) == 2 && s.D % 2 == 0;
#endif
  const Q* qp = reinterpret_cast<const Q*>(q.const_data_ptr());
  if (dp) {  // the bf16 queries as pairs of values per head lane (unscaled: exact)
    qP.assign(B * (s.D / 2) * ldq, 0u);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < s.H; ++h) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(qp + b * q.stride(0) + h * q.stride(1));
        for (int64_t d = 0; d < s.D / 2; ++d)
          qP[(b * (s.D / 2) + d) * ldq + h] = uint32_t(src[2 * d]) | (uint32_t(src[2 * d + 1]) << 16);
      }
  } else {
    qT.resize(B * s.D * ldq);
    transpose_queries(qp, q.stride(0), q.stride(1), B, s, scale, qT.data());
  }
  // the tasks: each sequence in splits of at least MIN_TASK_WORK, the work shared by the threads
  const int threads = std::max(1, at::get_num_threads());
  const int64_t per_token = s.D * s.NV + s.H * (s.Lp / W);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += lens[b];
  const int64_t share = std::max<int64_t>({CHUNK / 2, MIN_TASK_WORK / per_token, (total + threads - 1) / threads});
  std::vector<Task> tasks;
  std::vector<int64_t> first(B + 1);
  for (int64_t b = 0; b < B; ++b) {
    first[b] = static_cast<int64_t>(tasks.size());
    const int64_t n = lens[b], parts = std::clamp<int64_t>((n + share - 1) / share, 1, 64);
    const int64_t per = round_up((n + parts - 1) / parts, 4);
    for (int64_t t0 = 0; t0 < n; t0 += per) tasks.push_back({b, t0, std::min(n, t0 + per)});
  }
  first[B] = static_cast<int64_t>(tasks.size());
  const int64_t nt = first[B];
  const int64_t part = 2 * ldq + s.H * s.Lp;  // a task's m, l, acc
  std::vector<float> parts(nt * part);
  const float* qTp = dp ? nullptr : qT.data();
  const uint32_t* qPp = dp ? qP.data() : nullptr;
  // sequence b's output from its tasks' parts: sum_k e^(m_k - M) acc_k / sum_k e^(m_k - M) l_k
  auto merge = [&](int64_t b) {
    Q* ob = reinterpret_cast<Q*>(out.mutable_data_ptr()) + b * out.stride(0);
    const int64_t k0 = first[b], k1 = first[b + 1];
    float w[64];  // a sequence has at most `threads` tasks
    for (int64_t h = 0; h < s.H; ++h) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t k = k0; k < k1; ++k) M = std::max(M, parts[k * part + h]);
      float denom = 0.f;
      for (int64_t k = k0; k < k1; ++k) {
        w[k - k0] = std::exp(parts[k * part + h] - M);
        denom += w[k - k0] * parts[k * part + ldq + h];
      }
      Q* o = ob + h * out.stride(1);
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      for (int64_t j = 0; j < s.L; ++j) {
        float sum = 0.f;
        for (int64_t k = k0; k < k1; ++k) sum += w[k - k0] * parts[k * part + 2 * ldq + h * s.Lp + j];
        st(o + j, sum * inv);
      }
    }
  };
  // one parallel region, one barrier: a sequence in one task is written out by that task, the
  // split ones (a few long sequences) are merged afterwards
#pragma omp parallel num_threads(threads) if (threads > 1 && nt > 1)
  {
    std::vector<float> tile(CHUNK * s.ldr + W, 0.f);
    std::vector<vf> S(CHUNK * s.NV);
    std::vector<const C*> rowp(CHUNK);
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < nt; ++k) {
      const Task& t = tasks[k];
      float* pk = parts.data() + k * part;
      run_task<C>(t, s, cp, sblk, soff, bs, tables + t.seq * stride_bt, qTp ? qTp + t.seq * s.D * ldq : nullptr,
                  qPp ? qPp + t.seq * (s.D / 2) * ldq : nullptr, scale, pk, pk + ldq, pk + 2 * ldq, tile.data(), S.data(),
                  rowp.data());
      if (first[t.seq + 1] - first[t.seq] == 1) merge(t.seq);
    }
  }
  for (int64_t b = 0; b < B; ++b)
    if (first[b + 1] - first[b] > 1) merge(b);
}

// q [B, H, D] (fp32 or bf16; each head's values contiguous), cache [blocks, block_size, D] (fp32
// or bf16, rows contiguous), block_tables [>= B, n] int32, seq_lens [>= B] int32 -> [B, H, latent_dim]
// in q's dtype: each query attends to the seq_lens[b] first rows of its sequence.
at::Tensor mla_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      double scale, int64_t latent_dim) {
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu() && q.stride(2) == 1, "mla_decode: q must be a [B, H, D] cpu tensor with "
              "unit last stride, got ", q.sizes(), " strides ", q.strides());
  TORCH_CHECK(cache.dim() == 3 && cache.device().is_cpu() && cache.stride(2) == 1,
              "mla_decode: cache must be a [blocks, block_size, D] cpu tensor with unit last stride, got ", cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), bs = cache.size(1), nb = cache.size(0);
  TORCH_CHECK(cache.size(2) == D, "mla_decode: the cache's rows hold ", cache.size(2), " values, the queries ", D);
  TORCH_CHECK(latent_dim >= 1 && latent_dim <= D, "mla_decode: latent_dim ", latent_dim, " outside [1, ", D, "]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "mla_decode: q must be fp32 or bf16");
  TORCH_CHECK(cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16,
              "mla_decode: the cache must be fp32 or bf16");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                  block_tables.size(0) >= B && seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous() && seq_lens.numel() >= B,
              "mla_decode: block_tables must be [>= B, n] int32 (rows contiguous) and seq_lens [>= B] int32");
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int64_t stride_bt = block_tables.stride(0), n_cols = block_tables.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= n_cols * bs, "mla_decode: sequence ", b, "'s length ", lens[b],
                " outside [1, ", n_cols * bs, "]");
    for (int64_t c = 0; c < (lens[b] + bs - 1) / bs; ++c) {
      const int32_t blk = tables[b * stride_bt + c];
      TORCH_CHECK(blk >= 0 && blk < nb, "mla_decode: sequence ", b, "'s block ", blk, " outside [0, ", nb, ")");
    }
  }
  Shape s;
  s.H = H, s.D = D, s.L = latent_dim, s.NV = (H + W - 1) / W, s.Lp = round_up(latent_dim, W);
  s.ldr = std::max(round_up(D, W), s.Lp);
  at::Tensor out = at::empty({B, H, latent_dim}, q.options());
  if (B == 0 || H == 0) return out;
  const float sc = static_cast<float>(scale);
  const bool qbf = q.scalar_type() == at::kBFloat16, cbf = cache.scalar_type() == at::kBFloat16;
  if (cbf && qbf) decode<uint16_t, uint16_t>(q, cache, tables, stride_bt, lens, s, sc, out);
  else if (cbf) decode<uint16_t, float>(q, cache, tables, stride_bt, lens, s, sc, out);
  else if (qbf) decode<float, uint16_t>(q, cache, tables, stride_bt, lens, s, sc, out);
  else decode<float, float>(q, cache, tables, stride_bt, lens, s, sc, out);
  return out;
}

// Which score kernel this build runs: "avx512bf16" (vdpbf16ps for bf16 queries over a bf16
// cache, else fp32 FMAs on 16 lanes), "avx512", "avx2" or "portable" (vector extensions).
std::string mla_isa() {
#if defined(PS_MLA_DPBF16)
  return "avx512bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("mla_decode(Tensor q, Tensor cache, Tensor block_tables, Tensor seq_lens, float scale, int latent_dim) -> Tensor");
  m.def("mla_isa() -> str", &mla_isa);
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) { m.impl("mla_decode", &mla_decode); }
