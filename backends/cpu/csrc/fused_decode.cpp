// A whole batch-1 decode step of a Llama-family fp32 or bf16 model in one C++ call:
// torch.classes.portside_cpu_native.LlamaDecoder(tensors, dims, eps, scale).step(ids, positions)
// -> (hidden [1, hidden] after the final norm, logits [1, vocab]).
//
// Batch-1 decode reads every weight once per token, one matrix after another. Run op by op (eager
// or an Inductor graph), the matrices are separated by dispatcher calls, small kernels (norms,
// rotary, SiLU, residual adds), one OpenMP fork/join each and the compiled call's entry and exit:
// ~2 ms of a ~12 ms step on the CI machine's Zen 4 in its high-bandwidth state. Here the step is
// one OpenMP parallel region: each thread streams its rows of every matrix (row_dot.h), the
// small operations run inside the region on data the threads already hold, and the threads meet
// at a barrier only where the next matrix needs the whole of the previous result (5 a layer).
//
// Attention reads the step's decode plan (decode_plan.h, installed by set_decode_step) with the
// kernels of paged_attention.c, the context cut into splits of equal length (see `step`) that
// are merged (flash-decoding); the thread that attends the newest split first writes the new K/V
// row. Numerically it is the model's own forward pass (same operations, fp32) summed in another
// order: tests/backends/test_cpu_fused_decode.py checks it against the model and transformers.
//
// `step_rows(ids[M], positions[M])` -> hidden [M, hidden] is the same step for one sequence's
// M = 2..16 rows (a speculative verification step, a short prefill chunk), under a one-sequence
// multi-row plan, and `logits(hidden [N, hidden])` its LM head: see "Multi-row steps" below and
// tests/backends/test_cpu_fused_rows.py.
//
// bf16 models (`step`, `step_rows` and `logits`): the matrices (qkv, o,
// gate_up, down, LM head) and the embedding stay bf16 and are streamed as they are, half the bytes
// of fp32; each row's dot product converts its weights to fp32 as it loads them (row_dot.h's
// `dot1_bf16` / `dot2_bf16`: a 16-bit shift, on AVX-512 32 weights a load split into even and odd
// lanes) and accumulates in fp32, and the activations are fp32 throughout the step (the
// norm weights, biases and rotary table are copied to fp32 once). The KV cache is the model's
// bf16 cache: the new K/V rows are rounded to bf16 as torch rounds, and attention reads them with
// paged_attention.c's bf16 path (fp32 softmax and sums). The step returns fp32 hidden states and
// logits, as for an fp32 model; `step_rows` likewise (row_tile.h's tiles widen each weight
// vector once for all the tile's inputs). No `vdpbf16ps` (AVX-512-BF16) path: it would round the
// activations to bf16, and on the Sapphire Rapids VM the widening already streams near a plain
// sum's rate (row_dot.h).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>  // paged_attention.c's 8-bit loads, outside the namespace below
#endif
#include <omp.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <tuple>
#include <vector>

#include "decode_plan.h"
#include "gguf_dot.h"
#include "row_dot.h"
#include "row_tile.h"

namespace {
namespace paged {  // the kernels' pieces, internal to this file (decode_attention.cpp has its own)
#define restrict __restrict__
#define _Thread_local thread_local
#include "paged_attention.c"
#undef restrict
#undef _Thread_local
}  // namespace paged

// Build with -DPORTSIDE_FUSED_PROFILE for per-thread cycle counts of each stage of a step
// (`fused_profile()`: [threads, stages], summed over steps since the last call).
#ifdef PORTSIDE_FUSED_PROFILE
#include <x86intrin.h>
constexpr int kStages = 22;  // 0-10: `step`; 11-21: `step_rows` (its stage k is 11 + k)
int64_t prof[64][kStages];
#define MARK(k)                                   \
  do {                                            \
    const int64_t now = (int64_t)__rdtsc();       \
    prof[t & 63][k] += now - last;                \
    last = now;                                   \
  } while (0)
#else
#define MARK(k) \
  do {          \
  } while (0)
#endif

// The tensors of one decoder layer, in the order `LlamaDecoder`'s constructor takes them.
constexpr int kPerLayer = 10;

// W: the matrices' element type, float or uint16_t (bf16 bits); norms and biases are fp32.
template <class W>
struct LayerT {
  const float* in_norm;
  const W* qkv;
  const float* qkv_b;
  const W* o;
  const float *o_b, *post_norm;
  const W* gate_up;
  const float* gate_up_b;
  const W* down;
  const float* down_b;
};
using Layer = LayerT<float>;
using Layer16 = LayerT<uint16_t>;
struct QMat;
using LayerQ = LayerT<QMat>;  // a GGUF-quantized model's: pointers to its `QMat`s

// [begin, end) of `n` items for thread `t` of `threads`: even contiguous shares.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int threads) {
  return {n * t / threads, n * (t + 1) / threads};
}

// y[r] = x . w[r] for r in [r0, r1), one row after another: one stream per thread. Measured in
// this step against row_dot.h's two streams (rows r and r + half side by side, which is faster
// for the standalone linear_row operator), paired rounds in one process: 1.25 vs 1.345x of a
// plain sum over the weights in the high-bandwidth state, 1.068 vs 1.09x in the low one.
inline void rows1(const float* x, const float* w, float* y, int64_t K, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) y[r] = portside_rows::dot1(x, w + r * K, K);
}

using portside_rows::bf16_value;  // the bf16 dot products are row_dot.h's (linear_row uses them too)
using portside_rows::dot2_bf16;
#if defined(__AVX2__) && defined(__FMA__)
using portside_rows::bf16x8_ps;
using portside_rows::hsum_ps;
#endif

// bf16 rows: the chunk's two halves side by side (row_dot.h's `rows`, measured there).
inline void rows1(const float* x, const uint16_t* w, float* y, int64_t K, int64_t r0, int64_t r1) {
  portside_rows::rows(x, w, y, K, r0, r1);
}

// Dot products of x with two rows (gate and up of one channel), fp32 or bf16 weights.
inline void dot2w(const float* x, const float* r0, const float* r1, int64_t K, float* y0, float* y1) {
  portside_rows::dot2(x, r0, r1, K, y0, y1);
}
inline void dot2w(const float* x, const uint16_t* r0, const uint16_t* r1, int64_t K, float* y0, float* y1) {
  dot2_bf16(x, r0, r1, K, y0, y1);
}

// An embedding row as fp32.
inline void embed_row(float* out, const float* row, int64_t n) { memcpy(out, row, n * sizeof(float)); }
inline void embed_row(float* out, const uint16_t* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_value(row[i]);
}

