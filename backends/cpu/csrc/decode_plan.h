// The decode plan of the step running on this thread: installed by
// portside_cpu_native::set_decode_step (decode_attention.cpp) around a decode-only step, read by
// the attention operator and by the fused decode step (fused_decode.cpp).

#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace portside_native {

struct DecodePlan {
  std::vector<at::Tensor> caches;  // one [2, num_blocks, block_size, KVH, D] fp32 cache per layer
  at::Tensor tables;               // [B, n] int32, rows dense
  at::Tensor lens;                 // [B] int32
  at::Tensor slots;                // [B] int64
  bool active = false;
};

// This thread's plan (the engine runs one step at a time on its thread).
DecodePlan& decode_plan();

}  // namespace portside_native
