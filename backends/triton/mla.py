"""Latent attention (MLA, DeepSeek-V2/V3) for the Triton backend: `TritonLatentAttention`, the
`portside.contract.LatentAttention` methods of `TritonAttentionBackend`, over two kernels.

Cache layout: core's reference, ``[num_blocks, block_size, head_size]`` with ``head_size =
latent_dim + rope_dim`` (one row ``[c_kv, k_pe]`` per token), in the model's dtype or fp8
(e4m3fn, e5m2; cast on write, decoded in the kernel as `paged_attention._kv_values` does).

`_write_latent_kernel`: one program per token copies its row to its slot (slot -1: skipped), so a
write needs no host-side filtering and can be captured.

`_latent_attention_kernel`: the whole step (decodes and prefill chunks, mixed) in one launch, the
grid and request lookup of `paged_attention` (``locate_program``: nothing read back to the host).
A program owns ``BLOCK_Q`` query tokens of one request times ``HEADS`` query heads (a
``BLOCK_M = BLOCK_Q * HEADS`` row tile; the grid's second axis walks groups of HEADS heads) and
walks the request's block table ``BLOCK_N`` rows at a time (the whole cache block under the
interpreter, 16 of it on a GPU, where a [512, N] fp32 tile must fit in registers): each tile of rows
is loaded once for all the program's heads (MQA: the row is every head's key and value), as its
latent part ``[LATENT, N]`` and rotary part ``[ROPE, N]`` (each padded to a power of two with
masks: 512 + 64, 96 + 32, 16 + 8 alike), the scores are ``q_nope . c + q_pe . k_pe`` (two dots),
the online softmax runs in fp32 in base 2, and the values are the same latent tile transposed
(``p @ c^T``). Split-KV for long decodes as in `paged_attention` (partial outputs merged by
``_merge_splits_kernel``). Every load is upcast to fp32 (the interpreter computes bf16 wrongly);
outputs are cast on store.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import MIN_TILE, choose_attention_launch, choose_num_splits, next_power_of_2
from portside.backends.triton.paged_attention import KV_FP8, _kv_values, locate_program
from portside.contract import is_quantized_kv, quantize_kv
from portside.contract.latent import LatentAttention

__all__ = ["TritonLatentAttention", "latent_attention", "write_latent"]

_LOG2E = 1.4426950408889634
MAX_HEADS_PER_PROGRAM = 16  # query heads a program holds (its accumulator is [BLOCK_M, LATENT_P2] fp32)
GPU_BLOCK_N = 16  # rows per tile on a GPU: a [LATENT_P2, 16] fp32 tile stays in registers


@triton.jit
def _write_latent_kernel(
    latent_ptr,  # [num_tokens, head_size]
    cache_ptr,  # [num_blocks, block_size, head_size] (rows contiguous)
    slot_ptr,  # [num_tokens] int64
    stride_lt,
    stride_cb,
    stride_co,
    HEAD: tl.constexpr,
    HEAD_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, HEAD_P2)
    mask = offs < HEAD
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + offs
    tl.store(cache_ptr + dst, tl.load(latent_ptr + tok * stride_lt + offs, mask=mask), mask=mask)  # a plain copy


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store latent [T, head_size] at `slot_mapping` ([T] int64; -1: skip)."""
    num_tokens, head_size = latent.shape
    if num_tokens == 0:
        return
    if is_quantized_kv(cache.dtype):  # fp8: cast here, copy the bytes below
        latent = quantize_kv(latent, cache.dtype).view(torch.uint8)
        cache = cache.view(torch.uint8)
    elif latent.dtype != cache.dtype:
        latent = latent.to(cache.dtype)
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    assert cache.stride(-1) == 1 and cache.shape[-1] == head_size
    _write_latent_kernel[(num_tokens,)](
        latent, cache, slot_mapping, latent.stride(0), cache.stride(0), cache.stride(1),
        HEAD=head_size, HEAD_P2=next_power_of_2(head_size), BLOCK_SIZE=cache.shape[1],
    )  # fmt: skip


