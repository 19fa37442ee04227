"""What the two quantized GEMMs (`dequant_gemm`, `scaled_mm`) share.

In Triton: the program's output tile and K slice (`gemm_tile`), the store of a finished tile
(`store_tile`: bias and cast, or an fp32 split-K partial), and the roundings the interpreter
gets wrong, done in fp32 / integer arithmetic (`round_to_bf16`, `round_to_e4m3`, FP8 bytes
to and from fp32 for NVIDIA before sm89, where Triton has no e4m3 type). On the host: the
weight's buffers as the kernels read them (`normalized`), the output and grid of a launch
(`gemm_output`) and the fixed-order split-K sum (`finish`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import QuantLaunch

# `QuantWeight` arguments are typed Any: portside.quant is core, which backends do not import.
QuantWeightT = Any


# --------------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------------


@triton.jit
def gemm_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output rows and columns (with their masks), its K slice [k_start, k_end)
    and that slice's index, for a grid (row tiles, column tiles, K slices)."""
    pid_k = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    return offs_m, offs_n, offs_m < M, offs_n < N, pid_k, k_start, k_end


@triton.jit
def store_tile(
    c_ptr, acc, bias_ptr, offs_m, offs_n, m_ok, n_ok, pid_k, stride_cs, stride_cm,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """Store the fp32 tile `acc`: with one K slice, plus the bias and cast to c's dtype (c [M, N]);
    else as slice pid_k's fp32 partial (c [SPLIT_K, M, N]; `finish` adds the bias)."""
    mn_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ROUND_BF16:
            acc = round_to_bf16(acc)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mn_ok)
    else:
        c_ptrs = c_ptr + pid_k * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc, mask=mn_ok)


# --------------------------------------------------------------------------------------------
# Roundings and FP8 bytes
# --------------------------------------------------------------------------------------------


@triton.jit
def round_to_bf16(v):
    """fp32 v rounded to the nearest bfloat16 (ties to even), kept in fp32: the value a GPU's
    cast gives, where the interpreter's fp32 -> bf16 cast truncates."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_half_even(v):
    """torch.round of fp32 v (ties to even), exact for |v| < 2^23."""
    a = tl.abs(v)
    r = tl.floor(a)
    d = a - r  # exact: r = 0, or a / 2 <= r <= a
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)
    return tl.where(v < 0.0, -r, r)


@triton.jit
def round_to_e4m3(v):
    """fp32 v in [-448, 448] rounded to the nearest float8_e4m3fn value (ties to even), in fp32."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 of 23 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = round_half_even(v * 512.0) * 0.001953125  # below 2^-6 the step is 2^-9
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def e4m3_bits_to_f32(b):
    """float8_e4m3fn bytes (uint8) -> their fp32 values, in integer ops (NaN bytes not handled)."""
    b = b.to(tl.int32)
    exp = (b >> 3) & 0xF
    mant = b & 0x7
    sign = (b & 0x80) << 24
    normal = (sign | ((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    subnormal = mant.to(tl.float32) * 0.001953125  # exponent field 0: mant * 2^-9
    return tl.where(exp == 0, tl.where(sign != 0, -subnormal, subnormal), normal)


@triton.jit
def e2m1_to_f32(code):
    """MXFP4 e2m1 codes (4-bit, sign at bit 3) -> their fp32 values (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # (1 + m / 2) * 2^(e - 1)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def e8m0_to_f32(s):
    """MXFP4 e8m0 scale bytes -> 2^(s - 127) in fp32 (s == 0: the subnormal 2^-127)."""
    b = s.to(tl.int32)
    return tl.where(b == 0, 5.877471754111438e-39, (b << 23).to(tl.float32, bitcast=True))


@triton.jit
def f32_to_e4m3_bits(v):
    """fp32 v, exactly a float8_e4m3fn value, -> that value's byte (int32 in [0, 256))."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 0x7)
    subnormal = (a * 512.0).to(tl.int32)
    return ((bits >> 24) & 0x80) | tl.where(a < 0.015625, subnormal, normal)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def normalized(w: QuantWeightT) -> dict[str, torch.Tensor | None]:
    """The buffers the kernels read, in the canonical layout: fp32 contiguous scales and zeros,
    int32 g_idx, fp32 input_scale. The same tensors when they already are."""

    def as_(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if t is None else t.to(dtype).contiguous()

    return {
        "qweight": w.qweight.contiguous(),
        # mxfp4's scales stay e8m0 bytes (the kernel decodes them; the reference reads them so)
        "scales": w.scales.contiguous() if w.kind == "mxfp4" else as_(w.scales, torch.float32),
        "zeros": as_(w.zeros, torch.float32),
        "g_idx": as_(w.g_idx, torch.int32),
        "input_scale": as_(w.input_scale, torch.float32),
    }


def gemm_output(
    x: torch.Tensor, n: int, launch: QuantLaunch
) -> tuple[torch.Tensor, tuple[int, int, int], int, int, int]:
    """For x [M, K] times an [N, K] weight under `launch`: (c, grid, columns per K slice, c's
    slice and row strides). c is [M, N] in x's dtype with one K slice, else [slices, M, N] fp32
    partials; the K slices each cover a multiple of ``block_k`` columns."""
    m, k = x.shape
    k_tiles = -(-k // launch.block_k)
    per = -(-k_tiles // max(1, launch.split_k)) * launch.block_k
    split = -(-k // per)
    if split == 1:
        c = torch.empty((m, n), dtype=x.dtype, device=x.device)
        stride_cs, stride_cm = 0, c.stride(0)
    else:
        c = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        stride_cs, stride_cm = c.stride(0), c.stride(1)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), split)
    return c, grid, per, stride_cs, stride_cm


def finish(out: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The launch's result: c itself, or its split-K partials summed in a fixed order (no
    atomics), plus the bias, in `dtype`."""
    if out.dim() == 2:
        return out
    y = out.sum(dim=0)
    if bias is not None:
        y += bias.float()
    return y.to(dtype)
