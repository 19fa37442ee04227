// Decode-only paged attention as a torch operator, for the compiled one-step graphs of the cpu
// backend: portside_cpu_native::attention(Tensor q, Tensor k, Tensor v, int layer, float scale,
// int sliding_window=0, float logit_softcap=0.0), the schema of portside_cpu::attention (0: the
// feature is not used).
//
// The compiled graph (cpp_wrapper) calls it through the dispatcher once per layer. In a step
// whose plan was installed on this thread with set_decode_step (every row a decode, native caches:
// see attention_op.forward_context) it writes the new K/V rows and attends with the kernels of
// paged_attention.c (fp32, 8-bit or bf16 caches), compiled into this library: no Python between the layers' kernels. In any
// other step, or for inputs it was not written for, it calls portside_cpu::attention, the Python
// operator that runs the step's attention backend, so it is always correct to call.
//
// Measured on the CI machine (default model, batch-1 decode, 2 threads): the Python path around
// the kernel (dispatch into Python, the backend's checks, two ctypes calls) cost ~12 us a layer
// warm and several times that right after a step's 538 MB weight stream has evicted the caches.

// The C kernels' own headers first, outside the namespace below (their include guards then make
// the includes inside it no-ops).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>  // paged_attention.c's 8-bit loads, outside the namespace below
#endif

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "decode_plan.h"

namespace paged {  // C++ names for the C kernels: no clash with the ctypes build of the same file
#define restrict __restrict__
#define _Thread_local thread_local
#include "paged_attention.c"
#undef restrict
#undef _Thread_local
}  // namespace paged

