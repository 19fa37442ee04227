"""Vectorized paged attention in torch for CPUs.

Cache layout (one layer): ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (the
canonical one). Decodes are attended in one batched SDPA call over gathered blocks; each prefill
chunk is one SDPA call over its gathered prefix. GQA folds the query heads of a KV head into the
query-length axis, so K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portside.backend_api import AttentionBackend, AttentionMetadata, GraphCaptureSupport


class CpuAttentionBackend(AttentionBackend):
    name = "torch-sdpa"
    graph_support = GraphCaptureSupport.NEVER

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        _, nb, bs, kvh, d = kv_cache.shape
        flat = kv_cache.view(2, nb * bs, kvh, d)
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def read_kv(self, kv_cache, slots):
        _, nb, bs, kvh, d = kv_cache.shape
        flat = kv_cache.view(2, nb * bs, kvh, d)
        return flat[0, slots.long()], flat[1, slots.long()]

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        out = torch.empty_like(query)
        nd = metadata.num_decode_tokens  # requests [0, nd) are decodes: one query token each
        if nd:
            out[:nd] = _decode(query[:nd], kv_cache, metadata.block_tables[:nd], metadata.seq_lens[:nd],
                               max(metadata.seq_lens_cpu[:nd]), scale)
        qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(nd, len(lens)):
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = _prefill(query[start:end], kv_cache, metadata.block_tables[i], lens[i], scale)
        return out


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `seq_len` tokens of one block table, as (kvh, S, D)."""
    block_size, kvh, d = kv_cache.shape[2:]
    n = (seq_len + block_size - 1) // block_size
    kv = kv_cache[:, block_ids[:n].long()].reshape(2, n * block_size, kvh, d)[:, :seq_len]  # (2, S, kvh, D)
    kv = kv.transpose(1, 2)  # (2, kvh, S, D)
    return kv[0], kv[1]


def _prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """One request's query chunk (the last Q of its seq_len tokens), causal. q: (Q, H, D)."""
    num_q, num_heads, d = q.shape
    k, v = _gather(kv_cache, block_ids, seq_len)  # (kvh, S, D)
    kvh = k.shape[0]
    group = num_heads // kvh
    qg = q.view(num_q, kvh, group, d).permute(1, 2, 0, 3).reshape(kvh, group * num_q, d)  # (kvh, G*Q, D)
    q_pos = torch.arange(seq_len - num_q, seq_len).repeat(group)  # row g*Q + j is query token j
    mask = torch.arange(seq_len).unsqueeze(0) <= q_pos.unsqueeze(1)  # (G*Q, S)
    o = F.scaled_dot_product_attention(qg.to(k.dtype), k, v, attn_mask=mask, scale=scale)  # (kvh, G*Q, D)
    return o.view(kvh, group, num_q, d).permute(2, 0, 1, 3).reshape(num_q, num_heads, d).to(q.dtype)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            max_seq_len: int, scale: float) -> torch.Tensor:
    """A batch of single-token queries. q: (B, H, D); all requests padded to max_seq_len."""
    batch, num_heads, d = q.shape
    block_size, kvh = kv_cache.shape[2], kv_cache.shape[3]
    n = (max_seq_len + block_size - 1) // block_size
    kv = kv_cache[:, block_tables[:, :n].long()]  # (2, B, n, bs, kvh, D)
    kv = kv.reshape(2, batch, n * block_size, kvh, d).transpose(2, 3)  # (2, B, kvh, S, D)
    group = num_heads // kvh
    qg = q.view(batch, kvh, group, d)  # (B, kvh, G, D): the group is the query axis
    mask = torch.arange(n * block_size).unsqueeze(0) < seq_lens.unsqueeze(1)  # (B, S)
    o = F.scaled_dot_product_attention(qg.to(kv.dtype), kv[0], kv[1], attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(batch, num_heads, d).to(q.dtype)
