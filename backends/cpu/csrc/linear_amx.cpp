// bf16 linear of a batch of rows on AMX tiles, for the cpu backend's graphs of a batched decode
// step: portside_cpu_native::linear_amx(Tensor x, Tensor weight, Tensor? bias) -> Tensor, and
// linear_amx_supported() -> bool (built with AMX-BF16 here, and the kernel grants the tile state).
//
// A decode step's linears have a few dozen rows: each weight byte is used for so few products
// that the step is bound by streaming the weights, and oneDNN's packed bf16 kernel streams them
// at ~16 GB/s in the default model's step (64 rows, 2 threads, Sapphire Rapids VM) where a plain
// read runs at ~30. Here each weight is repacked once (on its first call, kept while it lives) into
// the tile order the kernel walks: for every 16 output features, the K/32 B tiles of 16 rows of
// (16 features x 2 bf16) pairs, one after another, so each thread streams one contiguous range of
// output features from start to end, prefetched a few tiles ahead. The rows are taken 32 at a time
// against 32 features (2 x 2 accumulator tiles, two A and two B tiles: all 8 tile registers), the
// second group of rows reading the features' tiles again from L1/L2. Products are summed in fp32
// by the tiles, the bias added in fp32 and the result rounded to bf16 once, as torch's bf16
// linear does.
//
// Anything else (another dtype, a 1-D or 3-D input, no AMX) goes to at::linear, so the operator is
// always correct to call; the graph pass that inserts it (gemv_pass.py) does so only for bf16
// linears of graphs whose row count is known to be at most AMX_MAX_ROWS there.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PORTSIDE_LINEAR_AMX 1
#include "amx_tiles.h"
#endif

namespace {

#ifdef PORTSIDE_LINEAR_AMX

using portside_amx::granted;

constexpr int64_t kPrefetchTiles = 32;  // how far ahead the weight stream is prefetched, in 1 KB tiles

// A weight in tile order: [NB][KB][16 rows][16 features][2] bf16, zero-padded to 16 features and
// 32 input channels. `owner` tells a later call whether this is still the same weight.
struct Packed {
  c10::weak_intrusive_ptr<c10::StorageImpl> owner;
  const c10::StorageImpl* impl;
  int64_t N, K;
  at::Tensor tiles;
};

std::mutex cache_mutex;
std::unordered_map<const void*, Packed> cache;

// The tiles of `w` (a reference-counted handle: usable whatever other threads do to the cache).
at::Tensor packed(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  const void* key = w.data_ptr();
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache.find(key);
  if (it != cache.end()) {
    const Packed& p = it->second;
    if (!p.owner.expired() && p.impl == w.storage().unsafeGetStorageImpl() && p.N == N && p.K == K) return p.tiles;
    cache.erase(it);
  }
  for (auto i = cache.begin(); i != cache.end();) i = i->second.owner.expired() ? cache.erase(i) : std::next(i);
  const int64_t NB = (N + 15) / 16, KB = (K + 31) / 32;
  at::Tensor tiles = at::zeros({NB * KB * 512}, w.options().dtype(at::kShort));
  auto* t = reinterpret_cast<uint16_t*>(tiles.data_ptr<int16_t>());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t n = nb * 16; n < std::min(N, nb * 16 + 16); ++n)
        for (int64_t k = 0; k < K; ++k)  // feature n, channel k -> tile (nb, k / 32), row (k % 32) / 2, column n % 16, k % 2
          t[(nb * KB + k / 32) * 512 + (k % 32) / 2 * 32 + (n % 16) * 2 + k % 2] = src[n * K + k];
  });
  Packed p{w.storage().getWeakStorageImpl(), w.storage().unsafeGetStorageImpl(), N, K, tiles};
  return cache.emplace(key, std::move(p)).first->second.tiles;
}

inline void prefetch_tile(const uint16_t* t) {
  const char* p = reinterpret_cast<const char*>(t);
  for (int i = 0; i < 1024; i += 256) _mm_prefetch(p + i, _MM_HINT_T0), _mm_prefetch(p + i + 64, _MM_HINT_T0),
                                      _mm_prefetch(p + i + 128, _MM_HINT_T0), _mm_prefetch(p + i + 192, _MM_HINT_T0);
}

