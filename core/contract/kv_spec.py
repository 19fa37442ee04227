"""What one attention layer's cache holds per token (`KVCacheSpec`): the pool is sized from it.
Its own module so that `portside.contract.latent` can extend it without importing the attention
contract (which mixes in `portside.contract.latent.LatentAttention`); also importable from
`portside.contract.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portside.contract.kv_quant import kv_row_bytes

__all__ = ["KVCacheSpec"]


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer stores per token; the pool is sized from this."""

    num_layers: int
    """Attention layers on this rank (its pipeline stage's)."""
    num_kv_heads: int
    """KV heads per tensor-parallel rank."""
    head_size: int
    """Values per head."""
    dtype: torch.dtype
    """The model's dtype."""
    cache_dtype: torch.dtype | None = None
    """What the cache holds (`--kv-cache-dtype`, an 8-bit dtype); None: `dtype`."""

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype."""
        return self.cache_dtype or self.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token (`kv_row_bytes` per head and layer)."""
        return 2 * self.num_layers * self.num_kv_heads * kv_row_bytes(self.head_size, self.storage_dtype)

    def bytes_per_block(self, block_size: int) -> int:
        """`bytes_per_token` times `block_size`."""
        return self.bytes_per_token * block_size
