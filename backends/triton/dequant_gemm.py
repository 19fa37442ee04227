"""Weight-only quantized GEMM (the ``"dequant"`` path of `quant`): GPTQ, AWQ, compressed-tensors
W4A16 / W8A16, ``--quantization int8``, FP8 weights with ``act`` None (per channel, or block-wise:
a scale per ``block`` of rows x columns, ``SCALE_ROWS`` rows sharing a scale row) and MXFP4
(e2m1 nibbles decoded arithmetically, e8m0 scale bytes per 32 columns).

`_dequant_gemm_kernel` loads a [BLOCK_N, BLOCK_K] tile of codes (4-bit bytes split into their
two nibbles with `tl.interleave`, low nibble first), subtracts the zero, scales it, rounds it to
x's dtype (the reference's dequantized weight, element for element) and feeds it to `tl.dot`
against x's tile, fp32 accumulation. When a K tile lies inside one group (no ``g_idx``; one
group per row, or a group size that is a multiple of BLOCK_K) each row's scale and zero are one
load; else they are gathered per code, the group read from ``g_idx`` (act order) or
``k // group_size``. FP8 weights on NVIDIA before sm89 are read as bytes (`QuantLaunch.fp8_bytes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import ArchInfo, QuantLaunch, choose_quant_launch, detect_arch
from portside.backends.triton.quant_gemm import (
    QuantWeightT,
    e2m1_to_f32,
    e4m3_bits_to_f32,
    e8m0_to_f32,
    finish,
    gemm_output,
    gemm_tile,
    normalized,
    round_to_bf16,
    store_tile,
)

__all__ = ["dequant_matmul"]


@triton.jit
def _dequant_gemm_kernel(
    x_ptr,  # [M, K] fp16/bf16/fp32, K contiguous
    q_ptr,  # [N, K] uint8 codes (BITS 8), [N, K // 2] (BITS 4) or [N, K] float8_e4m3fn (BITS 0; its bytes: FP8_BYTES)
    s_ptr,  # [N, G] fp32 scales ([ceil(N / SCALE_ROWS), G] block-wise; uint8 e8m0 for MXFP4)
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
    SCALE_ROWS: tl.constexpr = 1,  # weight rows per scale row (block-wise fp8: the block's rows)
    MXFP4: tl.constexpr = False,  # BITS 4 codes are e2m1 values, scales e8m0 bytes
):
    offs_m, offs_n, m_ok, n_ok, pid_k, k_start, k_end = gemm_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    rows_x = offs_m.to(tl.int64) * stride_xm
    rows_q = offs_n.to(tl.int64) * stride_qn

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
        scale_rows = offs_n // SCALE_ROWS
        if SCALE_PER_TILE:  # the tile's columns share one group: a scale (and zero) per row
            g = k0 // group_size
            scale = tl.load(s_ptr + scale_rows * stride_sn + g, mask=n_ok, other=0)[:, None]
            if HAS_ZEROS:
                zero = tl.load(z_ptr + offs_n * stride_zn + g, mask=n_ok, other=0.0)[:, None]
        else:
            if HAS_G_IDX:
                g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
            else:
                g = offs_k // group_size
            nk_ok = n_ok[:, None] & k_ok[None, :]
            scale = tl.load(s_ptr + scale_rows[:, None] * stride_sn + g[None, :], mask=nk_ok, other=0)
            if HAS_ZEROS:
                zero = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :], mask=nk_ok, other=0.0)
        if MXFP4:
            scale = e8m0_to_f32(scale)
            w = e2m1_to_f32(q)
        elif FP8_BYTES:
            w = e4m3_bits_to_f32(q)
        else:
            w = q.to(tl.float32)
        if BITS != 0 and not MXFP4:
            if HAS_ZEROS:
                w = w - zero
            else:
                w = w - ZERO
        # rounded to x's dtype as the reference's dequantized weight is (then upcast: interpreter)
        w = w * scale
        if ROUND_BF16:
            w = round_to_bf16(w)
        else:
            w = w.to(x_ptr.dtype.element_ty)
            if UPCAST:
                w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)

    store_tile(c_ptr, acc, bias_ptr, offs_m, offs_n, m_ok, n_ok, pid_k, stride_cs, stride_cm,
               HAS_BIAS, SPLIT_K, ROUND_BF16)  # fmt: skip


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
    t = normalized(w)
    scales, zeros, g_idx = t["scales"], t["zeros"], t["g_idx"]
    assert scales is not None
    m, k = x.shape
    n = w.out_features
    x = x if x.stride(-1) == 1 else x.contiguous()
    per_tile_group = w.group_size if g_idx is None and scales.shape[-1] > 1 else None
    arch = arch or detect_arch(x.device)
    launch = launch or choose_quant_launch(arch, m, n, k, x.dtype, group_size=per_tile_group)
    scale_per_tile = g_idx is None and (scales.shape[-1] == 1 or w.group_size % launch.block_k == 0)
    c, grid, per, stride_cs, stride_cm = gemm_output(x, n, launch)
    bits = 0 if w.kind == "fp8" else w.bits
    scale_rows = w.block[0] if w.kind == "fp8" and w.block is not None else 1
    fp8_bytes = bits == 0 and launch.fp8_bytes
    qweight = t["qweight"].view(torch.uint8) if fp8_bytes else t["qweight"]
    _dequant_gemm_kernel[grid](
        x, qweight, scales, scales if zeros is None else zeros, scales if g_idx is None else g_idx,
        x if bias is None else bias, c,
        m, n, k, w.group_size, per,
        x.stride(0), qweight.stride(0), scales.stride(0), 0 if zeros is None else zeros.stride(0), stride_cs, stride_cm,
        BITS=bits, ZERO=float(1 << (bits - 1)) if bits else 0.0, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        SCALE_PER_TILE=scale_per_tile, HAS_BIAS=bias is not None, SPLIT_K=grid[2],
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, UPCAST=launch.upcast,
        ROUND_BF16=launch.upcast and x.dtype == torch.bfloat16, FP8_BYTES=fp8_bytes, PRECISION=launch.input_precision,
        SCALE_ROWS=scale_rows, MXFP4=w.kind == "mxfp4", **launch.kernel_options(),
    )  # fmt: skip
    return finish(c, bias, x.dtype)
