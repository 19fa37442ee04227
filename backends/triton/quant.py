"""Quantized linear layers on cuda and rocm: Triton kernels that read `QuantWeight`'s canonical
layouts (`portside.quant.weight`) as they are, and the `ModelOps` overrides that launch them.

Two paths, chosen per weight by `quant_path` (recorded in ``weight.layout`` at prepare time):

- ``"dequant"``, weight-only (GPTQ, AWQ, compressed-tensors W4A16 / W8A16, ``--quantization int8``,
  FP8 weights with ``act`` None): `_dequant_gemm_kernel` loads a [BLOCK_N, BLOCK_K] tile of codes
  (4-bit bytes split into their two nibbles with `tl.interleave`, low nibble first), subtracts
  the zero, scales it, rounds it to x's dtype (the reference's dequantized weight, element for
  element) and feeds it to `tl.dot` against x's tile, fp32 accumulation. When a K tile lies
  inside one group (no ``g_idx``; one group per row, or a group size that is a multiple of
  BLOCK_K) each row's scale and zero are one load; else they are gathered per code, the group
  read from ``g_idx`` (act order) or ``k // group_size``.
- ``"scaled_mm"``, W8A8 (``act`` "int8" with symmetric per-channel int8 codes, ``act`` "fp8"
  with FP8 weights and one scale per channel): `_quantize_rows_kernel` rounds x per token
  (scale = amax / qmax, or the static ``input_scale``) the way `quantize_activation` does, then
  `_scaled_mm_kernel` multiplies the codes: int8 x int8 -> int32 `tl.dot`; FP8 x FP8 `tl.dot` on
  NVIDIA sm89+, elsewhere both operands upcast to fp16 (exact for e4m3); the per-token and
  per-channel scales are applied to the tile's product.

On NVIDIA before sm89, where Triton has no e4m3 type, FP8 weights and activations are read and
written as their bytes and converted in integer ops (`QuantLaunch.fp8_bytes`).

Both GEMMs serve every M with one kernel and a launch table (`choose_quant_launch`): small M
(decode) gets 16-row tiles, wide K steps and split-K (K cut into `split_k` slices whose fp32
partials are summed in a fixed order: no atomics, the result does not depend on timing); large
M gets 64- or 128-row tiles. Nothing is read back to the host, so a CUDA/HIP graph can capture
the calls. The canonical layouts need no re-lay: an [N, K] row-major weight is the K-contiguous
operand `tl.dot` reads fastest, so `prepare_quantized` only makes the scales and zeros fp32 and
contiguous (the layout `dequantize` already reads) and records the path.

Left to the reference (``super()``): GGUF blocks (llama.cpp's formats), activation roundings the
scaled path does not take (int8 activations with grouped or zero-pointed weights, fp8
activations with integer weights), quantized embeddings, and stacked MoE experts (each expert
routed to goes through `quantized_linear`, so it does reach these kernels). `portside.quant` is
not imported here (backends import only the contract); the weight is duck-typed.

Numerics: fp32 accumulation; int8 products exact in int32. Under the interpreter on CPU tensors
half-precision operands are upcast to fp32 (its bf16 dot is wrong, as in `moe`) and roundings to
bf16 are done in fp32 arithmetic (its fp32 -> bf16 cast truncates). FP8 activations are always
rounded to e4m3 in fp32 arithmetic before the (then exact) cast, because the interpreter's
fp32 -> fp8 cast mis-rounds values whose mantissa carries into the exponent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import ArchInfo, detect_arch
from portside.contract import ModelOps

# The interpreter of Triton before 3.8 asserts on an int8 x int8 -> int32 `tl.dot` (the CI leg's
# pinned 3.7.1 does; 3.9 runs it): there the int8 scaled path upcasts to fp32, which is exact for
# the tested K (127 * 127 * K < 2^24).
INTERPRETER_INT8_DOT = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 8)

__all__ = [
    "QuantLaunch",
    "TritonQuantLayout",
    "TritonQuantOps",
    "choose_quant_launch",
    "dequant_matmul",
    "quant_path",
    "quantize_rows",
    "scaled_matmul",
]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
MAX_SPLIT_K = 8
MIN_K_TILES_PER_SPLIT = 2
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# `QuantWeight` arguments are typed Any: portside.quant is core, which backends do not import.
QuantWeightT = Any


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _dequant_gemm_kernel(
    x_ptr,  # [M, K] fp16/bf16/fp32, K contiguous
    q_ptr,  # [N, K] uint8 codes (BITS 8), [N, K // 2] (BITS 4) or [N, K] float8_e4m3fn (BITS 0; its bytes: FP8_BYTES)
    s_ptr,  # [N, G] fp32 scales
    z_ptr,  # [N, G] fp32 zeros (HAS_ZEROS)
    g_ptr,  # [K] int32 group of each input column (HAS_G_IDX)
    bias_ptr,  # [N] (HAS_BIAS)
    c_ptr,  # SPLIT_K == 1: [M, N] in x's dtype; else [SPLIT_K, M, N] fp32 partials
    M,
    N,
    K,
    group_size,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_cs,
    stride_cm,
    BITS: tl.constexpr,
    ZERO: tl.constexpr,  # the zero of symmetric codes, 2^(BITS-1) (not HAS_ZEROS)
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,  # every K tile lies in one group: one scale (zero) per row
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # round to bf16 in fp32 arithmetic (the interpreter's casts truncate)
    FP8_BYTES: tl.constexpr,  # FP8 weights as uint8, decoded in integer ops (no fp8 type: NVIDIA < sm89)
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_x = offs_m.to(tl.int64) * stride_xm
    rows_q = offs_n.to(tl.int64) * stride_qn
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + rows_x[:, None] + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        if BITS == 4:
            offs_p = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            p_ok = offs_p < k_end // 2
            packed = tl.load(q_ptr + rows_q[:, None] + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0)
            q = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]: column 2j low, 2j + 1 high
        else:
            q = tl.load(q_ptr + rows_q[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALE_PER_TILE:  # the tile's columns share one group: a scale (and zero) per row
            g = k0 // group_size
            scale = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_ok, other=0.0)[:, None]
            if HAS_ZEROS:
                zero = tl.load(z_ptr + offs_n * stride_zn + g, mask=n_ok, other=0.0)[:, None]
        else:
            if HAS_G_IDX:
                g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
            else:
                g = offs_k // group_size
            nk_ok = n_ok[:, None] & k_ok[None, :]
            scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=nk_ok, other=0.0)
            if HAS_ZEROS:
                zero = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :], mask=nk_ok, other=0.0)
        if FP8_BYTES:
            w = _e4m3_bits_to_f32(q)
        else:
            w = q.to(tl.float32)
        if BITS != 0:
            if HAS_ZEROS:
                w = w - zero
            else:
                w = w - ZERO
        # rounded to x's dtype as the reference's dequantized weight is (then upcast: interpreter)
        w = w * scale
        if ROUND_BF16:
            w = _round_to_bf16(w)
        else:
            w = w.to(x_ptr.dtype.element_ty)
            if UPCAST:
                w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)

    mn_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ROUND_BF16:
            acc = _round_to_bf16(acc)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mn_ok)
    else:
        c_ptrs = c_ptr + pid_k * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc, mask=mn_ok)


@triton.jit
def _scaled_mm_kernel(
    a_ptr,  # [M, K] int8 or float8_e4m3fn: the quantized activations
    a_scale_ptr,  # [M] fp32
    b_ptr,  # [N, K] uint8 codes, zero 128 (INT8) or float8_e4m3fn (a_ptr too: their bytes with FP8_BYTES)
    b_scale_ptr,  # [N] fp32 (stride stride_bs)
    bias_ptr,
    c_ptr,  # as in `_dequant_gemm_kernel`
    M,
    N,
    K,
    k_per_split,
    stride_am,
    stride_bn,
    stride_bs,
    stride_cs,
    stride_cm,
    INT8: tl.constexpr,
    OPERAND: tl.constexpr,  # "native" (int8 / fp8 MMA), "fp16" or "fp32" (both operands upcast)
    FP8_BYTES: tl.constexpr,  # FP8 operands as uint8, decoded in integer ops (then OPERAND is an upcast)
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_a = offs_m.to(tl.int64) * stride_am
    rows_b = offs_n.to(tl.int64) * stride_bn
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)

    if INT8 and OPERAND == "native":
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        a = tl.load(a_ptr + rows_a[:, None] + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rows_b[:, None] + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if INT8:
            b = (b.to(tl.int32) - 128).to(tl.int8)
        if FP8_BYTES:
            a = _e4m3_bits_to_f32(a)
            b = _e4m3_bits_to_f32(b)
        if OPERAND == "fp32":
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        elif OPERAND == "fp16":
            a = a.to(tl.float16)
            b = b.to(tl.float16)
        if INT8 and OPERAND == "native":
            acc = tl.dot(a, tl.trans(b), acc)  # exact in int32
        else:
            # a fresh fp32 sum per K tile: sm90's FP8 MMAs accumulate in reduced precision in place
            acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)

    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n * stride_bs, mask=n_ok, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    mn_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ROUND_BF16:
            out = _round_to_bf16(out)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mn_ok)
    else:
        c_ptrs = c_ptr + pid_k * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out, mask=mn_ok)


@triton.jit
def _round_to_bf16(v):
    """fp32 v rounded to the nearest bfloat16 (ties to even), kept in fp32: the value a GPU's
    cast gives, where the interpreter's fp32 -> bf16 cast truncates."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_half_even(v):
    """torch.round of fp32 v (ties to even), exact for |v| < 2^23."""
    a = tl.abs(v)
    r = tl.floor(a)
    d = a - r  # exact: r = 0, or a / 2 <= r <= a
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)
    return tl.where(v < 0.0, -r, r)