@triton.jit
def _latent_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, LATENT + ROPE]
    cache_ptr,  # [num_blocks, block_size, LATENT + ROPE]
    out_ptr,  # [num_tokens, num_heads, LATENT]                      (NUM_SPLITS == 1)
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, LATENT_P2] fp32 (NUM_SPLITS > 1)
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    part_sum_ptr,
    block_tables_ptr,  # [num_reqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_reqs,
    num_heads,
    scale_log2,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_co,
    stride_bt,
    HEADS: tl.constexpr,  # query heads per program (a power of two)
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # = BLOCK_M // HEADS
    LATENT: tl.constexpr,
    LATENT_P2: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # rows per cache block
    BLOCK_N: tl.constexpr,  # rows per tile (divides BLOCK_SIZE)
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    pid_q = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)

    req, q_start, q_len, q_block = locate_program(query_start_loc_ptr, pid_q, num_reqs, BLOCK_Q)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // HEADS  # (M,) token within the request
    head = head_group * HEADS + offs_m % HEADS  # (M,) query head
    row_ok = (tok < q_len) & (head < num_heads)
    q_pos = context_len + tok
    offs_l = tl.arange(0, LATENT_P2)
    l_ok = offs_l < LATENT
    offs_r = tl.arange(0, ROPE_P2)
    r_ok = offs_r < ROPE

    q_row = q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_l[None, :], mask=row_ok[:, None] & l_ok[None, :], other=0.0).to(tl.float32)  # (M, L)
    q_pe = tl.load(q_row + LATENT + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)

    last_tok = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_tok + 1  # rows this tile of queries can see: [0, kv_end)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_P2], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for t in range(tile_lo, tile_hi):
        first = t * BLOCK_N  # the tile's first position
        blk = tl.load(block_tables_ptr + req * stride_bt + first // BLOCK_SIZE).to(tl.int64)
        k_pos = first + offs_n  # (N,)
        kv_ok = k_pos < kv_end  # never read stale slots: they may hold NaN
        rows = cache_ptr + blk * stride_cb + (first % BLOCK_SIZE + offs_n)[None, :] * stride_co  # (1, N)
        c = _kv_values(tl.load(rows + offs_l[:, None], mask=l_ok[:, None] & kv_ok[None, :], other=0), KV_FP8)  # (L, N)
        pe = _kv_values(tl.load(rows + LATENT + offs_r[:, None], mask=r_ok[:, None] & kv_ok[None, :], other=0),
                        KV_FP8)  # (R, N)
        s = tl.dot(q_nope, c, input_precision=PRECISION) + tl.dot(q_pe, pe, input_precision=PRECISION)  # (M, N)
        s = s * scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, tl.trans(c), input_precision=PRECISION)  # (M, L)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_l[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & l_ok[None, :])
    else:
        row = ((q_start + tok).to(tl.int64) * num_heads + head) * NUM_SPLITS + split  # (M,)
        tl.store(part_max_ptr + row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + row, l_i, mask=row_ok)
        tl.store(part_out_ptr + row[:, None] * LATENT_P2 + offs_l[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, LATENT_P2] fp32
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32 (base 2)
    part_sum_ptr,
    out_ptr,  # [num_tokens, num_heads, LATENT]
    num_heads,
    stride_ot,
    stride_oh,
    LATENT: tl.constexpr,
    LATENT_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = offs_s < NUM_SPLITS
    offs_l = tl.arange(0, LATENT_P2)
    row = (tok.to(tl.int64) * num_heads + head) * NUM_SPLITS
    m = tl.load(part_max_ptr + row + offs_s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + row + offs_s, mask=s_ok, other=0.0)
    acc = tl.load(part_out_ptr + (row + offs_s)[:, None] * LATENT_P2 + offs_l[None, :], mask=s_ok[:, None], other=0.0)
    m_all = tl.max(m, axis=0)  # finite: the split holding the row's own key saw it
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))  # empty splits weigh nothing
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_l, out.to(out_ptr.dtype.element_ty), mask=offs_l < LATENT)