// Rows [0, n_rows) of one matrix-vector product over the threads. Each thread streams its even
// share in chunks of kGrain rows taken from its own counter, then takes the chunks left in the
// others' shares: a thread slowed down (the VM's other work, an interrupt) is not waited for at the
// next barrier. Measured on the CI machine (default model, 2 threads): with even static shares the
// faster thread waited 0.5-2.5 ms a step at the barriers, ~0.1 ms with this. Chunks of 64 rows:
// 16 streamed slower in the high-bandwidth state, 256 and halving chunks were no better.
constexpr int64_t kGrain = 64;

// Before a barrier, each thread prefetches the first kPrefetchBytes of its share of the next
// matrix: the weights do not depend on the activations, so their stream need not stop while the
// threads wait for each other. Measured in the step alone against no prefetch (paired rounds, one
// process, session 11): -1.7% and -1.8% a step in the ~84 GB/s state in two runs (193 and 149
// rounds), -0.4% in a third (86), no change at ~50 GB/s;
// prefetching the first K/V rows of the thread's attention split as well changed nothing.
constexpr int64_t kPrefetchBytes = 4096;

template <class W>
inline void prefetch_share(const W* w, int64_t n_rows, int64_t K, int t, int n) {
  const auto [r0, r1] = share(n_rows, t, n);
  const char* p = (const char*)(w + r0 * K);
  const int64_t bytes = std::min<int64_t>(kPrefetchBytes, (r1 - r0) * K * (int64_t)sizeof(W));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

struct alignas(64) Counter {
  std::atomic<int64_t> next;
};

template <class F>
inline void rows_shared(Counter* counters, int64_t n_rows, int t, int n, F&& fn) {
  for (int o = 0; o < n; ++o) {
    const int u = (t + o) % n;
    const auto [u0, u1] = share(n_rows, u, n);
    for (;;) {
      const int64_t r0 = u0 + counters[u].next.fetch_add(kGrain, std::memory_order_relaxed);
      if (r0 >= u1) break;
      fn(r0, std::min(u1, r0 + kGrain));
    }
  }
}

// out = w * x / rms(x) over `n` floats (Hugging Face's RMSNorm in fp32).
void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// Rotate `heads` heads of `d` floats (rotate-half layout) by one position's cos | sin row.
void rotate(const float* x, float* out, int64_t heads, int64_t d, const float* cos_sin) {
  const int64_t half = d / 2;
  const float *c = cos_sin, *s = cos_sin + half;
  for (int64_t h = 0; h < heads; ++h) {
    const float* a = x + h * d;
    float* o = out + h * d;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      o[i] = a[i] * c[i] - a[half + i] * s[i];
      o[half + i] = a[half + i] * c[i] + a[i] * s[i];
    }
  }
}

// silu(g) = g * sigmoid(g), with exp of a non-positive argument only (vectorizable, no overflow).
inline float silu(float g) {
  const float e = paged::exp_nonpos(-fabsf(g));
  return g * (g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
}

// ---------------------------------------------------------------------------------------------
// GGUF-quantized models (`step_h`): the matrices stay in their GGUF blocks as the file stores
// them, and each dot product is gguf_dot's (csrc/gguf_dot*.cpp: the weights times the activations
// quantized to 8 bits per block, llama.cpp's arithmetic, the same path the op-by-op
// ``cpu_gguf_act=int8`` linears take). A matrix is one or more parts of consecutive output rows, each
// of one GGUF type (a fused q/k/v whose v is Q6_K and q/k Q4_K, as llama.cpp's Q4_K_M mix writes).
// Each thread quantizes a matrix's input itself (a few microseconds, against the ~1 ms its rows take
// to stream) and computes its `rows_shared` chunks with the kernels' one-row path (`dot_rows`).
// The embedding row comes from the caller (the model's quantized embedding, looked up in torch).

struct QPart {
  const uint8_t* w;  // GGUF rows [rows, rb]
  int64_t rb, type, row0, rows;  // row bytes, ggml type, first output row in the matrix, row count
};
struct QMat {
  std::vector<QPart> parts;  // in output order, covering the matrix's rows
};
constexpr size_t kMaxParts = 4;

// One thread's input of a matrix, quantized for each part's type (`prep`); and gate/up scratch.
struct QAct {
  portside_gguf::Activations a[kMaxParts];
  portside_gguf::Ctx c[kMaxParts];
  int64_t isa;
  std::vector<float> gu;  // [2 I]: this thread's chunk of gate and up rows
};

// The dense step's matrix input: x as it is. A quantized matrix's: x quantized into `q`.
template <class W>
inline const float* prep(const float* x, int64_t, const W*, QAct*) {
  return x;
}
inline const QAct* prep(const float* x, int64_t K, const QMat* m, QAct* q) {
  for (size_t p = 0; p < m->parts.size(); ++p) {
    const QPart& part = m->parts[p];
    if (p > 0 && m->parts[p - 1].type == part.type) q->c[p] = q->c[p - 1];  // the same codes
    else q->c[p] = portside_gguf::quantize_activations(x, 1, K, part.type, q->a[p], false);
    q->c[p].w = part.w, q->c[p].rb = part.rb, q->c[p].N = part.rows;
  }
  return q;
}

// y[r] = x . w[r] for r in [r0, r1) of a quantized matrix, part by part.
inline void rows1(const QAct* q, const QMat* m, float* y, int64_t, int64_t r0, int64_t r1) {
  for (size_t p = 0; p < m->parts.size(); ++p) {
    const QPart& part = m->parts[p];
    const int64_t a = std::max(r0, part.row0), b = std::min(r1, part.row0 + part.rows);
    if (a >= b) continue;
    portside_gguf::Ctx c = q->c[p];
    c.y = y + part.row0;
    portside_gguf::dot_rows(c, q->isa, part.type, a - part.row0, b - part.row0);
  }
}

// act[ch] = silu(gate_ch . x + b) * (up_ch . x + b) for the channels [c0, c1): gate rows first,
// then up (I each). Dense: the two rows of a channel side by side.
template <class W>
inline void gate_up_rows(const float* x, const W* w, int64_t I, int64_t H, const float* bias, float* act, int64_t c0,
                         int64_t c1, QAct*) {
  for (int64_t ch = c0; ch < c1; ++ch) {
    float g, u;
    dot2w(x, w + ch * H, w + (I + ch) * H, H, &g, &u);
    if (bias) g += bias[ch], u += bias[I + ch];
    act[ch] = silu(g) * u;
  }
}
inline void gate_up_rows(const QAct* x, const QMat* w, int64_t I, int64_t H, const float* bias, float* act, int64_t c0,
                         int64_t c1, QAct* q) {
  float* gu = q->gu.data();
  rows1(x, w, gu, H, c0, c1);
  rows1(x, w, gu, H, I + c0, I + c1);
  for (int64_t ch = c0; ch < c1; ++ch) {
    float g = gu[ch], u = gu[I + ch];
    if (bias) g += bias[ch], u += bias[I + ch];
    act[ch] = silu(g) * u;
  }
}

// The first kPrefetchBytes of each part's rows in [r0, r1).
inline void prefetch_rows(const QMat* m, int64_t r0, int64_t r1) {
  int64_t left = kPrefetchBytes;
  for (const QPart& part : m->parts) {
    const int64_t a = std::max(r0, part.row0), b = std::min(r1, part.row0 + part.rows);
    if (a >= b || left <= 0) continue;
    const char* p = (const char*)(part.w + (a - part.row0) * part.rb);
    const int64_t bytes = std::min(left, (b - a) * part.rb);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
    left -= bytes;
  }
}
inline void prefetch_share(const QMat* m, int64_t n_rows, int64_t, int t, int n) {
  const auto [r0, r1] = share(n_rows, t, n);
  prefetch_rows(m, r0, r1);
}
// This thread's shares of gate's rows and of up's.
template <class W>
inline void prefetch_gate_up(const W* w, int64_t I, int64_t H, int t, int n) {
  prefetch_share(w, I, H, t, n);
  prefetch_share(w + I * H, I, H, t, n);
}
inline void prefetch_gate_up(const QMat* m, int64_t I, int64_t, int t, int n) {
  const auto [r0, r1] = share(I, t, n);
  prefetch_rows(m, r0, r1);
  prefetch_rows(m, I + r0, I + r1);
}

inline void embed_row(float*, const QMat*, int64_t) {
  TORCH_CHECK(false, "LlamaDecoder: a GGUF-quantized decoder takes the embedding row (step_h), not token ids");
}

// ---------------------------------------------------------------------------------------------
// Multi-row steps (`step_rows`): one sequence, M = 2..kMaxRows query rows at consecutive positions
// (a speculative verification step: the last token and k proposals; or a short prefill chunk).
//
// Op by op, such a step costs ~2.7x a batch-1 step for 5 rows (oneDNN's small-M GEMMs, one
// fork/join per matrix, prefill-style attention through Python). A row at a time through a
// GEMV-like kernel reads every weight M times (from cache after the first, but with two loads
// per FMA it is load-bound). Here, as in `step`, the whole model is one OpenMP region, and each
// weight row is loaded once into registers for all M inputs: the register tiles of row_tile.h
// (AVX2: 2 weight rows x MR inputs of 8-float accumulators; AVX-512: 4 x MR of 16) make one load
// of weights feed MR FMAs, and the step stays near the weight stream's time while M is small.
//
// Measured on the shared dev VM (Zen 3, AVX2, default model, 200-token context, best of 8 rounds
// side by side in one process), a step including its LM head against the batch-1 `step`:
// 1 thread: 2 rows 0.70x, 3 rows 0.81x, 5 rows 1.02x, 8 rows 1.43x, 16 rows 2.33x (5 rows op by
// op: 1.73x); 2 threads: 0.71x, 0.86x, 1.08x, 1.53x, 2.58x (op by op 3.15x). Beyond ~5 rows the
// tile's FMAs, not the weight stream, set the time. Stage profile at 5 rows, 1 thread: attention
// (one `decode_range` per row and split, every row re-reading the K/V rows) is ~31% of the layers'
// time against ~5% in `step`; the matrices ~69%, the LM head ~13 ms of a ~62 ms step.

constexpr int64_t kMaxRows = 16;  // attention.MAX_FUSED_ROWS on the Python side

using portside_tile::rows_m;  // the register tiles (row_tile.h)

at::Tensor checked(const at::Tensor& t, std::vector<int64_t> shape, const char* what,
                   at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), "LlamaDecoder: ", what,
              " must be a contiguous ", dtype == at::kFloat ? "fp32" : "bf16", " cpu tensor");
  TORCH_CHECK(t.sizes().vec() == shape, "LlamaDecoder: ", what, " has shape ", t.sizes(), ", expected ",
              at::IntArrayRef(shape));
  return t;
}