@triton.jit
def _round_to_e4m3(v):
    """fp32 v in [-448, 448] rounded to the nearest float8_e4m3fn value (ties to even), in fp32."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 of 23 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = _round_half_even(v * 512.0) * 0.001953125  # below 2^-6 the step is 2^-9
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _e4m3_bits_to_f32(b):
    """float8_e4m3fn bytes (uint8) -> their fp32 values, in integer ops (NaN bytes not handled)."""
    b = b.to(tl.int32)
    exp = (b >> 3) & 0xF
    mant = b & 0x7
    sign = (b & 0x80) << 24
    normal = (sign | ((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    subnormal = mant.to(tl.float32) * 0.001953125  # exponent field 0: mant * 2^-9
    return tl.where(exp == 0, tl.where(sign != 0, -subnormal, subnormal), normal)


@triton.jit
def _f32_to_e4m3_bits(v):
    """fp32 v, exactly a float8_e4m3fn value, -> that value's byte (int32 in [0, 256))."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 0x7)
    subnormal = (a * 512.0).to(tl.int32)
    return ((bits >> 24) & 0x80) | tl.where(a < 0.015625, subnormal, normal)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] int8 or float8_e4m3fn (uint8 bytes of it with FP8_BYTES)
    scale_ptr,  # [M] fp32 out
    static_ptr,  # [1] fp32 (STATIC)
    K,
    stride_xm,
    stride_qm,
    QMAX: tl.constexpr,
    INT8: tl.constexpr,
    STATIC: tl.constexpr,
    FP8_BYTES: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), QMAX), 1e-12)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -QMAX), QMAX)
        if INT8:
            q = _round_half_even(v).to(tl.int8)
        elif FP8_BYTES:
            q = _f32_to_e4m3_bits(_round_to_e4m3(v)).to(tl.uint8)
        else:
            q = _round_to_e4m3(v).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * stride_qm + offs, q, mask=offs < K)


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantLaunch:
    """Tiles, split-K and compiler hints for one quantized GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int  # K slices; > 1 sums fp32 partials after the launch
    num_warps: int
    num_stages: int
    input_precision: str  # tl.dot precision for fp32 operands: "ieee" or "tf32"
    upcast: bool  # interpreter: half-precision x loaded as fp32, bf16 rounding done in fp32
    operand: str = "native"  # scaled path: "native" MMA on the codes, else "fp16" / "fp32" upcast
    fp8_bytes: bool = False  # FP8 tensors read as bytes and decoded in integer ops (NVIDIA < sm89)

    def kernel_options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def _pow2_divisor(n: int) -> int:
    return n & -n


def choose_quant_launch(
    arch: ArchInfo,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    *,
    group_size: int | None = None,
    scaled: str | None = None,
) -> QuantLaunch:
    """Pick tiles for an [m, k] x [k, n] quantized GEMM.

    `group_size`: the K groups of a weight-only weight without g_idx (None: one group per row, or
    act order), so a K tile can be kept inside one group. `scaled`: "int8" / "fp8" for the W8A8
    path. Small M is weight-bandwidth bound: 16-row tiles, the widest K step, and split-K when
    the (M, N) tiles cannot fill the device (twice its SMs). Depends on shapes only.
    """
    precision = "ieee" if dtype == torch.float32 or arch.is_amd else "tf32"
    if arch.vendor == "interpreter":
        bm, bn, bk, warps, stages = (16 if m <= 16 else 32), 32, 32, 4, 1
    elif m <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = (32 if m <= 32 else 64), 64, 64, 4, 4
    elif m <= 256:
        bm, bn, bk, warps, stages = 64, 128, 64, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    if arch.is_amd or (arch.vendor == "nvidia" and arch.capability < (8, 0)):
        stages = 2
    if group_size is not None and group_size < k and group_size % bk:
        step = _pow2_divisor(group_size)  # a K step inside one group keeps the scale per tile
        if step >= 16:
            bk = min(bk, step)
    split = 1
    tiles = -(-m // bm) * -(-n // bn)
    k_tiles = -(-k // bk)
    if m <= 64 and tiles < 2 * arch.num_sms:
        split = max(1, min(MAX_SPLIT_K, -(-2 * arch.num_sms // tiles), k_tiles // MIN_K_TILES_PER_SPLIT))
    fp8_bytes = arch.vendor == "nvidia" and arch.capability < (8, 9)  # triton has no e4m3 type there
    operand = "native"
    if scaled == "fp8" and not (arch.vendor == "nvidia" and arch.capability >= (8, 9)):
        operand = "fp32" if arch.vendor == "interpreter" else "fp16"  # no fp8 MMA (AMD: e4m3fnuz only)
    if scaled == "int8" and arch.vendor == "interpreter" and not INTERPRETER_INT8_DOT:
        operand = "fp32"
    upcast = arch.vendor == "interpreter" and dtype != torch.float32
    return QuantLaunch(bm, bn, bk, split, warps, stages, precision, upcast, operand, fp8_bytes)


def _k_slices(k: int, launch: QuantLaunch) -> tuple[int, int]:
    """(columns per K slice, a multiple of block_k; slices) for `launch.split_k`."""
    k_tiles = -(-k // launch.block_k)
    per = -(-k_tiles // max(1, launch.split_k)) * launch.block_k
    return per, -(-k // per)


def _finish(out: torch.Tensor, split: int, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if split == 1:
        return out
    y = out.sum(dim=0)  # fixed order: no atomics
    if bias is not None:
        y += bias.float()
    return y.to(dtype)


def _output(m: int, n: int, split: int, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if split == 1:
        c = torch.empty((m, n), dtype=x.dtype, device=x.device)
        return c, 0, c.stride(0)
    c = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    return c, c.stride(0), c.stride(1)


# --------------------------------------------------------------------------------------------
# The weight's tensors, as the kernels read them
# --------------------------------------------------------------------------------------------


def quant_path(w: QuantWeightT) -> str | None:
    """"dequant", "scaled_mm", or None (the reference) for a 2-D `QuantWeight`."""
    if w.kind not in ("int", "fp8") or w.qweight.dim() != 2 or w.scales is None:
        return None
    if w.kind == "int" and (w.bits not in (4, 8) or w.qweight.dtype != torch.uint8):
        return None
    if w.kind == "fp8" and w.qweight.dtype != torch.float8_e4m3fn:
        return None
    if w.act is None:
        return "dequant"
    static_ok = w.input_scale is None or w.input_scale.numel() == 1
    per_channel = w.scales.shape[-1] == 1
    if w.act == "int8" and w.kind == "int" and w.bits == 8 and w.zeros is None and w.g_idx is None and per_channel and static_ok:
        return "scaled_mm"
    if w.act == "fp8" and w.kind == "fp8" and per_channel and static_ok:
        return "scaled_mm"
    return None


def _normalized(w: QuantWeightT) -> dict[str, torch.Tensor | None]:
    """The buffers the kernels read, in the canonical layout: fp32 contiguous scales and zeros,
    int32 g_idx, fp32 input_scale. The same tensors when they already are."""
    def as_(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if t is None else t.to(dtype).contiguous()

    return {
        "qweight": w.qweight.contiguous(),
        "scales": as_(w.scales, torch.float32),
        "zeros": as_(w.zeros, torch.float32),
        "g_idx": as_(w.g_idx, torch.int32),
        "input_scale": as_(w.input_scale, torch.float32),
    }


@dataclass(frozen=True)
class TritonQuantLayout:
    """``QuantWeight.layout`` after `TritonQuantOps.prepare_quantized`: the buffers are the
    canonical ones in the dtypes the kernels read (`_normalized`), and `path` says which kernel."""

    path: str  # "dequant" or "scaled_mm"


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def dequant_matmul(
    x: torch.Tensor,
    w: QuantWeightT,
    bias: torch.Tensor | None = None,
    launch: QuantLaunch | None = None,
    arch: ArchInfo | None = None,
) -> torch.Tensor:
    """Weight-only: x [M, K] @ dequantize(w)^T + bias -> [M, N] in x's dtype (activations as they
    are, whatever ``w.act`` says). `launch`: override `choose_quant_launch` for `arch` (default:
    the device's)."""
    t = _normalized(w)
    scales, zeros, g_idx = t["scales"], t["zeros"], t["g_idx"]
    assert scales is not None
    m, k = x.shape
    n = w.out_features
    x = x if x.stride(-1) == 1 else x.contiguous()
    per_tile_group = w.group_size if g_idx is None and scales.shape[-1] > 1 else None
    arch = arch or detect_arch(x.device)
    launch = launch or choose_quant_launch(arch, m, n, k, x.dtype, group_size=per_tile_group)
    per, split = _k_slices(k, launch)
    scale_per_tile = g_idx is None and (scales.shape[-1] == 1 or w.group_size % launch.block_k == 0)
    c, stride_cs, stride_cm = _output(m, n, split, x)
    bits = 0 if w.kind == "fp8" else w.bits
    fp8_bytes = bits == 0 and launch.fp8_bytes
    qweight = t["qweight"].view(torch.uint8) if fp8_bytes else t["qweight"]
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), split)
    _dequant_gemm_kernel[grid](
        x, qweight, scales, scales if zeros is None else zeros, scales if g_idx is None else g_idx,
        x if bias is None else bias, c,
        m, n, k, w.group_size, per,
        x.stride(0), qweight.stride(0), scales.stride(0), 0 if zeros is None else zeros.stride(0), stride_cs, stride_cm,
        BITS=bits, ZERO=float(1 << (bits - 1)) if bits else 0.0, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        SCALE_PER_TILE=scale_per_tile, HAS_BIAS=bias is not None, SPLIT_K=split,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, UPCAST=launch.upcast,
        ROUND_BF16=launch.upcast and x.dtype == torch.bfloat16, FP8_BYTES=fp8_bytes, PRECISION=launch.input_precision,
        **launch.kernel_options(),
    )  # fmt: skip
    return _finish(c, split, bias, x.dtype)


