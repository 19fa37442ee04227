"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the pure-torch reference of the paged
latent cache and of attention over it, the defaults of `portside.contract.LatentAttention`.

An MLA layer caches one row per token instead of K and V: the compressed KV latent ``c_kv``
(``latent_dim`` = kv_lora_rank values) followed by the shared rotary key ``k_pe`` (rope_dim
values), ``head_size = latent_dim + rope_dim``. Attention runs in the *absorbed* form: the model
multiplies each head's non-rotary query by that head's key up-projection (W_UK) beforehand, so a
query row is ``[q_nope @ W_UK (latent_dim), q_pe (rope_dim)]`` and its score against a cached row
is one dot product over all ``head_size`` values; the value is the row's first ``latent_dim``
values (the same row for every head: multi-query attention over the latent), and the model
multiplies the output by the value up-projection (W_UV) afterwards.

Reference cache layout (one layer): ``[num_blocks, block_size, head_size]``; slot ``s`` is block
``s // block_size``, offset ``s % block_size``.

The attention is vectorised over requests, not looped per token: the step's decodes (one query
each, first in the batch) are attended together, then its prefill chunks together, each group
padded to its longest query and sequence. Math in fp32, output in the query's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only named in annotations
    from portside.contract.attention import AttentionMetadata

__all__ = ["latent_cache_shape", "write_latent", "read_latent", "latent_attention", "paged_latent_attention",
           "attend_latent"]


def latent_cache_shape(num_blocks: int, block_size: int, head_size: int) -> tuple[int, ...]:
    """The reference layout: one row of `head_size` values per slot."""
    return (num_blocks, block_size, head_size)


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's row latent [T, head_size] at its slot (slot -1: padding, skipped)."""
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep].long()] = latent[keep].to(cache.dtype)


def read_latent(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows at `slots` -> [len(slots), head_size], as stored."""
    return cache.view(-1, cache.shape[-1])[slots.long()]


def attend_latent(
    q: torch.Tensor,  # [R, Q, H, D]: each request's last Q positions (padded)
    rows: torch.Tensor,  # [R, S, D]: each request's cached rows (padded)
    q_pos: torch.Tensor,  # [R, Q]: each query's absolute position
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """Causal MQA of padded queries over their requests' latent rows, in fp32 -> [R, Q, H, latent_dim].
    A query at position p sees rows 0..p; padded queries (any position >= 0) give finite garbage."""
    rows = rows.float()
    scores = torch.einsum("rqhd,rsd->rhqs", q.float(), rows) * scale
    k_pos = torch.arange(rows.shape[1], device=rows.device)
    hidden = k_pos.view(1, 1, 1, -1) > q_pos.view(q_pos.shape[0], 1, q_pos.shape[1], 1)
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("rhqs,rsl->rqhl", probs, rows[..., :latent_dim])


def _attend_group(
    query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata, scale: float, latent_dim: int,
    first: int, last: int, out: torch.Tensor,
) -> None:
    """Requests [first, last) of the step: gather their queries and rows (padded), attend, and
    scatter the outputs into `out` ([T + 1, H, latent_dim]; row T takes the padding)."""
    qsl_cpu, seq_cpu = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    max_q = max(qsl_cpu[i + 1] - qsl_cpu[i] for i in range(first, last))
    max_s = max(seq_cpu[first:last])
    if max_q == 0:
        return
    device, num_tokens = query.device, query.shape[0]
    starts = metadata.query_start_loc[first:last].long()
    q_lens = metadata.query_start_loc[first + 1 : last + 1].long() - starts
    seq_lens = metadata.seq_lens[first:last].long()
    # queries: request r's j-th query token is row starts[r] + j, at position seq_len - q_len + j
    j = torch.arange(max_q, device=device)
    valid = j.view(1, -1) < q_lens.view(-1, 1)  # [R, Q]
    tokens = torch.where(valid, starts.view(-1, 1) + j, num_tokens)  # padding -> the spare row
    q = query[tokens.clamp(max=num_tokens - 1)]  # [R, Q, H, D]
    q_pos = (seq_lens - q_lens).view(-1, 1) + j
    # rows: position s of request r is block block_tables[r, s // bs], offset s % bs
    bs = metadata.block_size
    tables = metadata.block_tables[first:last].long()
    s = torch.arange(max_s, device=device)
    blocks = tables[:, (s // bs).clamp(max=tables.shape[1] - 1)]  # [R, S]
    rows = read_latent(cache, blocks * bs + s % bs)  # [R, S, D]
    out[tokens] = attend_latent(q, rows, q_pos, scale, latent_dim).to(out.dtype)


def latent_attention(
    query: torch.Tensor,  # [T, H, head_size]: [q_nope @ W_UK, q_pe] per head
    latent: torch.Tensor,  # [T, head_size]: [c_kv, k_pe] per token
    cache: torch.Tensor,  # [num_blocks, block_size, head_size]
    metadata: AttentionMetadata,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """Write `latent` at `metadata.slot_mapping`, then attend each query causally over its
    request's cached rows: score = q . row (all head_size values), value = row[:latent_dim].
    Returns [T, H, latent_dim] in the query's dtype (tokens outside every request: zeros)."""
    write_latent(cache, latent, metadata.slot_mapping)
    return paged_latent_attention(query, cache, metadata, scale, latent_dim)


def paged_latent_attention(
    query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata, scale: float, latent_dim: int
) -> torch.Tensor:
    """`latent_attention` without the write: the step's rows are in the cache already."""
    num_tokens, num_heads = query.shape[0], query.shape[1]
    out = torch.zeros(num_tokens + 1, num_heads, latent_dim, dtype=query.dtype, device=query.device)
    num_reqs = len(metadata.seq_lens_cpu)
    num_decodes = min(metadata.num_decode_tokens, num_reqs)
    for first, last in ((0, num_decodes), (num_decodes, num_reqs)):  # decodes, then prefill chunks
        if last > first:
            _attend_group(query, cache, metadata, scale, latent_dim, first, last, out)
    return out[:num_tokens]