struct LlamaDecoder : torch::CustomClassHolder {
  std::vector<at::Tensor> tensors;  // keeps every weight alive: the pointers below are into these
  std::vector<Layer> layers;      // an fp32 model's
  std::vector<Layer16> layers16;  // a bf16 model's
  const float *embed = nullptr, *final_norm, *lm_head = nullptr, *cos_sin;
  const uint16_t *embed16 = nullptr, *lm_head16 = nullptr;  // a bf16 model's
  bool bf16 = false;
  // A GGUF-quantized model's (dims[7] == 1): matrices `qmats` (per layer qkv, o, gate_up, down,
  // then the LM head; filled by `set_quantized`), layers `layersq`; its steps are `step_h`'s.
  bool quant = false;
  std::vector<QMat> qmats;
  std::vector<LayerQ> layersq;
  std::vector<QAct> qacts;  // per thread
  int64_t qisa = 0;
  int64_t L, H, NH, KVH, D, I, V, P;
  float eps, scale;
  // Step buffers: shared by the threads (each writes its own share), and per thread. So one step
  // at a time per decoder (the engine's model runner steps on one thread).
  std::vector<float> h, qkv, attn, act, y, parts;
  std::vector<float> hm, ym, qkvm, attnm, actm;  // `step_rows`' shared buffers: [M, ...] each
  std::vector<Counter> counters;         // per matrix of a step, per thread: `rows_shared`
  std::vector<std::vector<float>> mine;  // per thread: normed input | roped q | merged attention | scratch