def quantize_rows(
    x: torch.Tensor, mode: str, input_scale: torch.Tensor | None = None, fp8_bytes: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] int8 or float8_e4m3fn, scales [M] fp32): per token, scale =
    amax / qmax (or the static `input_scale`), codes = round(clamp(x / scale)), as
    `portside.quant.weight.quantize_activation` rounds them. `fp8_bytes`: FP8 codes written as
    their uint8 bytes, in integer ops (a `.view(torch.float8_e4m3fn)` of the same values)."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    int8 = mode == "int8"
    q = torch.empty((m, k), dtype=torch.int8 if int8 else torch.uint8 if fp8_bytes else torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    static = None if input_scale is None else input_scale.reshape(1).to(torch.float32)
    if m:
        block_k = min(1024, triton.next_power_of_2(max(k, 16)))
        _quantize_rows_kernel[(m,)](
            x, q, scale, scale if static is None else static, k, x.stride(0), q.stride(0),
            QMAX=127.0 if int8 else FP8_MAX, INT8=int8, STATIC=static is not None, FP8_BYTES=fp8_bytes and not int8,
            BLOCK_K=block_k,
            num_warps=4 if block_k >= 512 else 1,
        )  # fmt: skip
    return q, scale


def scaled_matmul(
    x: torch.Tensor,
    w: QuantWeightT,
    bias: torch.Tensor | None = None,
    launch: QuantLaunch | None = None,
    arch: ArchInfo | None = None,
) -> torch.Tensor:
    """W8A8 (``quant_path(w) == "scaled_mm"``): x [M, K] rounded per token to ``w.act``, times the
    weight's codes, both scales applied -> [M, N] in x's dtype."""
    t = _normalized(w)
    scales = t["scales"]
    assert scales is not None and w.act in ("int8", "fp8")
    m, k = x.shape
    n = w.out_features
    arch = arch or detect_arch(x.device)
    launch = launch or choose_quant_launch(arch, m, n, k, x.dtype, scaled=w.act)
    fp8_bytes = w.act == "fp8" and launch.fp8_bytes
    a, a_scale = quantize_rows(x, w.act, t["input_scale"], fp8_bytes)
    qweight = t["qweight"].view(torch.uint8) if fp8_bytes else t["qweight"]
    per, split = _k_slices(k, launch)
    c, stride_cs, stride_cm = _output(m, n, split, x)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), split)
    _scaled_mm_kernel[grid](
        a, a_scale, qweight, scales, x if bias is None else bias, c,
        m, n, k, per, a.stride(0), qweight.stride(0), scales.stride(0), stride_cs, stride_cm,
        INT8=w.act == "int8", OPERAND=launch.operand, FP8_BYTES=fp8_bytes, HAS_BIAS=bias is not None, SPLIT_K=split,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        ROUND_BF16=launch.upcast and x.dtype == torch.bfloat16, PRECISION=launch.input_precision,
        **launch.kernel_options(),
    )  # fmt: skip
    return _finish(c, split, bias, x.dtype)


