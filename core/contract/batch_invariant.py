"""Batch-invariant attention for any platform: `BatchInvariantAttention` wraps a platform's own
attention backend, keeps its cache layout (shape, `write_kv`, `read_kv`, allocation), and
attends with core's batch-invariant reference (`portside.ops.batch_invariant.paged_attention`),
so a token's output does not depend on its batch, its prompt's chunking or prefix-cache hits.

A platform that declares `Platform.supports_batch_invariant` returns one from
`attention_backend` when `EngineConfig.batch_invariant` is set (or its own invariant kernel).
"""

from __future__ import annotations

from typing import Any

import torch

from portside.contract.attention import AttentionBackend, AttentionMetadata, GraphCaptureSupport
from portside.ops import batch_invariant as bi

__all__ = ["BatchInvariantAttention"]


class BatchInvariantAttention(AttentionBackend):
    """`inner`'s cache, core's batch-invariant attention (eager only; no attention sinks)."""

    graph_support = GraphCaptureSupport.NEVER
    features = frozenset({"sliding_window", "logit_softcap"})
    unsupported_features = frozenset({"sinks"})  # core's fallback for them is not invariant: refused

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.name = f"batch-invariant({inner.name})"  # type: ignore[misc]
        self.kv_cache_dtypes = inner.kv_cache_dtypes  # type: ignore[misc]

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                       **kwargs: Any) -> tuple[int, ...]:
        return self.inner.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, **kwargs)

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                    cache_dtype: torch.dtype) -> tuple[int, ...]:
        return self.inner.cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate_kv_cache(shape, dtype, device)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.inner.write_kv(kv_cache, key, value, slot_mapping)

    def read_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read_kv(kv_cache, slots)

    def read_stored_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read_stored_kv(kv_cache, slots)

    def write_stored_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        self.inner.write_stored_kv(kv_cache, key, value, slots)

    def supports(self, head_size: int, dtype: torch.dtype, block_size: int) -> str | None:
        return self.inner.supports(head_size, dtype, block_size)

    @property
    def encoder_features(self) -> frozenset[str]:  # type: ignore[override]
        """`inner`'s: encoder (bidirectional) attention runs there unchanged."""
        return self.inner.encoder_features

    def encoder_attention(self, query, key, value, cu_seqlens, max_seqlen, scale, **features):  # type: ignore[no-untyped-def]
        return self.inner.encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale, **features)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        self.inner.write_kv(kv_cache, key, value, metadata.slot_mapping)
        out = torch.zeros_like(query)
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        reqs = [i for i, n in enumerate(seq_lens) if qsl[i + 1] > qsl[i]]
        if not reqs:
            return out
        bs = metadata.block_size
        longest = max(seq_lens[i] for i in reqs)
        span = -(-longest // bs) * bs  # whole blocks
        pos = torch.arange(span)
        tables = metadata.block_tables.cpu().long()[reqs][:, : span // bs]  # [R, blocks]
        slots = tables[:, pos // bs] * bs + pos % bs  # [R, span]
        inside = pos[None] < torch.tensor([seq_lens[i] for i in reqs])[:, None]  # [R, span]
        slots = slots.masked_fill(~inside, 0)  # past a sequence: any slot, zeroed below
        k, v = self.inner.read_kv(kv_cache, slots.reshape(-1).to(kv_cache.device))
        shape = (len(reqs), span, *k.shape[1:])
        mask = inside.to(k.device)[:, :, None, None]
        k = k.float().reshape(shape).masked_fill(~mask, 0.0)
        v = v.float().reshape(shape).masked_fill(~mask, 0.0)
        q_req: list[int] = []
        q_pos: list[int] = []
        for r, i in enumerate(reqs):
            n = qsl[i + 1] - qsl[i]
            q_req += [r] * n
            q_pos += range(seq_lens[i] - n, seq_lens[i])
        start, end = qsl[reqs[0]], qsl[reqs[-1] + 1]
        device = query.device
        o = bi.paged_attention(
            query[start:end], k, v, torch.tensor(q_req, device=device), torch.tensor(q_pos, device=device), bs,
            scale, sliding_window, logit_softcap,
        )  # fmt: skip
        out[start:end] = o.to(query.dtype)
        return out