// Accumulator tiles 0 (rows a, features b0), 1 (a, b1), 2 (rows a', b0), 3 (a', b1); A tiles 4, 5;
// B tiles 6, 7. M2 / N2: the second row group / feature block exists.
template <bool M2, bool N2>
inline void block(const uint16_t* xa, int64_t x_stride, const uint16_t* b0, const uint16_t* b1, int64_t KB, bool prefetch) {
  _tile_zero(0);
  if (N2) _tile_zero(1);
  if (M2) _tile_zero(2);
  if (M2 && N2) _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    if (prefetch) {
      prefetch_tile(b0 + (kb + kPrefetchTiles) * 512);
      if (N2) prefetch_tile(b1 + (kb + kPrefetchTiles) * 512);
    }
    _tile_loadd(6, b0 + kb * 512, 64);
    if (N2) _tile_loadd(7, b1 + kb * 512, 64);
    _tile_loadd(4, xa + kb * 32, x_stride * 2);
    if (M2) _tile_loadd(5, xa + 16 * x_stride + kb * 32, x_stride * 2);
    _tile_dpbf16ps(0, 4, 6);
    if (N2) _tile_dpbf16ps(1, 4, 7);
    if (M2) _tile_dpbf16ps(2, 5, 6);
    if (M2 && N2) _tile_dpbf16ps(3, 5, 7);
  }
}

at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const at::Tensor w = packed(weight);
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1), NB = (N + 15) / 16, KB = (K + 31) / 32;
  const int64_t MT = (M + 15) / 16;
  // Rows in tiles of 16 and channels in steps of 32: x as it is when it fits, else a padded copy.
  at::Tensor xa = x;
  if (M % 16 || K % 32 || x.stride(1) != 1) {
    xa = at::zeros({MT * 16, KB * 32}, x.options());
    xa.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(xa.data_ptr<at::BFloat16>());
  const int64_t xs = xa.stride(0);
  const auto* tiles = reinterpret_cast<const uint16_t*>(w.data_ptr<int16_t>());
  at::Tensor out = at::empty({M, N}, x.options());
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  // Each thread a contiguous range of feature-block pairs (the weight streamed once, in order).
  at::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    portside_amx::configure_16x64();
    alignas(64) float c[4][16][16];
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t nb = pair * 2;
      const bool n2 = nb + 1 < NB;
      const uint16_t* b0 = tiles + nb * KB * 512;
      const uint16_t* b1 = b0 + KB * 512;
      for (int64_t mt = 0; mt < MT; mt += 2) {
        const bool m2 = mt + 1 < MT, first = mt == 0;
        const uint16_t* xr = xp + mt * 16 * xs;
        if (m2 && n2) block<true, true>(xr, xs, b0, b1, KB, first);
        else if (m2) block<true, false>(xr, xs, b0, b1, KB, first);
        else if (n2) block<false, true>(xr, xs, b0, b1, KB, first);
        else block<false, false>(xr, xs, b0, b1, KB, first);
        _tile_stored(0, c[0], 64);
        if (n2) _tile_stored(1, c[1], 64);
        if (m2) _tile_stored(2, c[2], 64);
        if (m2 && n2) _tile_stored(3, c[3], 64);
        for (int g = 0; g < 4; ++g) {
          const int64_t m0 = (mt + g / 2) * 16, n0 = (nb + g % 2) * 16;
          if (m0 >= M || n0 >= N || (g / 2 && !m2) || (g % 2 && !n2)) continue;
          const int64_t cols = std::min<int64_t>(16, N - n0);
          const __mmask16 mask = (__mmask16)((1u << cols) - 1);
          const __m512 bv = bp ? _mm512_maskz_loadu_ps(mask, bp + n0) : _mm512_setzero_ps();
          for (int64_t r = 0; r < 16 && m0 + r < M; ++r) {
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c[g][r]), bv));
            _mm256_mask_storeu_epi16(yp + (m0 + r) * N + n0, mask, (__m256i)v);
          }
        }
      }
    }
    _tile_release();
  });
  return out;
}

#endif  // PORTSIDE_LINEAR_AMX

bool supported() {
#ifdef PORTSIDE_LINEAR_AMX
  return granted();
#else
  return false;
#endif
}

at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
#ifdef PORTSIDE_LINEAR_AMX
  const bool fits = x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                    x.dim() == 2 && x.size(0) > 0 && weight.dim() == 2 && weight.is_contiguous() &&
                    x.size(1) == weight.size(1) && weight.size(0) > 0 &&
                    (!bias.has_value() || bias->numel() == weight.size(0)) && granted();
  if (fits) return linear_tiles(x, weight, bias);
#endif
  return at::linear(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("linear_amx(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_amx_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) { m.impl("linear_amx", &linear_amx); }