  // `tensors`: embedding [V, H], final norm [H], LM head [V, H], rotary cos | sin table [P, D], then
  // per layer: input norm [H], qkv [(NH + 2 KVH) D, H], its bias, o [H, NH D], its bias, post norm
  // [H], gate_up [2 I, H] (gate rows first), its bias, down [H, I], its bias; a missing bias is an
  // empty tensor. `dims`: L, H, NH, KVH, D, I, V.
  LlamaDecoder(std::vector<at::Tensor> ts, std::vector<int64_t> dims, double eps_, double scale_)
      : tensors(std::move(ts)), eps((float)eps_), scale((float)scale_) {
    TORCH_CHECK(dims.size() == 7 || (dims.size() == 8 && (dims[7] == 0 || dims[7] == 1)),
                "LlamaDecoder: dims are L, H, NH, KVH, D, I, V and optionally 1 for GGUF-quantized matrices");
    L = dims[0], H = dims[1], NH = dims[2], KVH = dims[3], D = dims[4], I = dims[5], V = dims[6];
    quant = dims.size() == 8 && dims[7] == 1;
    TORCH_CHECK((int64_t)tensors.size() == 4 + kPerLayer * L, "LlamaDecoder: expected ", 4 + kPerLayer * L,
                " tensors for ", L, " layers, got ", tensors.size());
    TORCH_CHECK(KVH > 0 && NH % KVH == 0 && D % 2 == 0, "LlamaDecoder: bad head counts or head size");
    TORCH_CHECK(tensors[3].dim() == 2, "LlamaDecoder: the rotary table must be [positions, head_dim]");
    P = tensors[3].size(0);
    // The model's dtype is its embedding's: fp32, or bf16 (matrices streamed as bf16, the small
    // vectors copied to fp32 here: `small`).
    // (quantized: the embedding and the matrices are not in `tensors`; the norms give the dtype)
    const at::ScalarType wt = tensors[quant ? 1 : 0].scalar_type();
    TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16, "LlamaDecoder: the weights must be fp32 or bf16, got ", wt);
    bf16 = !quant && wt == at::kBFloat16;
    tensors.reserve(tensors.size() + 2 + 6 * L);  // the fp32 copies below are kept here too: no reallocation
    auto small = [&](const at::Tensor& t, std::vector<int64_t> shape, const char* what) -> const float* {
      if (t.scalar_type() == at::kFloat) return checked(t, shape, what).data_ptr<float>();
      tensors.push_back(checked(t, shape, what, at::kBFloat16).to(at::kFloat));
      return tensors.back().data_ptr<float>();
    };
    if (quant) {
      qmats.resize(4 * L + 1);  // never resized again: the layers point into it
      qisa = portside_gguf::best_isa();
    } else if (bf16) {
      embed16 = (const uint16_t*)checked(tensors[0], {V, H}, "the embedding", wt).data_ptr();
      lm_head16 = (const uint16_t*)checked(tensors[2], {V, H}, "the LM head", wt).data_ptr();
    } else {
      embed = checked(tensors[0], {V, H}, "the embedding").data_ptr<float>();
      lm_head = checked(tensors[2], {V, H}, "the LM head").data_ptr<float>();
    }
    final_norm = small(tensors[1], {H}, "the final norm");
    cos_sin = small(tensors[3], {P, D}, "the rotary table");
    const int64_t QKV = (NH + 2 * KVH) * D;
    auto bias = [&](const at::Tensor& t, int64_t n, const char* what) -> const float* {
      return t.numel() ? small(t, {n}, what) : nullptr;
    };
    for (int64_t l = 0; l < L; ++l) {
      const int64_t i = 4 + kPerLayer * l;  // not a pointer into `tensors`: `small` appends to it
      if (quant) {
        QMat* q = qmats.data() + 4 * l;
        layersq.push_back({small(tensors[i], {H}, "an input norm"), q, bias(tensors[i + 2], QKV, "a qkv bias"), q + 1,
                           bias(tensors[i + 4], H, "an o bias"), small(tensors[i + 5], {H}, "a post-attention norm"),
                           q + 2, bias(tensors[i + 7], 2 * I, "a gate_up bias"), q + 3,
                           bias(tensors[i + 9], H, "a down bias")});
        continue;
      }
      if (bf16) {
        auto m = [&](int64_t j, std::vector<int64_t> shape, const char* what) {
          return (const uint16_t*)checked(tensors[i + j], shape, what, wt).data_ptr();
        };
        layers16.push_back({small(tensors[i], {H}, "an input norm"), m(1, {QKV, H}, "a qkv projection"),
                            bias(tensors[i + 2], QKV, "a qkv bias"), m(3, {H, NH * D}, "an o projection"),
                            bias(tensors[i + 4], H, "an o bias"), small(tensors[i + 5], {H}, "a post-attention norm"),
                            m(6, {2 * I, H}, "a gate_up projection"), bias(tensors[i + 7], 2 * I, "a gate_up bias"),
                            m(8, {H, I}, "a down projection"), bias(tensors[i + 9], H, "a down bias")});
        continue;
      }
      const at::Tensor* t = &tensors[i];
      layers.push_back({checked(t[0], {H}, "an input norm").data_ptr<float>(),
                        checked(t[1], {QKV, H}, "a qkv projection").data_ptr<float>(), bias(t[2], QKV, "a qkv bias"),
                        checked(t[3], {H, NH * D}, "an o projection").data_ptr<float>(), bias(t[4], H, "an o bias"),
                        checked(t[5], {H}, "a post-attention norm").data_ptr<float>(),
                        checked(t[6], {2 * I, H}, "a gate_up projection").data_ptr<float>(),
                        bias(t[7], 2 * I, "a gate_up bias"), checked(t[8], {H, I}, "a down projection").data_ptr<float>(),
                        bias(t[9], H, "a down bias")});
    }
    h.resize(H), qkv.resize(QKV), attn.resize(NH * D), act.resize(I), y.resize(H);
    hm.resize(kMaxRows * H), ym.resize(kMaxRows * H), qkvm.resize(kMaxRows * QKV), attnm.resize(kMaxRows * NH * D),
        actm.resize(kMaxRows * I);
  }

  std::tuple<at::Tensor, at::Tensor> step(const at::Tensor& ids, const at::Tensor& positions) {
    TORCH_CHECK(!quant, "LlamaDecoder.step: a GGUF-quantized decoder's steps are step_h's (the embedding row given)");
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.numel() == 1, "LlamaDecoder.step: one int64 token id");
    const int64_t token = ids.data_ptr<int64_t>()[0];
    TORCH_CHECK(token >= 0 && token < V, "LlamaDecoder.step: token id ", token, " outside the vocabulary");
    return bf16 ? step_w(layers16, embed16, lm_head16, nullptr, token, positions)
                : step_w(layers, embed, lm_head, nullptr, token, positions);
  }

  // A GGUF-quantized decoder's matrices: `parts` uint8 [rows, row bytes] in GGUF blocks, `meta`
  // four values per part: the matrix (4 l + 0..3: layer l's qkv, o, gate_up, down; 4 L: the LM
  // head), its ggml type (one with a gguf_dot kernel), its first row, its row count. Each matrix's
  // parts come in row order and cover it.
  void set_quantized(std::vector<at::Tensor> parts, std::vector<int64_t> meta) {
    TORCH_CHECK(quant, "LlamaDecoder.set_quantized: the decoder was not built for quantized matrices (dims[7])");
    TORCH_CHECK(meta.size() == 4 * parts.size(), "LlamaDecoder.set_quantized: four values per part");
    const int64_t QS = NH * D, QKV = (NH + 2 * KVH) * D;
    const int64_t rows[4] = {QKV, H, 2 * I, H}, cols[4] = {H, QS, H, I};
    for (QMat& m : qmats) m.parts.clear();
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t m = meta[4 * i], type = meta[4 * i + 1], row0 = meta[4 * i + 2], n = meta[4 * i + 3];
      TORCH_CHECK(m >= 0 && m <= 4 * L, "LlamaDecoder.set_quantized: matrix ", m, " out of range");
      const int64_t N = m == 4 * L ? V : rows[m % 4], K = m == 4 * L ? H : cols[m % 4];
      const auto [block, bb] = portside_gguf::block_shape(type);
      const at::Tensor& t = parts[i];
      TORCH_CHECK(bb > 0, "LlamaDecoder.set_quantized: GGUF type ", type, " has no int8-activation kernel");
      QMat& q = qmats[m];
      const int64_t expect = q.parts.empty() ? 0 : q.parts.back().row0 + q.parts.back().rows;
      TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 2 && t.is_contiguous() &&
                      t.size(0) == n && K % block == 0 && t.size(1) == K / block * bb && row0 == expect && n > 0 &&
                      q.parts.size() < kMaxParts,
                  "LlamaDecoder.set_quantized: part ", i, " of matrix ", m, " is not contiguous uint8 [", n, ", ",
                  K / std::max<int64_t>(block, 1) * bb, "] rows from ", expect, " (or more than ", kMaxParts, " parts)");
      tensors.push_back(t);
      q.parts.push_back({t.data_ptr<uint8_t>(), t.size(1), type, row0, n});
    }
    for (int64_t m = 0; m <= 4 * L; ++m) {
      const int64_t N = m == 4 * L ? V : rows[m % 4];
      TORCH_CHECK(!qmats[m].parts.empty() && qmats[m].parts.back().row0 + qmats[m].parts.back().rows == N,
                  "LlamaDecoder.set_quantized: matrix ", m, " is not covered by its parts (", N, " rows)");
    }
  }

  // A GGUF-quantized model's batch-1 decode step from its embedding row `hidden0` [1, hidden]
  // (fp32; the model's quantized embedding, looked up by the caller): as `step`.
  std::tuple<at::Tensor, at::Tensor> step_h(const at::Tensor& hidden0, const at::Tensor& positions) {
    TORCH_CHECK(quant && !qmats.empty() && !qmats.back().parts.empty(),
                "LlamaDecoder.step_h: a GGUF-quantized decoder with its matrices set (set_quantized)");
    TORCH_CHECK(hidden0.device().is_cpu() && hidden0.scalar_type() == at::kFloat && hidden0.is_contiguous() &&
                    hidden0.numel() == H,
                "LlamaDecoder.step_h: the embedding row must be a contiguous fp32 cpu tensor of ", H, " values");
    return step_w(layersq, (const QMat*)nullptr, &qmats.back(), hidden0.data_ptr<float>(), 0, positions);
  }

  // `step` for matrices of element type W (the members of that type, passed in).
  template <class W>
  // `h0`: the embedding row (quantized models), else `token`'s row of `embed`.
  std::tuple<at::Tensor, at::Tensor> step_w(const std::vector<LayerT<W>>& layers, const W* embed, const W* lm_head,
                                            const float* h0, int64_t token, const at::Tensor& positions) {
    const portside_native::DecodePlan& plan = portside_native::decode_plan();
    TORCH_CHECK(plan.active && plan.lens.size(0) == 1 && plan.slots.size(0) == 1 && (int64_t)plan.caches.size() == L,
                "LlamaDecoder.step: needs the decode plan of a one-sequence decode step (set_decode_step)");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == 1, "LlamaDecoder.step: one int64 position");
    const int64_t pos = positions.data_ptr<int64_t>()[0];
    TORCH_CHECK(pos >= 0 && pos < P, "LlamaDecoder.step: position ", pos, " outside the rotary table");
    const at::Tensor& c0 = plan.caches[0];
    const int64_t num_blocks = c0.size(1), block_size = c0.size(2);
    const bool cache16 = c0.scalar_type() == at::kBFloat16;  // else fp32
    for (const at::Tensor& c : plan.caches)
      TORCH_CHECK(c.scalar_type() == c0.scalar_type() && (cache16 || c.scalar_type() == at::kFloat) && c.dim() == 5 &&
                      c.size(1) == num_blocks && c.size(2) == block_size && c.size(3) == KVH && c.size(4) == D,
                  "LlamaDecoder.step: a KV cache is not fp32 or bf16, or does not fit the model's KV heads and head size");
    const int64_t len = plan.lens.data_ptr<int32_t>()[0], slot = plan.slots.data_ptr<int64_t>()[0];
    const int64_t max_blocks = plan.tables.size(1);
    const int32_t* table = plan.tables.data_ptr<int32_t>();
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "LlamaDecoder.step: seq_len ", len,
                " does not fit its block table");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "LlamaDecoder.step: block id ", table[b],
                  " outside the cache");
    TORCH_CHECK(slot >= 0 && slot < num_blocks * block_size, "LlamaDecoder.step: slot ", slot, " outside the cache");

    const paged::decode_shape sh = {1, NH, KVH, D, num_blocks, block_size, max_blocks, NH * D, D, NH * D, D,
                                    plan.tables.stride(0), scale};
    const int threads = std::max(1, at::get_num_threads());
    // Attention in splits of equal length (merged, flash-decoding): at most SPLIT_TOKENS each, and
    // a multiple of the thread count of them, or one per thread while each keeps >= 16 tokens,
    // so every thread attends about as many tokens.
    int64_t splits = (len + SPLIT_TOKENS - 1) / SPLIT_TOKENS;
    splits = splits < threads ? std::min<int64_t>(threads, (len + 15) / 16) : (splits + threads - 1) / threads * threads;
    const int64_t split_len = (len + splits - 1) / splits;
    splits = (len + split_len - 1) / split_len;  // none empty
    const int64_t part_floats = NH * (D + 2);
    if ((int64_t)parts.size() < splits * part_floats) parts.resize(splits * part_floats);
    // decode_range's scratch; a bf16 cache's (decode_range_q8) converts key and value rows into more
    const int64_t scratch = NH * (SPLIT_TOKENS + 2 * D) + (cache16 ? (1 + Q8_CHUNK) * KVH * D : 0);
    if ((int)mine.size() < threads) mine.resize(threads);
    for (auto& m : mine) m.resize(H + 2 * NH * D + scratch);
    if (quant && (int)qacts.size() < threads) {
      qacts.resize(threads);
      for (QAct& q : qacts) q.gu.resize(2 * I), q.isa = qisa;
    }

    const int64_t matrices = 4 * L + 1;
    if ((int64_t)counters.size() < matrices * threads) counters = std::vector<Counter>(matrices * threads);
    for (int64_t i = 0; i < matrices * threads; ++i) counters[i].next.store(0, std::memory_order_relaxed);
    at::Tensor hidden = at::empty({1, H}, positions.options().dtype(at::kFloat));
    at::Tensor logits = at::empty({1, V}, positions.options().dtype(at::kFloat));
    if (h0) memcpy(h.data(), h0, H * sizeof(float));
    else embed_row(h.data(), embed + token * H, H);
    const float* rope = cos_sin + pos * D;
    const int64_t QS = NH * D, KS = KVH * D, QKV = QS + 2 * KS;

