"""Latent attention (MLA, DeepSeek-V2/V3) for CPUs: `CpuLatentAttention`, the
`portside.contract.LatentAttention` methods of the cpu attention backends.

The cache keeps the reference layout ``[num_blocks, block_size, head_size]`` (one row
``[c_kv, k_pe]`` per token), so `latent_cache_shape` and `read_latent` are core's; a write is one
`index_copy_` of the rows with a slot (no boolean-mask indexing).

`latent_attention` splits the step as the reference does, decodes first:

- decodes: in the native backend (`NativeAttentionBackend`), once its library is built, one call
  of ``portside_cpu_native::mla_decode`` (`csrc/mla.cpp`) for all of them: each sequence's rows
  are read once from the paged cache for all heads (bf16 widened to fp32 in registers; with
  AVX512-BF16 the scores of bf16 queries by vdpbf16ps), the heads in the vector lanes, an online
  softmax, long sequences split over the threads. Otherwise (`CpuAttentionBackend`, a build
  pending, another dtype) batched torch: the decodes' blocks gathered in one `index_select`, two
  batched matmuls in fp32 around a masked softmax.
- prefill chunks: batched torch, one request at a time: its rows gathered once, its query heads
  folded into the query axis (MQA: one row serves every head), SDPA with a causal mask by token
  position, one call per block of 2048 query rows over the rows the block sees (a long prompt
  skips the upper triangle block by block); the value is the rows' latent prefix, a view.

Math is fp32 (the native kernel, the torch decodes) or SDPA's (fp32 accumulation); outputs are in
the query's dtype. Caches of other dtypes (8-bit) and tensors off the CPU take core's reference.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from portside.backends.cpu import native_ops
from portside.contract.latent import LatentAttention

__all__ = ["CpuLatentAttention", "native_latent_decode", "torch_latent_decode", "latent_prefill"]

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the torch paths store and read
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # queries and caches `mla_decode` takes
PREFILL_ROWS = 2048  # query rows (tokens x heads) of one prefill SDPA call


def _takes(query: torch.Tensor, cache: torch.Tensor) -> bool:
    return query.device.type == "cpu" and cache.device.type == "cpu" and cache.dtype in CACHE_DTYPES


class CpuLatentAttention(LatentAttention):
    """The latent-attention methods of the cpu attention backends (module docstring)."""

    latent_native: ClassVar[bool] = False
    """Decodes through the native kernel once the library is loaded (the native backend's)."""

    def write_latent(self, cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if not _takes(latent, cache):
            return super().write_latent(cache, latent, slot_mapping)
        keep = slot_mapping >= 0
        flat = cache.view(-1, cache.shape[-1])
        if bool(keep.all()):
            flat.index_copy_(0, slot_mapping.long(), latent.to(cache.dtype))
        else:
            rows = keep.nonzero().squeeze(1)
            flat.index_copy_(0, slot_mapping[rows].long(), latent[rows].to(cache.dtype))

    def latent_attention(self, query, latent, cache, metadata, scale, latent_dim):
        if not _takes(query, cache):
            return super().latent_attention(query, latent, cache, metadata, scale, latent_dim)
        md = metadata
        self.write_latent(cache, latent, md.slot_mapping)
        num_tokens, num_heads, _ = query.shape
        num_reqs = len(md.seq_lens_cpu)
        nd = min(md.num_decode_tokens, num_reqs)
        qsl = md.query_start_loc_cpu
        native = self.latent_native and query.dtype in NATIVE_DTYPES and cache.dtype in NATIVE_DTYPES and native_ops.ready()
        if native and nd == num_tokens:  # a decode-only step: the kernel's output as it is
            return native_latent_decode(query, cache, md.block_tables[:nd], md.seq_lens[:nd], scale, latent_dim)
        out = torch.empty(num_tokens, num_heads, latent_dim, dtype=query.dtype)
        if qsl[num_reqs] < num_tokens:  # padding tokens outside every request: zeros, as the reference
            out[qsl[num_reqs] :].zero_()
        if nd:
            tables, lens = md.block_tables[:nd], md.seq_lens[:nd]
            if native:
                out[:nd] = native_latent_decode(query[:nd], cache, tables, lens, scale, latent_dim)
            else:
                out[:nd] = torch_latent_decode(query[:nd], cache, tables, lens, max(md.seq_lens_cpu[:nd]), scale, latent_dim)
        for i in range(nd, num_reqs):
            start, end = qsl[i], qsl[i + 1]
            if end > start:
                out[start:end] = latent_prefill(query[start:end], cache, md.block_tables[i], md.seq_lens_cpu[i], scale,
                                                latent_dim)
        return out


def native_latent_decode(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float, latent_dim: int) -> torch.Tensor:
    """One query token per sequence: query [B, H, D] over the first seq_lens[b] rows of sequence
    b's blocks -> [B, H, latent_dim], in ``portside_cpu_native::mla_decode``."""
    q = query if query.stride(-1) == 1 else query.contiguous()
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1 else \
        block_tables.to(torch.int32).contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() else seq_lens.to(torch.int32).contiguous()
    return torch.ops.portside_cpu_native.mla_decode(q, cache, tables, lens, float(scale), int(latent_dim))


def torch_latent_decode(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        max_seq_len: int, scale: float, latent_dim: int) -> torch.Tensor:
    """`native_latent_decode` in batched torch: the sequences' blocks in one gather (padded to the
    longest), scores and values as two batched matmuls in fp32, padded keys masked."""
    batch, _, d = query.shape
    bs = cache.shape[1]
    n = -(-max_seq_len // bs)
    blocks = block_tables[:, :n].reshape(-1).long()
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks).view(batch, n * bs, d).float()  # [B, S, D]
    scores = torch.bmm(query.float(), rows.transpose(1, 2)).mul_(scale)  # [B, H, S]
    hidden = torch.arange(n * bs).unsqueeze(0) >= seq_lens.long().unsqueeze(1)  # [B, S]
    probs = torch.softmax(scores.masked_fill_(hidden.unsqueeze(1), float("-inf")), dim=-1)
    return torch.bmm(probs, rows[..., :latent_dim]).to(query.dtype)


def latent_prefill(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float,
                   latent_dim: int) -> torch.Tensor:
    """One request's query chunk query [Q, H, D], the last Q of its seq_len positions, causal over
    its rows -> [Q, H, latent_dim]: SDPA with the heads folded into the query axis, one call per
    block of `PREFILL_ROWS` query rows over the rows that block sees (so a long prompt skips the
    upper triangle block by block: half the work of one masked call)."""
    num_q, num_heads, d = query.shape
    bs = cache.shape[1]
    n = -(-seq_len // bs)
    rows = cache.view(cache.shape[0], -1).index_select(0, block_table[:n].long()).view(n * bs, d)[:seq_len]  # [S, D]
    q = query.to(rows.dtype).reshape(num_q * num_heads, d)
    q0 = seq_len - num_q  # the first query's position
    out = torch.empty(num_q, num_heads, latent_dim, dtype=query.dtype)
    step = max(1, PREFILL_ROWS // num_heads)
    for start in range(0, num_q, step):
        end = min(num_q, start + step)
        keys = q0 + end  # what the block's last query sees
        q_pos = torch.arange(q0 + start, keys).repeat_interleave(num_heads)  # row t * H + h is token t
        mask = torch.arange(keys).unsqueeze(0) <= q_pos.unsqueeze(1)  # [rows, keys]
        o = F.scaled_dot_product_attention(q[start * num_heads : end * num_heads][None, None], rows[None, None, :keys],
                                           rows[None, None, :keys, :latent_dim], attn_mask=mask, scale=scale)
        out[start:end] = o.view(end - start, num_heads, latent_dim)
    return out
