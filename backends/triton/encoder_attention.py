"""Non-causal varlen flash attention for vision encoders (`AttentionBackend.encoder_attention`).

q, k, v are [T, H, D]: the tokens of S sequences back to back, sequence s owning rows
``cu_seqlens[s]:cu_seqlens[s + 1]``; every query attends to every key of its own sequence and
to nothing else. No KV cache, no GQA (the vision towers of LLaVA, SigLIP and Qwen2.5-VL have as
many K/V heads as query heads).

Grid: ``(T // BLOCK_M + S, H)``. A program owns ``BLOCK_M`` consecutive query rows of one
sequence and one head; sequence s's programs start at index ``cu_seqlens[s] // BLOCK_M + s``
(`paged_attention.locate_program` finds a program's sequence, as for paged attention), so the
grid depends only on tensor shapes and nothing is read back to the host. A program walks its
sequence's keys ``BLOCK_N`` at a time, from the sequence's first key to its last (the bound is
the sequence's, not ``max_seqlen``), with an online softmax in base 2; a program past its
sequence's end (at most one per sequence) returns at once.

Numerics as in `paged_attention`: every load is upcast to fp32 (the interpreter computes bf16
dots wrongly, and fp32 accumulation is wanted anyway), fp32 operands use IEEE dots and upcast
half-precision ones tf32 (their products are exact in it), the output is cast on store. Head
sizes that are not powers of two (72, 80) are padded to the next power of two with masks.

A local window (``sliding_window`` W, ModernBERT's local layers: a query sees the keys at most W
positions away) masks the scores by distance and bounds a program's key loop to the keys its
rows can see, ``[first row - W, last row + W]``; a row that sees no key of a step keeps a zero
contribution (its running maximum stays -inf, taken as 0 in the exponentials).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import MIN_TILE, ArchInfo, detect_arch, next_power_of_2
from portside.backends.triton.paged_attention import locate_program

__all__ = ["EncoderLaunch", "choose_encoder_launch", "encoder_attention"]

_LOG2E = 1.4426950408889634  # log2(e)


@dataclass(frozen=True)
class EncoderLaunch:
    """Tiles and compiler hints for one encoder-attention launch."""

    block_m: int  # query rows of one sequence and head per program
    block_n: int  # keys per step of the inner loop
    num_warps: int
    num_stages: int
    input_precision: str  # tl.dot precision: "ieee" for fp32 inputs (and on AMD), else "tf32"

    def kernel_options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def choose_encoder_launch(arch: ArchInfo, head_size: int, max_seqlen: int, dtype: torch.dtype) -> EncoderLaunch:
    """Pick tiles from the longest sequence and the head size. Short sequences (Qwen2.5-VL's
    windows of 16-64 tokens) get row and key tiles no longer than they are, so little of a tile
    is padding; long ones (whole images, hundreds of tokens) get 64 x 64 tiles (NVIDIA; 32-row
    tiles on AMD, whose 64-wide waves already fill the matrix units; 32-key tiles where the head
    is padded to 256, to bound registers)."""
    head_p2 = next_power_of_2(head_size)
    fit = max(MIN_TILE, next_power_of_2(max_seqlen))
    precision = "ieee" if dtype == torch.float32 or arch.is_amd else "tf32"
    if arch.vendor == "interpreter":  # fewer, larger numpy steps are what is fast here
        return EncoderLaunch(min(64, fit), min(64, fit), 4, 1, precision)
    block_m = min(32 if arch.is_amd else 64, fit)
    block_n = min(32 if head_p2 >= 256 else 64, fit)
    num_warps = 8 if head_p2 >= 256 or (block_m >= 64 and head_p2 >= 128) else 4
    num_stages = 2 if arch.is_amd else 3 if arch.capability >= (8, 0) else 2
    return EncoderLaunch(block_m, block_n, num_warps, num_stages, precision)


@triton.jit
def _encoder_attention_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, H, D]
    v_ptr,  # [T, H, D]
    out_ptr,  # [T, H, D]
    cu_seqlens_ptr,  # [S + 1] int32
    num_seqs,
    scale_log2,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    window,  # a local window (HAS_WINDOW): keys at most `window` positions away
    HEAD: tl.constexpr,
    HEAD_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    _, start, seq_len, q_block = locate_program(cu_seqlens_ptr, pid, num_seqs, BLOCK_M)
    if q_block * BLOCK_M >= seq_len:
        return

    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # rows within the sequence
    m_ok = offs_m < seq_len
    offs_d = tl.arange(0, HEAD_P2)
    d_ok = offs_d < HEAD
    rows = (start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # (M, D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    lo, hi = 0, seq_len
    if HAS_WINDOW:  # only the keys some row of the block can see
        lo = tl.maximum(q_block * BLOCK_M - window, 0)
        hi = tl.minimum(q_block * BLOCK_M + BLOCK_M + window, seq_len)
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + offs_n  # (N,) keys within the sequence
        n_ok = keys < hi
        krows = (start + keys).to(tl.int64)
        k = tl.load(
            k_ptr + krows[None, :] * stride_kt + head * stride_kh + offs_d[:, None],
            mask=d_ok[:, None] & n_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # (D, N)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # (M, N)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        if HAS_WINDOW:
            near = tl.abs(offs_m[:, None] - keys[None, :]) <= window
            s = tl.where(near, s, float("-inf"))
        # Without a window the first step holds key 0 of the sequence, so every row's maximum is
        # finite from it on; with one, a row may see no key of a step: its maximum stays -inf
        # (taken as 0 below, so p and alpha are 0, not NaN) until the step that holds its keys.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if HAS_WINDOW:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + krows[:, None] * stride_vt + head * stride_vh + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # (N, D)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    if HAS_WINDOW:  # rows past the sequence's end may have seen nothing (not stored)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


def encoder_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [S + 1] int32, on the tensors' device
    max_seqlen: int,
    scale: float,
    launch: EncoderLaunch | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Bidirectional attention within each sequence, one launch; [T, H, D] in the query's dtype.
    `launch`: the tiles (None: `choose_encoder_launch` for the query's device). `sliding_window`
    W: a query at position p sees the keys at ``|p - k| <= W`` only (ModernBERT's local layers);
    a program then walks only the keys its rows can see."""
    num_tokens, num_heads, head_size = query.shape
    if key.shape != query.shape or value.shape != query.shape:
        raise ValueError(f"encoder attention needs q, k, v of one shape [T, H, D]: {query.shape}, {key.shape}, "
                         f"{value.shape}")  # fmt: skip
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0:
        return out
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    if launch is None:
        launch = choose_encoder_launch(detect_arch(query.device), head_size, max_seqlen, query.dtype)
    grid = (num_tokens // launch.block_m + num_seqs, num_heads)
    _encoder_attention_kernel[grid](
        query,
        key,
        value,
        out,
        cu,
        num_seqs,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        sliding_window or 0,
        HEAD=head_size,
        HEAD_P2=max(MIN_TILE, next_power_of_2(head_size)),
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        PRECISION=launch.input_precision,
        HAS_WINDOW=sliding_window is not None,
        **launch.kernel_options(),
    )
    return out