#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
#ifdef PORTSIDE_FUSED_PROFILE
      int64_t last = (int64_t)__rdtsc();
#endif
      float *x = mine[t].data(), *q = x + H, *merged = q + QS, *work = merged + QS;
      QAct* qa = quant ? &qacts[t] : nullptr;  // this thread's quantized matrix inputs
      const int owner = (int)((splits - 1) % n);  // attends the newest split, so writes the new K/V
      for (const LayerT<W>& w : layers) {
        const int64_t l = &w - layers.data();
        void* cache = plan.caches[l].data_ptr();
        // input norm (every thread, its own copy), then this thread's rows of q, k, v
        rms_norm(h.data(), w.in_norm, x, H, eps);
        Counter* c = counters.data() + 4 * l * n;
        const auto xqkv = prep(x, H, w.qkv, qa);
        rows_shared(c, QKV, t, n, [&](int64_t r0, int64_t r1) {
          rows1(xqkv, w.qkv, qkv.data(), H, r0, r1);
          if (w.qkv_b)
            for (int64_t r = r0; r < r1; ++r) qkv[r] += w.qkv_b[r];
        });
        MARK(0);
        prefetch_share(w.o, H, QS, t, n);
#pragma omp barrier
        MARK(1);
        // rotary on q (each thread, its own copy); the new K/V row; this thread's splits
        rotate(qkv.data(), q, NH, D, rope);
        if (t == owner && !cache16) {
          float* c32 = (float*)cache;
          rotate(qkv.data() + QS, c32 + slot * KS, KVH, D, rope);
          memcpy(c32 + num_blocks * block_size * KS + slot * KS, qkv.data() + QS + KS, KS * sizeof(float));
        } else if (t == owner) {  // bf16: rotated into this thread's scratch, then rounded into the cache
          uint16_t* c16 = (uint16_t*)cache;
          rotate(qkv.data() + QS, work, KVH, D, rope);
          for (int64_t i = 0; i < KS; ++i) c16[slot * KS + i] = paged::f32_to_bf16(work[i]);
          const float* v_new = qkv.data() + QS + KS;
          for (int64_t i = 0; i < KS; ++i) c16[(num_blocks * block_size + slot) * KS + i] = paged::f32_to_bf16(v_new[i]);
        }
        for (int64_t s = t; s < splits; s += n) {
          const int64_t t0 = s * split_len, t1 = std::min(len, t0 + split_len);
          float* o_s = splits > 1 ? nullptr : attn.data();
          float* part = splits > 1 ? parts.data() + s * part_floats : nullptr;
          if (cache16)
            paged::decode_range_q8_any(&sh, o_s, part, q, (const uint8_t*)cache, table, t0, t1, work, PS_KV_BF16);
          else
            paged::decode_range_any(&sh, o_s, part, q, (const float*)cache, table, t0, t1, work);
        }
        MARK(2);
#pragma omp barrier
        MARK(3);
        const float* o_in = attn.data();
        if (splits > 1) {  // every thread merges the splits into its own copy: no second barrier
          paged::merge_splits(&sh, merged, parts.data(), splits);
          o_in = merged;
        }
        // this thread's rows of o, added to the residual
        const auto xo = prep(o_in, QS, w.o, qa);
        rows_shared(c + n, H, t, n, [&](int64_t r0, int64_t r1) {
          rows1(xo, w.o, y.data(), QS, r0, r1);
          for (int64_t r = r0; r < r1; ++r) h[r] += y[r] + (w.o_b ? w.o_b[r] : 0.f);
        });
        MARK(4);
        prefetch_gate_up(w.gate_up, I, H, t, n);
#pragma omp barrier
        MARK(5);
        // post-attention norm, then this thread's channels of gate and up (side by side) and SiLU
        rms_norm(h.data(), w.post_norm, x, H, eps);
        const auto xgu = prep(x, H, w.gate_up, qa);
        rows_shared(c + 2 * n, I, t, n, [&](int64_t c0, int64_t c1) {
          gate_up_rows(xgu, w.gate_up, I, H, w.gate_up_b, act.data(), c0, c1, qa);
        });
        MARK(6);
        prefetch_share(w.down, H, I, t, n);
#pragma omp barrier
        MARK(7);
        // this thread's rows of down, added to the residual
        const auto xdown = prep(act.data(), I, w.down, qa);
        rows_shared(c + 3 * n, H, t, n, [&](int64_t r0, int64_t r1) {
          rows1(xdown, w.down, y.data(), I, r0, r1);
          for (int64_t r = r0; r < r1; ++r) h[r] += y[r] + (w.down_b ? w.down_b[r] : 0.f);
        });
        MARK(8);
        if (l + 1 < L) prefetch_share(layers[l + 1].qkv, QKV, H, t, n); else prefetch_share(lm_head, V, H, t, n);
#pragma omp barrier
        MARK(9);
      }
      rms_norm(h.data(), final_norm, x, H, eps);
      if (t == 0) memcpy(hidden.data_ptr<float>(), x, H * sizeof(float));
      float* out = logits.data_ptr<float>();
      const auto xlm = prep(x, H, lm_head, qa);
      rows_shared(counters.data() + 4 * L * n, V, t, n,
                  [&](int64_t r0, int64_t r1) { rows1(xlm, lm_head, out, H, r0, r1); });
      MARK(10);
    }
    return {hidden, logits};
  }

  // One sequence's M = 2..kMaxRows rows at consecutive positions, the last at seq_len - 1, under
  // a one-sequence multi-row plan (set_decode_step with one block table and seq_len and the M
  // rows' slots): hidden [M, hidden] after the final norm; the LM head is `logits`, for the rows
  // the runner samples. Stages as in `step`, each matrix streamed once for all rows (`rows_m`),
  // plus one barrier a layer: every row's K/V is written before any row attends, since row m
  // attends the new rows 0..m as well as the cached prefix (causal, as core's reference does).
  at::Tensor step_rows(const at::Tensor& ids, const at::Tensor& positions) {
    TORCH_CHECK(!quant, "LlamaDecoder.step_rows: not for a GGUF-quantized decoder (batch-1 steps only)");
    return bf16 ? step_rows_w(layers16, embed16, lm_head16, ids, positions)
                : step_rows_w(layers, embed, lm_head, ids, positions);
  }

  // `step_rows` for matrices of element type W (the members of that type, passed in).
  template <class W>
  at::Tensor step_rows_w(const std::vector<LayerT<W>>& layers, const W* embed, const W* lm_head, const at::Tensor& ids,
                         const at::Tensor& positions) {
    const portside_native::DecodePlan& plan = portside_native::decode_plan();
    const int64_t M = ids.numel();
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous() &&
                    positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                    positions.numel() == M && M >= 2 && M <= kMaxRows,
                "LlamaDecoder.step_rows: 2 to ", kMaxRows, " int64 token ids and as many int64 positions");
    TORCH_CHECK(plan.active && plan.lens.size(0) == 1 && plan.slots.size(0) == M && (int64_t)plan.caches.size() == L,
                "LlamaDecoder.step_rows: needs the decode plan of a one-sequence step of ", M,
                " rows (set_decode_step with one seq_len and ", M, " slots)");
    const int64_t* tok = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t len = plan.lens.data_ptr<int32_t>()[0];
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(tok[m] >= 0 && tok[m] < V, "LlamaDecoder.step_rows: token id ", tok[m], " outside the vocabulary");
      TORCH_CHECK(pos[m] == len - M + m, "LlamaDecoder.step_rows: the positions must be the last ", M,
                  " of the sequence's ", len, " (consecutive)");
    }
    TORCH_CHECK(len - 1 < P, "LlamaDecoder.step_rows: position ", len - 1, " outside the rotary table");
    const at::Tensor& c0 = plan.caches[0];
    const int64_t num_blocks = c0.size(1), block_size = c0.size(2);
    const bool cache16 = c0.scalar_type() == at::kBFloat16;  // else fp32
    for (const at::Tensor& c : plan.caches)
      TORCH_CHECK(c.scalar_type() == c0.scalar_type() && (cache16 || c.scalar_type() == at::kFloat) && c.dim() == 5 &&
                      c.size(1) == num_blocks && c.size(2) == block_size && c.size(3) == KVH && c.size(4) == D,
                  "LlamaDecoder.step_rows: a KV cache is not fp32 or bf16, or does not fit the model's KV heads and "
                  "head size");
    const int64_t max_blocks = plan.tables.size(1);
    const int32_t* table = plan.tables.data_ptr<int32_t>();
    TORCH_CHECK(len <= max_blocks * block_size, "LlamaDecoder.step_rows: seq_len ", len, " does not fit its block table");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "LlamaDecoder.step_rows: block id ", table[b],
                  " outside the cache");
    const int64_t* slots = plan.slots.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m)
      TORCH_CHECK(slots[m] >= 0 && slots[m] < num_blocks * block_size, "LlamaDecoder.step_rows: slot ", slots[m],
                  " outside the cache");

    const paged::decode_shape sh = {1, NH, KVH, D, num_blocks, block_size, max_blocks, NH * D, D, NH * D, D,
                                    plan.tables.stride(0), scale};
    const int threads = std::max(1, at::get_num_threads());
    // Attention tasks: (row m, split s). Splits of one length for every row, chosen for the
    // longest row as `step` does; row m (len - M + m + 1 keys) has its own count of them. Task i
    // runs on thread i % threads and writes its own part; every thread then merges all rows.
    int64_t splits = (len + SPLIT_TOKENS - 1) / SPLIT_TOKENS;
    splits = splits < threads ? std::min<int64_t>(threads, (len + 15) / 16) : (splits + threads - 1) / threads * threads;
    const int64_t split_len = (len + splits - 1) / splits;
    int64_t task_start[kMaxRows + 1] = {0};
    for (int64_t m = 0; m < M; ++m) task_start[m + 1] = task_start[m] + (len - M + m + 1 + split_len - 1) / split_len;
    const int64_t tasks = task_start[M];
    const int64_t part_floats = NH * (D + 2);
    if ((int64_t)parts.size() < tasks * part_floats) parts.resize(tasks * part_floats);
    const int64_t QS = NH * D, KS = KVH * D, QKV = QS + 2 * KS;
    const int64_t scratch = NH * (SPLIT_TOKENS + 2 * D) + (cache16 ? (1 + Q8_CHUNK) * KVH * D : 0);
    if ((int)mine.size() < threads) mine.resize(threads);
    for (auto& w : mine)
      if ((int64_t)w.size() < M * (H + 2 * QS) + scratch + 4 * kMaxRows) w.resize(M * (H + 2 * QS) + scratch + 4 * kMaxRows);
    const int64_t matrices = 4 * L;
    if ((int64_t)counters.size() < (matrices + 1) * threads) counters = std::vector<Counter>((matrices + 1) * threads);
    for (int64_t i = 0; i < matrices * threads; ++i) counters[i].next.store(0, std::memory_order_relaxed);

    at::Tensor hidden = at::empty({M, H}, ids.options().dtype(at::kFloat));
    for (int64_t m = 0; m < M; ++m) embed_row(hm.data() + m * H, embed + tok[m] * H, H);
    const float* rope = cos_sin + (len - M) * D;  // row m's cos | sin: rope + m * D
    float *h_all = hm.data(), *y_all = ym.data(), *qkv_all = qkvm.data(), *attn_all = attnm.data(),
          *act_all = actm.data();