# --------------------------------------------------------------------------------------------
# ModelOps
# --------------------------------------------------------------------------------------------


class TritonQuantOps(ModelOps):
    """`ModelOps`' quantized-weight methods on the kernels above (mixed into `TritonModelOps`);
    everything else is ``super()``'s reference."""

    _arch: ArchInfo | None = None  # `TritonModelOps` sets it (tests), else detected on first use

    def prepare_quantized(self, weight: QuantWeightT) -> QuantWeightT:
        """Make the buffers the kernels read fp32 / int32 and contiguous in place (still the
        canonical layout, so the reference reads them too) and record the path. Stacked expert
        weights [E, N, ..] are normalized for their per-expert slices."""
        if weight.kind == "gguf":
            return super().prepare_quantized(weight)
        for name, t in _normalized(weight).items():
            if t is not None and t is not getattr(weight, name):
                setattr(weight, name, t)
        if weight.qweight.dim() == 2 and (path := quant_path(weight)) is not None:
            weight.layout = TritonQuantLayout(path)
        return weight

    def quantized_linear(self, x: torch.Tensor, weight: QuantWeightT, bias: torch.Tensor | None = None) -> torch.Tensor:
        layout = weight.layout
        path = layout.path if isinstance(layout, TritonQuantLayout) else quant_path(weight)
        if path is None or x.dtype not in KERNEL_DTYPES:
            return super().quantized_linear(x, weight, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:
            return x.new_zeros((*lead, weight.out_features))
        if self._arch is None:
            self._arch = detect_arch(x.device)
        y = (scaled_matmul if path == "scaled_mm" else dequant_matmul)(x2, weight, bias, arch=self._arch)
        return y.reshape(*lead, weight.out_features)
