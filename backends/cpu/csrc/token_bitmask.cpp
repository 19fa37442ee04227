// Structured output's sampler step as a torch operator:
// portside_cpu_native::apply_token_bitmask(Tensor logits, Tensor bitmask, Tensor rows) -> Tensor
//
// The contract of core's reference (portside.sample.bitmask.apply_token_bitmask): a copy of the
// fp32 logits [N, V] in which, for each i, row rows[i] keeps only the tokens whose bit is set in
// bitmask[i] ([M, W] int32, bit t % 32 of word t // 32), and every token past 32 * W is -inf.
// The reference expands the mask to [M, 32 * W] booleans and scatters them (several passes over
// 32x the mask's bytes); this reads each word once and writes -inf only where a bit is clear,
// skipping all-ones words and filling all-zero ones (most, under a grammar) in one go, one row
// per thread. Other dtypes and layouts are converted first.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

at::Tensor apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && bitmask.dim() == 2 && rows.dim() == 1, "apply_token_bitmask: logits [N, V], bitmask [M, W], rows [M]");
  TORCH_CHECK(bitmask.size(0) == rows.size(0), "apply_token_bitmask: one bitmask row per listed row");
  at::Tensor out = logits.to(at::kFloat).contiguous().clone();
  const at::Tensor bm = bitmask.to(at::kInt).contiguous();
  const at::Tensor idx = rows.to(at::kLong).contiguous();
  const int64_t n = out.size(0), vocab = out.size(1), m = bm.size(0), words = bm.size(1);
  const int64_t* row_ids = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < n, "apply_token_bitmask: row ", row_ids[i], " out of range");
  float* base = out.data_ptr<float>();
  const int32_t* masks = bm.data_ptr<int32_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* dst = base + row_ids[i] * vocab;
      const int32_t* mask = masks + i * words;
      const int64_t covered = std::min<int64_t>(words * 32, vocab);
      for (int64_t w = 0; w * 32 < covered; ++w) {
        const uint32_t word = static_cast<uint32_t>(mask[w]);
        if (word == 0xFFFFFFFFu) continue;
        const int64_t stop = std::min<int64_t>(32, covered - w * 32);
        if (word == 0) {  // the common case under a grammar: nothing in these 32 tokens
          std::fill_n(dst + w * 32, stop, neg_inf);
          continue;
        }
        for (int64_t b = 0; b < stop; ++b)
          if (!((word >> b) & 1u)) dst[w * 32 + b] = neg_inf;
      }
      for (int64_t t = covered; t < vocab; ++t) dst[t] = neg_inf;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("apply_token_bitmask(Tensor logits, Tensor bitmask, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) {
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