#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
#ifdef PORTSIDE_FUSED_PROFILE
      int64_t last = (int64_t)__rdtsc();
#endif
      // this thread's: normed inputs [M, H] | roped queries [M, QS] | attention rows [M, QS] |
      // attention scratch | gate and up of two channels [4, kMaxRows]
      float *x = mine[t].data(), *q = x + M * H, *merged = q + M * QS, *work = merged + M * QS,
            *gu = work + scratch;
      for (const LayerT<W>& w : layers) {
        const int64_t l = &w - layers.data();
        void* cache = plan.caches[l].data_ptr();
        // input norms (every thread, its own copy), then this thread's rows of q, k, v for all rows
        for (int64_t m = 0; m < M; ++m) rms_norm(h_all + m * H, w.in_norm, x + m * H, H, eps);
        Counter* c = counters.data() + 4 * l * n;
        rows_shared(c, QKV, t, n, [&](int64_t r0, int64_t r1) {
          rows_m(x, M, w.qkv, H, QKV, qkv_all, r0, r1);
          if (w.qkv_b)
            for (int64_t m = 0; m < M; ++m)
              for (int64_t r = r0; r < r1; ++r) qkv_all[m * QKV + r] += w.qkv_b[r];
        });
        MARK(11);
        prefetch_share(w.o, H, QS, t, n);
#pragma omp barrier
        MARK(12);
        // rotary on the queries (each thread, its own copy); rows m = t mod n: K/V into their slots
        for (int64_t m = 0; m < M; ++m) rotate(qkv_all + m * QKV, q + m * QS, NH, D, rope + m * D);
        for (int64_t m = t; m < M; m += n) {
          const float* row = qkv_all + m * QKV;
          if (!cache16) {
            float* c32 = (float*)cache;
            rotate(row + QS, c32 + slots[m] * KS, KVH, D, rope + m * D);
            memcpy(c32 + num_blocks * block_size * KS + slots[m] * KS, row + QS + KS, KS * sizeof(float));
          } else {  // bf16: rotated into this thread's scratch, then rounded into the cache
            uint16_t* c16 = (uint16_t*)cache;
            rotate(row + QS, work, KVH, D, rope + m * D);
            for (int64_t i = 0; i < KS; ++i) c16[slots[m] * KS + i] = paged::f32_to_bf16(work[i]);
            for (int64_t i = 0; i < KS; ++i)
              c16[(num_blocks * block_size + slots[m]) * KS + i] = paged::f32_to_bf16(row[QS + KS + i]);
          }
        }
#pragma omp barrier
        // this thread's attention tasks: row m over keys [s * split_len, ...) up to its own position
        for (int64_t m = 0, i = 0; m < M; ++m) {
          const int64_t len_m = len - M + m + 1, count = task_start[m + 1] - task_start[m];
          for (int64_t s = 0; s < count; ++s, ++i) {
            if (i % n != t) continue;
            const int64_t t0 = s * split_len, t1 = std::min(len_m, t0 + split_len);
            float* o_s = count > 1 ? nullptr : attn_all + m * QS;
            float* part = count > 1 ? parts.data() + i * part_floats : nullptr;
            if (cache16)
              paged::decode_range_q8_any(&sh, o_s, part, q + m * QS, (const uint8_t*)cache, table, t0, t1, work,
                                         PS_KV_BF16);
            else
              paged::decode_range_any(&sh, o_s, part, q + m * QS, (const float*)cache, table, t0, t1, work);
          }
        }
        MARK(13);
#pragma omp barrier
        MARK(14);
        // every thread merges each row's splits into its own copy: no second barrier
        for (int64_t m = 0; m < M; ++m) {
          const int64_t count = task_start[m + 1] - task_start[m];
          if (count > 1)
            paged::merge_splits(&sh, merged + m * QS, parts.data() + task_start[m] * part_floats, count);
          else
            memcpy(merged + m * QS, attn_all + m * QS, QS * sizeof(float));
        }
        // this thread's rows of o for all rows, added to the residuals
        rows_shared(c + n, H, t, n, [&](int64_t r0, int64_t r1) {
          rows_m(merged, M, w.o, QS, H, y_all, r0, r1);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t r = r0; r < r1; ++r) h_all[m * H + r] += y_all[m * H + r] + (w.o_b ? w.o_b[r] : 0.f);
        });
        MARK(15);
        prefetch_share(w.gate_up, I, H, t, n);
        prefetch_share(w.gate_up + I * H, I, H, t, n);
