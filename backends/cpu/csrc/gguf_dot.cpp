// GGUF weights times 8-bit activations, as torch operators (quant.py's ``cpu_gguf_act=int8``):
//
//   portside_cpu_native::gguf_dot(Tensor x, Tensor qweight, int ggml_type, Tensor? bias, int isa) -> Tensor
//     y [T, N] = x [T, K] . W^T (+ bias) in x's dtype (fp32 or bf16), W the raw GGUF blocks
//     [N, row_bytes] of Q8_0, Q4_0, Q4_K, Q5_K, Q6_K or IQ4_XS exactly as the file stores them
//     (no repacking).
//   portside_cpu_native::gguf_dot_quantize(Tensor x, int block) -> (Tensor q, Tensor d)
//     the activations as the kernels see them (int8 codes [T, K], fp32 scales [T, K / block]),
//     for the tests against the reference.
//   portside_cpu_native::gguf_dot_isas() -> str: the paths this build can run here, e.g.
//     "scalar,avx2,avx512vnni".
//
// The arithmetic is portside.quant.gguf_dot_ref's (read it first), llama.cpp's vec_dot design:
// x is quantized on the fly per block (Q8_0/Q4_0: blocks of 32 as Q8_0; the 256-value formats:
// blocks of 256 as Q8_K, with sums of the codes per 16), scale = amax / 127, codes = round-half-even(x / scale)
// in [-127, 127]; each weight block's integer dot product with the codes is exact in int32, then
// scaled in fp32 by the weight block's and the activation block's scales. Q4_K's minimums come
// from the activation's per-16 sums (sum_j min_j * sum(x codes of sub-block j)), so its nibbles
// multiply unsigned. Only the fp32 accumulation across blocks differs between the paths (and
// from the reference): a few ulps of the sum of |block terms|.
//
// Files: this one (the operators, the activations' quantization), gguf_dot.h (what the kernels
// share: Ctx, the row driver), gguf_dot_q8.cpp (Q8_0, Q4_0), gguf_dot_k.cpp (Q4_K, Q5_K, Q6_K,
// IQ4_XS; its header says how those differ), gguf_tile.cpp (many token rows, every format, VNNI).
//
// Paths (`isa`: 0 the best here, 1 scalar, 2 AVX2, 3 AVX-512 VNNI; a path not compiled in or not
// on this CPU is refused), each compiled under its own -march=native macros and checked at run
// time against the CPU's flags:
//   - scalar: portable C++, block by block;
//   - AVX2: u8 x s8 pairs with maddubs (Q8_0: |w| times x carrying w's sign, llama.cpp's trick;
//     Q4_0/Q4_K: the unsigned nibbles), madd to int32 lanes (Q4_K: by the sub-block scales);
//   - AVX-512 VNNI: two blocks (64 codes) per zmm; Q8_0/Q4_0 with vpdpbusd on unsigned codes
//     (Q8_0's w ^ 0x80 = w + 128, Q4_0's nibble), the bias (128 resp. 8 times the block's code
//     sum over the lane's 4 codes) preloaded into each int32 lane (`Ctx::lb`, once per call): every
//     lane holds its 4 codes' true signed dot product, so converting the lanes to fp32 and scaling
//     them loses nothing to cancellation (a bias left in the lanes would cost ~10x the rounding);
//     Q4_K/Q5_K with maddubs then vpdpwssd by the sub-block scales; Q6_K the same with each int16
//     pair's -32 offset added first (`Ctx::ps`); IQ4_XS with vpdpbusd on its values + 128 and the
//     bias preloaded as Q8_0's.
//   (with AVX-512 VBMI, Q4_0 takes four blocks per pass: vpermb spreads their code bytes, vpermw
//   their scales; Q4_K/Q5_K's 6-bit scales and minimums are unpacked in a register.)
//   16 or more token rows of any format on this path go to gguf_tile.cpp instead: per thread,
//   16 weight rows at a time regrouped into a tile whose int32 lanes are the rows, 8 token rows a
//   pass (its header says why and how; the arithmetic is the same).
// Decode rows prefetch the weight rows they read next (`prefetch` in gguf_dot.h).
// Rows: one token row (decode) streams the packed weight rows once, 2 or 4 side by side (the
// kernel's DECODE_ROWS), output rows split across threads (at::parallel_for); several token rows:
// per thread, chunks of 32 weight rows (in L2) against all token rows, 4 token rows by 2 or 4
// weight rows per pass (PREFILL_ROWS), so each decoded weight block serves 4 tokens and the
// activations of those 4 stay in L1.