namespace {

using portside_native::DecodePlan;
using portside_native::decode_plan;

// The kernels' format of a cache (PS_KV_*: fp32, an 8-bit one or bf16), -1 for any other dtype.
int cache_format(const at::Tensor& c) {
  switch (c.scalar_type()) {
    case at::kFloat: return PS_KV_F32;
    case at::kBFloat16: return PS_KV_BF16;
    case at::kChar: return PS_KV_INT8;
    case at::kFloat8_e4m3fn: return PS_KV_E4M3;
    case at::kFloat8_e5m2: return PS_KV_E5M2;
    default: return -1;
  }
}

// Head size of a cache: its last dim, less an int8 row's scale.
int64_t cache_head_size(const at::Tensor& c) { return c.size(4) - (cache_format(c) == PS_KV_INT8 ? 4 : 0); }

void set_decode_step(at::TensorList caches, const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& slots) {
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.stride(1) == 1,
              "set_decode_step: block tables must be int32 [B, n] with dense rows");
  TORCH_CHECK(lens.scalar_type() == at::kInt && lens.dim() == 1 && lens.is_contiguous(),
              "set_decode_step: seq_lens must be contiguous int32 [B]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "set_decode_step: slots must be contiguous int64 [B]");
  // B decodes (one slot each), or one sequence with several new rows (its last slots.size(0)
  // positions: the fused multi-row step, LlamaDecoder.step_rows, fused_decode.cpp)
  TORCH_CHECK(tables.size(0) == lens.size(0) && (slots.size(0) == lens.size(0) || lens.size(0) == 1),
              "set_decode_step: block tables, seq_lens and slots disagree on the batch size");
  for (const at::Tensor& c : caches)
    TORCH_CHECK(c.device().is_cpu() && cache_format(c) >= 0 && c.scalar_type() == caches[0].scalar_type() &&
                    c.dim() == 5 && c.size(0) == 2 && c.is_contiguous(),
                "set_decode_step: every cache must be a contiguous [2, num_blocks, block_size, KVH, row] cpu tensor, "
                "all fp32, all bf16 or all of one 8-bit format (float8_e4m3fn, float8_e5m2, int8)");
  DecodePlan& plan = decode_plan();
  plan.caches.assign(caches.begin(), caches.end());
  plan.tables = tables;
  plan.lens = lens;
  plan.slots = slots;
  plan.active = true;
}

void clear_decode_step() { decode_plan() = DecodePlan(); }

// q [B, H, D], k/v [B, KVH, D], fp32 (or all bf16 over a bf16 cache), each row's heads dense,
// against this layer's cache.
bool fits(const DecodePlan& plan, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer) {
  if (!plan.active || layer < 0 || layer >= (int64_t)plan.caches.size()) return false;
  const at::Tensor& c = plan.caches[layer];
  const int64_t batch = plan.lens.size(0), kvh = c.size(3), d = cache_head_size(c);
  if (plan.slots.size(0) != batch) return false;  // a one-sequence multi-row plan: not a decode step
  const at::ScalarType dt = q.scalar_type();
  if (dt != at::kFloat && !(dt == at::kBFloat16 && c.scalar_type() == at::kBFloat16)) return false;
  for (const at::Tensor* t : {&q, &k, &v})
    if (!t->device().is_cpu() || t->scalar_type() != dt || t->dim() != 3 || t->size(0) != batch ||
        t->size(2) != d || t->stride(2) != 1 || t->stride(1) != d)
      return false;
  return k.size(1) == kvh && v.size(1) == kvh && q.size(1) % kvh == 0;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer, double scale,
                     int64_t sliding_window, double logit_softcap) {
  const DecodePlan& plan = decode_plan();
  if (!fits(plan, q, k, v, layer)) {
    static const auto python_op = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("portside_cpu::attention", "")
                                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        int64_t, double, int64_t, double)>();
    return python_op.call(q, k, v, layer, scale, sliding_window, logit_softcap);
  }
  const at::Tensor& cache = plan.caches[layer];
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t num_blocks = cache.size(1), block_size = cache.size(2), kvh = cache.size(3);
  const int fmt = cache_format(cache);
  void* cp = cache.data_ptr();
  const bool bf16 = q.scalar_type() == at::kBFloat16;  // then k, v and the cache are bf16 too (`fits`)
  int rc;
  if (fmt == PS_KV_F32)
    rc = paged::ps_write_kv_f32((float*)cp, num_blocks * block_size, kvh * d, k.data_ptr<float>(), k.stride(0),
                                v.data_ptr<float>(), v.stride(0), plan.slots.data_ptr<int64_t>(), batch);
  else if (fmt == PS_KV_BF16)
    rc = paged::ps_write_kv_bf16((uint16_t*)cp, num_blocks * block_size, kvh * d, k.data_ptr(), k.stride(0),
                                 v.data_ptr(), v.stride(0), bf16, plan.slots.data_ptr<int64_t>(), batch);
  else
    rc = paged::ps_write_kv_q8((uint8_t*)cp, fmt, num_blocks * block_size, kvh, d, k.data_ptr<float>(), k.stride(0),
                               v.data_ptr<float>(), v.stride(0), plan.slots.data_ptr<int64_t>(), batch);
  TORCH_CHECK(rc == PS_OK, "portside_cpu_native::attention: writing K/V failed (error ", rc, ": a slot outside the cache)");
  // the kernels' output is fp32 (rounded after for a bf16 query); a bf16 query is read as such where
  // the bf16 kernel takes it (paged::bf16_queries), else converted first
  const bool q16 = bf16 && paged::bf16_queries(d);
  const at::Tensor qk = bf16 && !q16 ? q.to(at::kFloat).contiguous() : q;
  at::Tensor out = at::empty({batch, heads, d}, q.options().dtype(at::kFloat));
  rc = paged::paged_decode(out.data_ptr<float>(), qk.data_ptr(), cp, fmt, plan.tables.data_ptr<int32_t>(),
                           plan.lens.data_ptr<int32_t>(), batch, heads, kvh, d, num_blocks, block_size,
                           plan.tables.size(1), qk.stride(0), qk.stride(1), heads * d, d, plan.tables.stride(0),
                           (float)scale, std::max<int64_t>(sliding_window, 0), (float)std::max(logit_softcap, 0.0),
                           at::get_num_threads(), q16, nullptr);  // sinks layers call portside_cpu::attention_sinks
  TORCH_CHECK(rc == PS_OK, "portside_cpu_native::attention: paged decode failed (error ", rc,
              ": a block id or seq_len outside the cache or the block table, or out of memory)");
  return bf16 ? out.to(at::kBFloat16) : out;
}

}  // namespace

portside_native::DecodePlan& portside_native::decode_plan() {
  thread_local DecodePlan plan;
  return plan;
}

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int sliding_window=0, "
        "float logit_softcap=0.0) -> Tensor");
  m.def("set_decode_step(Tensor[] caches, Tensor block_tables, Tensor seq_lens, Tensor slots) -> ()", &set_decode_step);
  m.def("clear_decode_step() -> ()", &clear_decode_step);
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) { m.impl("attention", &attention); }
