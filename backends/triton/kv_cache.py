"""KV-cache write (reshape_and_cache): store each token's key/value at its cache slot.

Cache layout (one layer, the canonical one): ``[2, num_blocks, block_size, num_kv_heads,
head_size]``; slot ``s`` is block ``s // block_size``, offset ``s % block_size``; slot -1 is
padding and is skipped. An fp8 cache (float8_e4m3fn / float8_e5m2) has the same layout: the new
K/V are cast first (saturating, `portside.contract.quantize_kv`, in torch) and the kernel
copies their bytes (uint8 views), so it never handles an fp8 type itself (the interpreter has
none, and older GPUs have no fp8 conversions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import next_power_of_2
from portside.contract import is_quantized_kv, quantize_kv

__all__ = ["write_kv"]


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size] (last dim contiguous)
    v_cache_ptr,
    slot_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides: block, offset-in-block, head
    stride_co,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P2)
    offs_d = tl.arange(0, HEAD_P2)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD)
    src_k = key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = blk * stride_cb + off * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :]
    # Plain copies (no arithmetic), so bf16 passes through the interpreter unchanged.
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value ([num_tokens, num_kv_heads, head_size]) at `slot_mapping` (-1: skip)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if is_quantized_kv(kv_cache.dtype):  # fp8: cast here, copy bytes below
        key = quantize_kv(key, kv_cache.dtype).view(torch.uint8)
        value = quantize_kv(value, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # (num_blocks, block_size, kvh, D) each
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD=head_size,
        HEADS_P2=next_power_of_2(num_kv_heads),
        HEAD_P2=next_power_of_2(head_size),
        BLOCK_SIZE=k_cache.shape[1],
    )