#include "gguf_dot.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

namespace portside_gguf {

namespace {

void quantize_block(const float* xb, int64_t block, int8_t* qb, float* d) {
  float amax = 0.f;
  for (int64_t j = 0; j < block; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float scale = amax / 127.f;
  *d = scale;
  if (amax == 0.f) {
    std::memset(qb, 0, block);
    return;
  }
  for (int64_t j = 0; j < block; ++j) {
    const float v = std::min(std::max(xb[j] / scale, -127.f), 127.f);
    qb[j] = int8_t(std::nearbyint(v));
  }
}

}  // namespace

void quantize_blocks(const float* x, int64_t T, int64_t K, int64_t block, int8_t* q, float* d) {
  at::parallel_for(0, T * (K / block), 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) quantize_block(x + b * block, block, q + b * block, d + b);
  });
}

std::pair<int64_t, int64_t> block_shape(int64_t ggml_type) {
  switch (ggml_type) {
    case GGML_Q8_0: return {32, 34};
    case GGML_Q4_0: return {32, 18};
    case GGML_Q4_K: return {256, 144};
    case GGML_Q5_K: return {256, 176};
    case GGML_Q6_K: return {256, 210};
    case GGML_IQ4_XS: return {256, 136};
  }
  return {0, 0};
}

Ctx quantize_activations(const float* x, int64_t T, int64_t K, int64_t ggml_type, Activations& a, bool parallel,
                         bool codes_only) {
  const int64_t block = block_shape(ggml_type).first;
  a.xq.resize(T * K);
  a.xd.resize(T * (K / block));
  if (parallel) {
    quantize_blocks(x, T, K, block, a.xq.data(), a.xd.data());
  } else {
    for (int64_t b = 0; b < T * (K / block); ++b) quantize_block(x + b * block, block, a.xq.data() + b * block, a.xd.data() + b);
  }
  const int8_t* xq = a.xq.data();
  if (codes_only) return Ctx{nullptr, 0, K, 0, T, xq, a.xd.data(), nullptr, nullptr, nullptr, nullptr, nullptr};
  if (block == 256) {
    a.bs.resize(T * (K / 16));
    for (int64_t i = 0; i < T * (K / 16); ++i) {
      int32_t s = 0;
      for (int j = 0; j < 16; ++j) s += xq[i * 16 + j];
      a.bs[i] = int16_t(s);
    }
  }
  if (ggml_type == GGML_Q6_K) {
    a.ps.resize(T * K / 2);
    for (int64_t i = 0; i < T * K / 2; ++i) a.ps[i] = int16_t(-32 * (int32_t(xq[2 * i]) + xq[2 * i + 1]));
  }
  if (ggml_type == GGML_Q8_0 || ggml_type == GGML_Q4_0 || ggml_type == GGML_IQ4_XS) {
    const int32_t off = ggml_type == GGML_Q4_0 ? 8 : 128;
    a.lb.resize(T * K / 4);
    for (int64_t l = 0; l < T * K / 4; ++l)
      a.lb[l] = -off * (int32_t(xq[4 * l]) + xq[4 * l + 1] + xq[4 * l + 2] + xq[4 * l + 3]);
  }
  if (block == 32) {
    a.xdl.resize(T * K / 4);
    for (int64_t l = 0; l < T * K / 4; ++l) a.xdl[l] = a.xd[l / 8];
  }
  return Ctx{nullptr, 0, K, 0, T, a.xq.data(), a.xd.data(), a.lb.data(), a.xdl.data(), a.bs.data(), a.ps.data(), nullptr};
}

