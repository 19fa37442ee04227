"""Batched multi-LoRA for cuda/rocm: `portside.ops.lora`'s shrink and expand as one Triton
grouped-GEMM kernel each launch (punica's SGMV idea, written afresh).

The step's tokens grouped by slot come from the mapping (`LoRAMapping.segments`: device tensors,
built once per step, no host sync): slot s owns ``order[starts[s] : starts[s] + counts[s]]``.
The grid is (row tiles, column tiles, slots), bounds from shapes alone; program (m, n, s)
multiplies up to ``BLOCK_M`` of slot s's tokens by a ``BLOCK_N``-column tile of the slot's
weight, and returns at once when slot s has no tokens that far. Then:

- shrink: ``y[t, n] = sum_k x[t, k] * a[s, n, k]`` into a zeroed y (tokens on no adapter stay 0);
- expand: ``out[t, off + n] += sum_r y[t, r] * b[s, n, r]``, the output tile loaded, summed in
  fp32 and stored once. Every (token, column) belongs to one program: no atomics, and the result
  does not depend on timing.

All operands are read through their strides, so y may be a column slice of a wider tensor and
out a wider output (a fused qkv layer expands three times from one shrink). Nothing is read
back to the host, so a CUDA/HIP graph can capture both. fp32 accumulation; under the interpreter
half-precision operands are upcast on load (`LoRALaunch.upcast`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import ArchInfo, LoRALaunch, choose_lora_launch, detect_arch
from portside.contract import LoRAMapping

__all__ = ["lora_shrink", "lora_expand", "TritonLoRAOps"]


@triton.jit
def _lora_gemm_kernel(
    x_ptr,  # [T, K]: shrink x (K = in); expand y (K = R)
    w_ptr,  # [S, N, K]: shrink a; expand b
    c_ptr,  # [T, N]: shrink y; expand the output's columns out[:, off : off + N]
    order_ptr,  # [T] int64: tokens sorted by slot
    starts_ptr,  # [S] int32
    counts_ptr,  # [S] int32
    N,
    K,
    stride_xm,
    stride_xk,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    ADD: tl.constexpr,  # expand: add into c (else store)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_ok, other=0)  # (M,) int64 tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # (M, K)
    w_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # (K, N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_ok = m_ok[:, None] & n_ok[None, :]
    if ADD:
        acc += tl.load(c_ptrs, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_ok)


def _launch(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, mapping: LoRAMapping, add: bool,
            launch: LoRALaunch) -> None:  # fmt: skip
    num_tokens, k = x.shape
    num_slots, n, _ = w.shape
    if num_tokens == 0 or num_slots == 0 or n == 0:
        return
    seg = mapping.segments()
    grid = (triton.cdiv(num_tokens, launch.block_m), triton.cdiv(n, launch.block_n), num_slots)
    _lora_gemm_kernel[grid](
        x,
        w,
        c,
        seg.order,
        seg.starts,
        seg.counts,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        c.stride(0),
        c.stride(1),
        ADD=add,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        PRECISION=launch.input_precision,
        UPCAST=launch.upcast,
        **launch.kernel_options(),
    )


def lora_shrink(x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping, arch: ArchInfo | None = None) -> torch.Tensor:
    """`portside.ops.lora.lora_shrink` in one launch: x [T, in], a [S, R, in] -> y [T, R]."""
    num_tokens, rank = x.shape[0], a.shape[1]
    y = torch.zeros(num_tokens, rank, dtype=x.dtype, device=x.device)
    arch = arch or detect_arch(x.device)
    _launch(x, a, y, mapping, False, choose_lora_launch(arch, num_tokens, a.shape[0], rank, x.shape[1], x.dtype))
    return y


def lora_expand(y: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor, out_offset: int = 0,
                arch: ArchInfo | None = None) -> None:  # fmt: skip
    """`portside.ops.lora.lora_expand` in one launch: out[:, off : off + N] += y @ b[slot].T."""
    n = b.shape[1]
    if out_offset < 0 or out_offset + n > out.shape[1]:
        raise ValueError(f"lora_expand: columns {out_offset}:{out_offset + n} are outside an output of {out.shape[1]}")
    arch = arch or detect_arch(y.device)
    launch = choose_lora_launch(arch, y.shape[0], b.shape[0], n, y.shape[1], y.dtype)
    _launch(y, b, out[:, out_offset : out_offset + n], mapping, True, launch)


class TritonLoRAOps:
    """`ModelOps` mixin: `lora_shrink` / `lora_expand` as the kernel above; operands of mixed
    dtypes go to core's reference (``super()``). The class mixing it in may set ``_arch``."""

    _arch: ArchInfo | None = None

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        if x.dtype != a.dtype:
            return super().lora_shrink(x, a, mapping)  # type: ignore[misc]
        if self._arch is None:
            self._arch = detect_arch(x.device)
        return lora_shrink(x, a, mapping, self._arch)

    def lora_expand(self, y: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor,
                    out_offset: int = 0) -> None:  # fmt: skip
        if y.dtype != b.dtype:
            super().lora_expand(y, b, mapping, out, out_offset)  # type: ignore[misc]
            return
        if self._arch is None:
            self._arch = detect_arch(y.device)
        lora_expand(y, b, mapping, out, out_offset, self._arch)
