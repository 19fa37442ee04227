"""Attention's pure-torch math, independent of any cache layout: the causal attention of one
request (`attend`), attention through a backend's own `write_kv` / `read_kv` (what core runs for
a layer feature the backend does not handle), and the non-causal attention of vision encoders
and encoder-only models.
The contract's defaults call these; `portside.attention.reference` builds the paged reference
(canonical layout) on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only named in annotations; the contract's defaults call into this module
    from portside.contract.attention import AttentionBackend, AttentionMetadata

__all__ = ["attend", "attention_through_read_kv", "encoder_attention"]


def attend(
    q: torch.Tensor,  # [Q, H, D]: the last Q positions of the sequence
    k: torch.Tensor,  # [S, KVH, D]: every position of the sequence
    v: torch.Tensor,  # [S, KVH, D]
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H]: per-head logits in the softmax's denominator only
) -> torch.Tensor:
    """Causal attention of one request's queries over its keys, in fp32; returns [Q, H, D] fp32.
    With `sinks`, each head's softmax runs over its scores and one more logit, the head's sink,
    whose probability is dropped (gpt-oss: the output shrinks by sigmoid(lse - sink))."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]  # query heads per KV head (GQA)
    k = k.float().repeat_interleave(group, dim=1)  # (S, H, D)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # (H, Q, S)
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)  # (Q, 1)
    k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)  # (1, S)
    hidden = k_pos > q_pos
    if sliding_window is not None:
        hidden |= k_pos <= q_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().to(q.device).view(-1, 1, 1).expand(-1, q_len, 1)  # (H, Q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def attention_through_read_kv(
    backend: AttentionBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    **features: object,
) -> torch.Tensor:
    """Paged attention for any backend, whatever its cache layout: K/V written with the backend's
    own `write_kv`, read back with its `read_kv`, attended by `attend`. What a backend that does
    not handle a layer's features itself runs for that layer (slow, and never inside a graph)."""
    backend.write_kv(kv_cache, key, value, metadata.slot_mapping)
    bs = metadata.block_size
    qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    tables = metadata.block_tables.cpu()
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        pos = torch.arange(seq_len)
        slots = (tables[i, pos // bs].long() * bs + pos % bs).to(kv_cache.device)
        k, v = backend.read_kv(kv_cache, slots)
        out[start:end] = attend(query[start:end], k, v, scale, **features).to(query.dtype)  # type: ignore[arg-type]
    return out


def encoder_attention(
    query: torch.Tensor,  # [T, H, D]: every sequence's tokens, back to back
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [S + 1] int32: sequence s is rows cu_seqlens[s]:cu_seqlens[s + 1]
    max_seqlen: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Non-causal (bidirectional) attention within each sequence, no KV cache: a vision
    encoder's images, Qwen2.5-VL's windows of one image, or an encoder-only model's prompts
    (BERT). With `sliding_window` W (ModernBERT's local layers) a query at position p sees the
    keys at positions k with ``|p - k| <= W`` only. fp32 math; returns [T, H, D] in the
    query's dtype."""
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        q, k, v = query[a:b].float(), key[a:b].float(), value[a:b].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if sliding_window is not None:
            pos = torch.arange(b - a, device=query.device)
            scores = scores.masked_fill((pos.unsqueeze(1) - pos.unsqueeze(0)).abs() > sliding_window, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