void dot_rows(const Ctx& c, int64_t isa, int64_t ggml_type, int64_t n0, int64_t n1) {
  if (block_shape(ggml_type).first == 32) dot_q8_q4(c, isa, ggml_type == GGML_Q4_0, n0, n1);
  else dot_k(c, isa, ggml_type, n0, n1);
}

namespace {

at::Tensor gguf_dot(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type, const std::optional<at::Tensor>& bias,
                    int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gguf_dot: x must be a 2-D fp32 or bf16 cpu tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1 && qweight.device().is_cpu(),
              "gguf_dot: qweight must be contiguous 2-D bytes on the cpu");
  if (isa == ISA_BEST) isa = best_isa();
  TORCH_CHECK(isa_runs(isa), "gguf_dot: instruction-set path ", isa, " is not built in or not on this CPU");
  const auto [block, bb] = block_shape(ggml_type);
  TORCH_CHECK(bb > 0, "gguf_dot: GGUF type ", ggml_type, " has no kernel (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS)");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t T = xf.size(0), K = xf.size(1), N = qweight.size(0);
  TORCH_CHECK(K % block == 0 && qweight.size(1) == K / block * bb, "gguf_dot: ", K, " input features and rows of ",
              qweight.size(1), " bytes are not whole blocks of type ", ggml_type);
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "gguf_dot: bias must have ", N, " values");
  at::Tensor out = at::empty({T, N}, xf.options());
  if (T > 0 && N > 0) {
    Activations a;
    const bool tiles = tiles_apply(isa, ggml_type, T);
    Ctx c = quantize_activations(xf.data_ptr<float>(), T, K, ggml_type, a, true, tiles);
    c.w = static_cast<const uint8_t*>(qweight.data_ptr());
    c.rb = qweight.size(1);
    c.N = N;
    c.y = out.data_ptr<float>();
    if (tiles) dot_tiles(c, isa, ggml_type);
    else if (block == 32) dot_q8_q4(c, isa, ggml_type == GGML_Q4_0);
    else dot_k(c, isa, ggml_type);
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat).reshape({1, N}));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> gguf_dot_quantize(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && block > 0 && x.size(1) % block == 0,
              "gguf_dot_quantize: x [T, K] on cpu, K a multiple of the block");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t T = xf.size(0), K = xf.size(1);
  at::Tensor q = at::empty({T, K}, xf.options().dtype(at::kChar));
  at::Tensor d = at::empty({T, K / block}, xf.options());
  quantize_blocks(xf.data_ptr<float>(), T, K, block, q.data_ptr<int8_t>(), d.data_ptr<float>());
  return {q, d};
}

std::string gguf_dot_isas() {
  std::string s = "scalar";
  if (isa_runs(ISA_AVX2)) s += ",avx2";
  if (isa_runs(ISA_VNNI)) s += ",avx512vnni";
  return s;
}

}  // namespace
}  // namespace portside_gguf

TORCH_LIBRARY_FRAGMENT(portside_cpu_native, m) {
  m.def("gguf_dot(Tensor x, Tensor qweight, int ggml_type, Tensor? bias, int isa) -> Tensor");
  m.def("gguf_dot_quantize(Tensor x, int block) -> (Tensor, Tensor)");
  m.def("gguf_dot_isas() -> str", &portside_gguf::gguf_dot_isas);
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) {
  m.impl("gguf_dot", &portside_gguf::gguf_dot);
  m.impl("gguf_dot_quantize", &portside_gguf::gguf_dot_quantize);
}