#pragma omp barrier
        MARK(16);
        // post-attention norms, then this thread's channels of gate and up (side by side) and SiLU
        for (int64_t m = 0; m < M; ++m) rms_norm(h_all + m * H, w.post_norm, x + m * H, H, eps);
        rows_shared(c + 2 * n, I, t, n, [&](int64_t c0, int64_t c1) {
          for (int64_t ch = c0; ch < c1; ch += 2) {  // two channels: gate ch, ch + 1, then up ch, ch + 1
            const int64_t pair = std::min<int64_t>(2, c1 - ch);
            const W* g = w.gate_up + ch * H;
            const W* u = w.gate_up + (I + ch) * H;
            if (pair == 2) {
              const W* ws[4] = {g, g + H, u, u + H};
              float* ys[4] = {gu, gu + kMaxRows, gu + 2 * kMaxRows, gu + 3 * kMaxRows};
              portside_tile::dots<4>(x, M, ws, H, ys, 1, ch + 4 <= c1 ? 2 * H : 0);
            } else {
              const W* ws[2] = {g, u};
              float* ys[2] = {gu, gu + 2 * kMaxRows};
              portside_tile::dots<2>(x, M, ws, H, ys, 1, 0);
            }
            for (int64_t p = 0; p < pair; ++p) {
              const float bg = w.gate_up_b ? w.gate_up_b[ch + p] : 0.f, bu = w.gate_up_b ? w.gate_up_b[I + ch + p] : 0.f;
              const float *gp = gu + p * kMaxRows, *up = gu + (2 + p) * kMaxRows;
              for (int64_t m = 0; m < M; ++m) act_all[m * I + ch + p] = silu(gp[m] + bg) * (up[m] + bu);
            }
          }
        });
        MARK(17);
        prefetch_share(w.down, H, I, t, n);
