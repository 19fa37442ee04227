"""Paged attention for a mixed batch of prefill chunks and decodes, in one launch.

Grid: ``(num_q_programs, num_kv_heads, num_splits)``. A program owns ``BLOCK_Q`` consecutive
query tokens of one request and all ``GQ`` query heads that share one KV head, i.e. a
``BLOCK_M = BLOCK_Q * GQ_P2`` row tile (row ``m`` = token ``m // GQ_P2``, head ``m % GQ_P2``),
so GQA reads each K/V tile once for the whole group. It walks the request's block table one
KV block (``BLOCK_SIZE`` keys) at a time with an online softmax in fp32.

Request i's programs start at index ``query_start_loc[i] // BLOCK_Q + i`` (a binary search
finds a program's request), so the grid size ``num_tokens // BLOCK_Q + num_reqs`` depends only
on tensor shapes: nothing is read back to the host and the launch can be graph-captured.

Split-KV (flash-decoding): with ``NUM_SPLITS > 1`` each program covers one contiguous slice of
its KV tiles and writes an unnormalised partial output with its running max and sum; a reduce
kernel merges the slices. Maxima are kept in base-2 units (scores are scaled by log2(e)).

Per-layer features (constexpr flags: a layer without them compiles exactly the plain kernel):
``SLIDING_WINDOW`` hides keys at or before ``q_pos - window``, and the KV loop starts at the
first block the tile's earliest query can see (its blocks before are never read);
``SOFTCAP`` maps scores to ``cap * tanh(scores / cap)`` before the mask; ``SINKS`` adds each
head's sink logit (gpt-oss, fp32 [num_heads]) to the softmax's denominator only: after the KV loop
(or in the reduce kernel, over the merged splits), ``l += exp(sink - m)``.

Numerics: every load is upcast to fp32 at once (the interpreter computes bf16 wrongly, and
fp32 accumulation is wanted anyway); outputs are cast on store. Head sizes that are not powers
of two (80, 96) are padded to the next power of two with masks.

fp8 caches (constexpr ``KV_FP8``: 1 = e4m3fn, 2 = e5m2) are passed as uint8 and decoded in
registers by bit moves (`_kv_values`), which every Triton target and the interpreter run; the
values then go through the same fp32 arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import AttentionLaunch, next_power_of_2

__all__ = ["paged_attention"]

_LOG2E = 1.4426950408889634  # log2(e)
KV_FP8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # the kernel's KV_FP8 for an fp8 cache


@triton.jit
def _find_request(query_start_loc_ptr, target, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest request i whose first program index (query_start_loc[i] // BLOCK_Q + i) <= target."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def locate_program(starts_ptr, pid, num_seqs, BLOCK: tl.constexpr):
    """Program `pid` of a grid that gives sequence i the programs from ``starts[i] // BLOCK + i``
    on (`starts_ptr`: [num_seqs + 1] cumulative row counts): its sequence, that sequence's first
    row and length, and which BLOCK-row block of the sequence it owns (past the sequence's end
    for at most one program per sequence, which then has nothing to do)."""
    seq = _find_request(starts_ptr, pid, num_seqs, BLOCK)
    start = tl.load(starts_ptr + seq)
    length = tl.load(starts_ptr + seq + 1) - start
    return seq, start, length, pid - (start // BLOCK + seq)


@triton.jit
def _kv_values(x, KV_FP8: tl.constexpr):
    """Cached K or V as fp32: `x` as loaded, or its fp8 bits (uint8) decoded exactly. e5m2 is the
    high byte of an fp16; e4m3fn's sign stays at the top and its exponent and mantissa sit one
    bit lower, which reads as an fp16 of its value / 256 (subnormals included)."""
    if KV_FP8 == 1:
        b = x.to(tl.uint16)
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    elif KV_FP8 == 2:
        return (x.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0  # the interpreter has no libdevice tanh


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_size]           (NUM_SPLITS == 1)
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_P2] fp32 (NUM_SPLITS > 1)
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    block_tables_ptr,  # [num_reqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    sinks_ptr,  # [num_heads] fp32, times log2(e) (SINKS)
    num_reqs,
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window (SLIDING_WINDOW): a query at p sees keys p - window < k <= p
    cap_log2,  # logit softcap * log2(e) (SOFTCAP)
    scale_over_cap,  # softmax scale / logit softcap (SOFTCAP)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bt,
    GQ: tl.constexpr,  # query heads per KV head
    GQ_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # = BLOCK_M // GQ_P2
    HEAD: tl.constexpr,
    HEAD_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size = keys per tile
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,  # 0: the cache holds the model's dtype; 1: fp8 e4m3fn, 2: e5m2 (as uint8)
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req, q_start, q_len, q_block = locate_program(query_start_loc_ptr, pid_q, num_reqs, BLOCK_Q)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # cached tokens before this request's query tokens

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // GQ_P2  # (M,) token index within the request
    head_in_group = offs_m % GQ_P2
    row_ok = (tok < q_len) & (head_in_group < GQ)
    head = kv_head * GQ + head_in_group  # (M,) query head
    q_pos = context_len + tok  # (M,) absolute position of each row's token
    offs_d = tl.arange(0, HEAD_P2)
    d_ok = offs_d < HEAD

    q_offs = (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (M, D)

    # Keys this tile of queries can see: [kv_start, kv_end), causal for its last token and, with
    # a window, no further back than its first token's window.
    last_tok = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_tok + 1
    kv_start = 0
    if SLIDING_WINDOW:
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
    first_tile = kv_start // BLOCK_SIZE
    num_tiles = tl.cdiv(kv_end, BLOCK_SIZE)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)
    offs_n = tl.arange(0, BLOCK_SIZE)
    for t in range(tile_lo, tile_hi):
        blk = tl.load(block_tables_ptr + req * stride_bt + t).to(tl.int64)
        k_pos = t * BLOCK_SIZE + offs_n  # (N,)
        kv_ok = k_pos < kv_end  # never read stale slots: they may hold NaN
        if SLIDING_WINDOW:
            kv_ok &= k_pos >= kv_start
        base = blk * stride_cb + kv_head * stride_ch
        k = _kv_values(
            tl.load(
                k_cache_ptr + base + offs_n[None, :] * stride_co + offs_d[:, None],
                mask=d_ok[:, None] & kv_ok[None, :],
                other=0,
            ),
            KV_FP8,
        )  # (D, N)
        s = tl.dot(q, k, input_precision=PRECISION)  # (M, N)
        if SOFTCAP:
            s = cap_log2 * _tanh(s * scale_over_cap)
        else:
            s = s * scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        if SLIDING_WINDOW:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _kv_values(
            tl.load(
                v_cache_ptr + base + offs_n[:, None] * stride_co + offs_d[None, :],
                mask=kv_ok[:, None] & d_ok[None, :],
                other=0,
            ),
            KV_FP8,
        )  # (N, D)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        if SINKS:  # the sink's share of the denominator (no value)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
            l_i += tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = (q_start + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        num_heads = tl.num_programs(1) * GQ
        row = ((q_start + tok).to(tl.int64) * num_heads + head) * NUM_SPLITS + split  # (M,)
        tl.store(part_max_ptr + row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + row, l_i, mask=row_ok)
        tl.store(part_out_ptr + row[:, None] * HEAD_P2 + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_P2] fp32
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    part_sum_ptr,
    out_ptr,  # [num_tokens, num_heads, head_size]
    sinks_ptr,  # [num_heads] fp32, times log2(e) (SINKS)
    num_heads,
    stride_ot,
    stride_oh,
    HEAD: tl.constexpr,
    HEAD_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    SINKS: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_P2)
    row = (tok.to(tl.int64) * num_heads + head) * NUM_SPLITS
    m = tl.load(part_max_ptr + row + offs_s, mask=s_ok, other=float("-inf"))  # (S,)
    l = tl.load(part_sum_ptr + row + offs_s, mask=s_ok, other=0.0)
    acc = tl.load(part_out_ptr + (row + offs_s)[:, None] * HEAD_P2 + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m_all = tl.max(m, axis=0)  # finite: some split sees the row's own key
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))  # empty splits weigh nothing
    total = tl.sum(l * w, axis=0)
    if SINKS:
        total += tl.exp2(tl.load(sinks_ptr + head) - m_all)
    out = tl.sum(acc * w[:, None], axis=0) / total  # (D,)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], model dtype or fp8
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    scale: float,
    launch: AttentionLaunch,
    num_splits: int = 1,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of each request's query tokens over its cached sequence (with a
    sliding window, a logit softcap and attention sinks ([num_heads] logits) when given:
    semantics in `portside.attention.reference`)."""
    num_tokens, num_heads, head_size = query.shape
    kv_fp8 = KV_FP8.get(kv_cache.dtype, 0)
    if kv_fp8:
        kv_cache = kv_cache.view(torch.uint8)  # decoded in the kernel (`_kv_values`)
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # (num_blocks, block_size, kvh, D)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert query.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert sliding_window is None or sliding_window >= 1, f"sliding window {sliding_window} must be >= 1"
    assert logit_softcap is None or logit_softcap > 0, f"logit softcap {logit_softcap} must be > 0"
    cap = logit_softcap or 1.0
    if sinks is not None:
        assert sinks.shape == (num_heads,), f"sinks {tuple(sinks.shape)}: one per query head ({num_heads})"
        sinks = (sinks.float() * _LOG2E).contiguous()  # base-2 units, as the kernel keeps its maxima
    group = num_heads // num_kv_heads
    group_p2 = next_power_of_2(group)
    block_m = max(launch.block_m, group_p2)
    block_q = block_m // group_p2
    head_p2 = next_power_of_2(head_size)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, head_p2), dtype=torch.float32, device=query.device)
        part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        part_out,
        part_max,
        part_sum,
        block_tables,
        seq_lens,
        query_start_loc,
        out if sinks is None else sinks,  # unused without SINKS
        num_reqs,
        scale * _LOG2E,
        sliding_window or 0,
        cap * _LOG2E,
        scale / cap,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GQ=group,
        GQ_P2=group_p2,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        HEAD=head_size,
        HEAD_P2=head_p2,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        PRECISION=launch.input_precision,
        SLIDING_WINDOW=sliding_window is not None,
        SOFTCAP=logit_softcap is not None,
        SINKS=sinks is not None,
        KV_FP8=kv_fp8,
        **launch.kernel_options(),
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_max,
            part_sum,
            out,
            out if sinks is None else sinks,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD=head_size,
            HEAD_P2=head_p2,
            NUM_SPLITS=num_splits,
            SPLITS_P2=max(2, next_power_of_2(num_splits)),
            SINKS=sinks is not None,
            num_warps=4,
        )
    return out

