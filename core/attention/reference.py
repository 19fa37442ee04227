"""Pure-torch paged attention, written for clarity: the oracle every backend is tested against.

Canonical cache layout (one layer): ``[2, num_blocks, block_size, num_kv_heads, head_size]``,
index 0 = keys, 1 = values. Slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

import torch

from portside.backend_api import AttentionBackend, AttentionMetadata, GraphCaptureSupport


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's key/value at its slot (slot -1: padding, skipped)."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            flat[0, slot] = key[i]
            flat[1, slot] = value[i]


def read_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    return flat[0, slots.long()], flat[1, slots.long()]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    query_start_loc: list[int],  # [num_reqs + 1]
    seq_lens: list[int],  # [num_reqs]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks]
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its whole cached sequence.

    The query tokens of request i are the last ``q_len`` positions of its ``seq_len`` tokens, so
    query token j sits at absolute position ``seq_len - q_len + j`` and sees positions up to it.
    Computed in fp32, returned in the query's dtype.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads  # query heads per KV head (GQA)
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, kv_cache.shape[-1])[:seq_len]  # (S, kvh, D)
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, kv_cache.shape[-1])[:seq_len]
        k = k.float().repeat_interleave(group, dim=1)  # (S, H, D)
        v = v.float().repeat_interleave(group, dim=1)
        q = query[start:end].float()  # (Q, H, D)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # (H, Q, S)
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)  # (Q, 1)
        k_pos = torch.arange(seq_len).unsqueeze(0)  # (1, S)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


class ReferenceAttentionBackend(AttentionBackend):
    """The reference as a backend: slow, obviously correct. For tests and the conformance kit."""

    name = "reference"
    graph_support = GraphCaptureSupport.NEVER

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        write_kv(kv_cache, key, value, slot_mapping)

    def read_kv(self, kv_cache, slots):
        return read_kv(kv_cache, slots)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        return paged_attention(
            query, kv_cache, metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_tables, scale
        )