#pragma omp barrier
        MARK(18);
        // this thread's rows of down for all rows, added to the residuals
        rows_shared(c + 3 * n, H, t, n, [&](int64_t r0, int64_t r1) {
          rows_m(act_all, M, w.down, I, H, y_all, r0, r1);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t r = r0; r < r1; ++r) h_all[m * H + r] += y_all[m * H + r] + (w.down_b ? w.down_b[r] : 0.f);
        });
        MARK(19);
        if (l + 1 < L) prefetch_share(layers[l + 1].qkv, QKV, H, t, n); else prefetch_share(lm_head, V, H, t, n);
#pragma omp barrier
        MARK(20);
      }
      // the final norms, thread t its rows
      float* out = hidden.data_ptr<float>();
      for (int64_t m = t; m < M; m += n) rms_norm(h_all + m * H, final_norm, out + m * H, H, eps);
      MARK(21);
    }
    return hidden;
  }

  // logits [N, vocab] = LM head of hidden [N, hidden] (rows of a `step_rows` result): the LM head
  // streamed once for all N rows, in one parallel region.
  at::Tensor logits(const at::Tensor& hidden) {
    TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.dim() == 2 &&
                    hidden.size(1) == H,
                "LlamaDecoder.logits: hidden must be fp32 [N, ", H, "]");
    TORCH_CHECK(!quant, "LlamaDecoder.logits: not for a GGUF-quantized decoder (batch-1 steps only)");
    const at::Tensor x = hidden.contiguous();
    const int64_t N = x.size(0);
    at::Tensor out = at::empty({N, V}, x.options());
    if (N == 0) return out;
    const int threads = std::max(1, at::get_num_threads());
    if ((int64_t)counters.size() < threads) counters = std::vector<Counter>(threads);
    for (int i = 0; i < threads; ++i) counters[i].next.store(0, std::memory_order_relaxed);
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      rows_shared(counters.data(), V, t, n, [&](int64_t r0, int64_t r1) {
        if (bf16)
          rows_m(xp, N, lm_head16, H, V, op, r0, r1);
        else
          rows_m(xp, N, lm_head, H, V, op, r0, r1);
      });
    }
    return out;
  }
};

#ifdef PORTSIDE_FUSED_PROFILE
at::Tensor fused_profile() {
  at::Tensor out = at::empty({64, kStages}, at::kLong);
  memcpy(out.data_ptr<int64_t>(), prof, sizeof(prof));
  memset(prof, 0, sizeof(prof));
  return out;
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
#ifdef PORTSIDE_FUSED_PROFILE
  m.def("fused_profile() -> Tensor", &fused_profile);
#endif
  m.class_<LlamaDecoder>("LlamaDecoder")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double, double>())
      .def("step", &LlamaDecoder::step)
      .def("set_quantized", &LlamaDecoder::set_quantized)
      .def("step_h", &LlamaDecoder::step_h)
      .def("step_rows", &LlamaDecoder::step_rows)
      .def("logits", &LlamaDecoder::logits);
}
