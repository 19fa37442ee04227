"""Pure-torch paged attention, written for clarity: the oracle every backend is tested against.

Canonical cache layout (one layer): ``[2, num_blocks, block_size, num_kv_heads, head_size]``,
index 0 = keys, 1 = values. Slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
An 8-bit cache (`portside.contract.KV_CACHE_DTYPES`) has the same layout in float8, or, for
int8, ``[2, num_blocks, block_size, num_kv_heads, head_size + 4]``: each row's int8 values, then
its fp32 scale (`quantize_kv`). Values are quantized on write and dequantized on read.

Per-layer attention features (`portside.contract.ATTENTION_FEATURES`), as Hugging Face
computes them:

- ``sliding_window=W``: a query at position p sees keys at positions ``p - W < k <= p``;
- ``logit_softcap=c``: scores become ``c * tanh(scores / c)`` before the mask and the softmax;
- ``sinks=s`` ([num_heads] fp32, gpt-oss): head h's softmax has one more logit, ``s[h]``, whose
  probability is dropped (it adds to the denominator only).

The math that needs no cache layout (`attend`, `attention_through_read_kv`, `encoder_attention`)
is `portside.ops.attention`'s, which the contract's defaults call; it is re-exported here.
"""

from __future__ import annotations

import torch

from portside.contract.attention import AttentionBackend, AttentionMetadata, GraphCaptureSupport
from portside.contract.kv_quant import dequantize_kv, is_quantized_kv, kv_row_bytes, quantize_kv
from portside.ops.attention import attend, attention_through_read_kv, encoder_attention

__all__ = [
    "cache_shape",
    "write_kv",
    "read_kv",
    "paged_attention",
    "ReferenceAttentionBackend",
    # the layout-free math (`portside.ops.attention`), re-exported: every reference at one path
    "attend",
    "attention_through_read_kv",
    "encoder_attention",
]


def cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype | None = None
) -> tuple[int, ...]:
    """The canonical layout's shape; an int8 cache's rows carry their scale (`kv_row_bytes`)."""
    row = head_size if cache_dtype is None or not is_quantized_kv(cache_dtype) else kv_row_bytes(head_size, cache_dtype)
    return (2, num_blocks, block_size, num_kv_heads, row)


def _stored(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """K or V rows as the cache holds them: quantized for an 8-bit cache, else cast."""
    return quantize_kv(x, kv_cache.dtype) if is_quantized_kv(kv_cache.dtype) else x.to(kv_cache.dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache (or rows) as uint8, else as it is: torch before 2.13 cannot index float8
    tensors on the CPU, so the reference moves their bytes."""
    return t.view(torch.uint8) if is_quantized_kv(t.dtype) else t


def _values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows (bytes, for an 8-bit cache of `dtype`) as values: dequantized (fp32) from an
    8-bit cache, else as they are."""
    return dequantize_kv(rows.view(dtype)) if is_quantized_kv(dtype) else rows


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's key/value at its slot (slot -1: padding, skipped)."""
    _, num_blocks, block_size, num_kv_heads, row = kv_cache.shape
    flat = _bytes(kv_cache).view(2, num_blocks * block_size, num_kv_heads, row)
    k, v = _bytes(_stored(key, kv_cache)), _bytes(_stored(value, kv_cache))
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            flat[0, slot] = k[i]
            flat[1, slot] = v[i]


def read_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, num_blocks, block_size, num_kv_heads, row = kv_cache.shape
    flat = _bytes(kv_cache).view(2, num_blocks * block_size, num_kv_heads, row)
    return _values(flat[0, slots.long()], kv_cache.dtype), _values(flat[1, slots.long()], kv_cache.dtype)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    query_start_loc: list[int],  # [num_reqs + 1]
    seq_lens: list[int],  # [num_reqs]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks]
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its whole cached sequence.

    The query tokens of request i are the last ``q_len`` positions of its ``seq_len`` tokens, so
    query token j sits at absolute position ``seq_len - q_len + j`` and sees positions up to it
    (and, with a sliding window, no further back than ``window - 1`` positions).
    Computed in fp32, returned in the query's dtype.
    """
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end == start:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        cache = _bytes(kv_cache)
        k = _values(cache[0, blocks].reshape(-1, num_kv_heads, cache.shape[-1])[:seq_len], kv_cache.dtype)  # (S, kvh, D)
        v = _values(cache[1, blocks].reshape(-1, num_kv_heads, cache.shape[-1])[:seq_len], kv_cache.dtype)
        o = attend(query[start:end], k, v, scale, sliding_window, logit_softcap, sinks)
        out[start:end] = o.to(query.dtype)
    return out


class ReferenceAttentionBackend(AttentionBackend):
    """The reference as a backend: slow, obviously correct. For tests and the conformance kit."""

    name = "reference"
    graph_support = GraphCaptureSupport.NEVER
    features = frozenset({"sliding_window", "logit_softcap", "sinks"})
    kv_cache_dtypes = frozenset({"auto", "fp8_e4m3", "fp8_e5m2", "int8"})

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype | None = None
    ) -> tuple[int, ...]:
        return cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        write_kv(kv_cache, key, value, slot_mapping)

    def read_kv(self, kv_cache, slots):
        return read_kv(kv_cache, slots)

    def forward(
        self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None = None, logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        return paged_attention(
            query, kv_cache, metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_tables, scale,
            sliding_window, logit_softcap, sinks,
        )