def latent_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, latent_dim + rope_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, latent_dim + rope_dim], written already
    out: torch.Tensor,  # [num_tokens, num_heads, latent_dim], written
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    scale: float,
    latent_dim: int,
    launch_precision: str,
    num_splits: int = 1,
    launch_options: dict | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal latent attention of each request's query tokens over its cached rows (one launch,
    plus the merge kernel when `num_splits` > 1). `block_n`: rows per tile, a divisor of the block
    size of at least 16 (None: the whole block)."""
    num_tokens, num_heads, head_size = query.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    kv_fp8 = KV_FP8.get(cache.dtype, 0)
    if kv_fp8:
        cache = cache.view(torch.uint8)
    rope_dim = head_size - latent_dim
    assert query.stride(-1) == 1 and out.stride(-1) == 1 and cache.stride(-1) == 1 and rope_dim >= 0
    heads = min(next_power_of_2(num_heads), MAX_HEADS_PER_PROGRAM)
    block_m = max(MIN_TILE, heads)
    block_q = block_m // heads
    latent_p2 = max(MIN_TILE, next_power_of_2(latent_dim))
    rope_p2 = max(MIN_TILE, next_power_of_2(rope_dim))
    grid = (num_tokens // block_q + num_reqs, triton.cdiv(num_heads, heads), num_splits)
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, latent_p2), dtype=torch.float32, device=query.device)
        part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused
    _latent_attention_kernel[grid](
        query, cache, out, part_out, part_max, part_sum, block_tables, seq_lens, query_start_loc, num_reqs, num_heads,
        scale * _LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1), cache.stride(0),
        cache.stride(1), block_tables.stride(0),
        HEADS=heads, BLOCK_M=block_m, BLOCK_Q=block_q, LATENT=latent_dim, LATENT_P2=latent_p2, ROPE=rope_dim,
        ROPE_P2=rope_p2, BLOCK_SIZE=cache.shape[1], BLOCK_N=block_n or cache.shape[1], NUM_SPLITS=num_splits, PRECISION=launch_precision, KV_FP8=kv_fp8,
        **(launch_options or {}),
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out, part_max, part_sum, out, num_heads, out.stride(0), out.stride(1),
            LATENT=latent_dim, LATENT_P2=latent_p2, NUM_SPLITS=num_splits, SPLITS_P2=max(2, next_power_of_2(num_splits)),
            num_warps=4,
        )  # fmt: skip
    return out


class TritonLatentAttention(LatentAttention):
    """The latent-attention methods of `TritonAttentionBackend` (module docstring). Like its
    `forward`, the kernels read every per-request value from device tensors and size their grids
    from shapes, so a decode batch can be captured (the split count comes from
    ``metadata.max_seq_len``, which a graph runner sets to the model's maximum)."""

    latent_graph_support: ClassVar[bool] = True
    _num_splits: int | None = None  # `TritonAttentionBackend.__init__` may force it
    latent_block_n: int | None = None  # rows per tile (None: chosen per device; tests force the GPU's under the interpreter)

    def write_latent(self, cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_latent(cache, latent, slot_mapping)

    def read_latent(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        flat = cache.view(-1, cache.shape[-1])
        if is_quantized_kv(cache.dtype):  # fp8 has no indexing kernels: index the bytes
            return flat.view(torch.uint8)[slots.long()].view(cache.dtype)
        return flat[slots.long()]

    def latent_attention(self, query, latent, cache, metadata, scale, latent_dim):
        md = metadata
        write_latent(cache, latent, md.slot_mapping)
        query = query if query.stride(-1) == 1 else query.contiguous()
        num_tokens, num_heads, head_size = query.shape
        out = torch.empty(num_tokens, num_heads, latent_dim, dtype=query.dtype, device=query.device)
        if md.query_start_loc_cpu and md.query_start_loc_cpu[-1] < num_tokens:  # padding rows: zeros
            out[md.query_start_loc_cpu[-1] :].zero_()
        arch = self.arch(query.device)  # type: ignore[attr-defined]  (TritonAttentionBackend's)
        launch = choose_attention_launch(arch, head_size, 1, md.max_query_len, query.dtype)
        groups = -(-num_heads // min(next_power_of_2(num_heads), MAX_HEADS_PER_PROGRAM))
        splits = self._num_splits or choose_num_splits(arch, md.num_reqs, groups, md.max_query_len, md.max_seq_len,
                                                       md.block_size)
        options, block_n = launch.kernel_options(), self.latent_block_n
        if arch.vendor != "interpreter":  # [16, LATENT] fp32 accumulator and row tiles: small tiles, few stages
            options = {**options, "num_stages": min(options.get("num_stages", 2), 2), "num_warps": 4}
            block_n = block_n or min(md.block_size, GPU_BLOCK_N)
        return latent_attention(query, cache, out, md.query_start_loc, md.seq_lens, md.block_tables, scale, latent_dim,
                                launch.input_precision, splits, options, block_n)
