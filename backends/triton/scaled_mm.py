"""W8A8 quantized GEMM (the ``"scaled_mm"`` path of `quant`): ``act`` "int8" with symmetric
per-channel int8 codes, ``act`` "fp8" with FP8 weights and one scale per channel.

`_quantize_rows_kernel` rounds x per token (scale = amax / qmax, or the static
``input_scale``) the way `quantize_activation` does, then `_scaled_mm_kernel` multiplies the
codes: int8 x int8 -> int32 `tl.dot`; FP8 x FP8 `tl.dot` on NVIDIA sm89+, elsewhere both
operands upcast to fp16 (exact for e4m3); the per-token and per-channel scales are applied to
the tile's product. On NVIDIA before sm89 FP8 activations and weights are read and written as
their bytes (`QuantLaunch.fp8_bytes`). FP8 activations are always rounded to e4m3 in fp32
arithmetic before the (then exact) cast, because the interpreter's fp32 -> fp8 cast mis-rounds
values whose mantissa carries into the exponent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import ArchInfo, QuantLaunch, choose_quant_launch, detect_arch
from portside.backends.triton.quant_gemm import (
    QuantWeightT,
    e4m3_bits_to_f32,
    f32_to_e4m3_bits,
    finish,
    gemm_output,
    gemm_tile,
    normalized,
    round_half_even,
    round_to_e4m3,
    store_tile,
)

__all__ = ["quantize_rows", "scaled_matmul"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


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
    offs_m, offs_n, m_ok, n_ok, pid_k, k_start, k_end = gemm_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    rows_a = offs_m.to(tl.int64) * stride_am
    rows_b = offs_n.to(tl.int64) * stride_bn

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
            a = e4m3_bits_to_f32(a)
            b = e4m3_bits_to_f32(b)
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
    store_tile(c_ptr, out, bias_ptr, offs_m, offs_n, m_ok, n_ok, pid_k, stride_cs, stride_cm,
               HAS_BIAS, SPLIT_K, ROUND_BF16)  # fmt: skip


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
            q = round_half_even(v).to(tl.int8)
        elif FP8_BYTES:
            q = f32_to_e4m3_bits(round_to_e4m3(v)).to(tl.uint8)
        else:
            q = round_to_e4m3(v).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * stride_qm + offs, q, mask=offs < K)


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
    t = normalized(w)
    scales = t["scales"]
    assert scales is not None and w.act in ("int8", "fp8")
    m, k = x.shape
    n = w.out_features
    arch = arch or detect_arch(x.device)
    launch = launch or choose_quant_launch(arch, m, n, k, x.dtype, scaled=w.act)
    fp8_bytes = w.act == "fp8" and launch.fp8_bytes
    a, a_scale = quantize_rows(x, w.act, t["input_scale"], fp8_bytes)
    qweight = t["qweight"].view(torch.uint8) if fp8_bytes else t["qweight"]
    c, grid, per, stride_cs, stride_cm = gemm_output(x, n, launch)  # c in x's dtype
    _scaled_mm_kernel[grid](
        a, a_scale, qweight, scales, x if bias is None else bias, c,
        m, n, k, per, a.stride(0), qweight.stride(0), scales.stride(0), stride_cs, stride_cm,
        INT8=w.act == "int8", OPERAND=launch.operand, FP8_BYTES=fp8_bytes, HAS_BIAS=bias is not None, SPLIT_K=grid[2],
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        ROUND_BF16=launch.upcast and x.dtype == torch.bfloat16, PRECISION=launch.input_precision,
        **launch.kernel_options(),
    )  # fmt: skip
    return finish(c, bias, x.dtype)
