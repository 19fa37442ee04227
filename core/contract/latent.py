"""Multi-head latent attention (MLA, DeepSeek-V2/V3): what such a layer caches per token
(`LatentKVCacheSpec`: one compressed row, not K and V) and the paged kernels over that cache
(`LatentAttention`, mixed into `AttentionBackend`), each defaulting to core's pure-torch
reference in `portside.ops.mla`.

A latent row is ``[c_kv (latent_dim = kv_lora_rank values), k_pe (rope_dim values)]``: the
compressed KV of the token and its shared rotary key. Attention runs in the absorbed form: the
model hands in queries ``[q_nope @ W_UK, q_pe]`` per head ([T, H, head_size]); each scores every
cached row of its request up to its own position (one dot product over all head_size values) and
reads values ``row[:latent_dim]``, the same row for every head (multi-query attention over the
latent); the model multiplies the output by W_UV. See `portside.ops.mla`.

A backend overriding one of the layout-dependent methods (`latent_cache_shape`, `write_latent`,
`read_latent`, `latent_attention`) overrides them together; the conformance kit
(`portside.testing.conformance`, test_latent_ops) tests the overrides against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from portside.contract.kv_quant import kv_row_bytes
from portside.contract.kv_spec import KVCacheSpec
from portside.ops import mla as ref

if TYPE_CHECKING:  # the attention contract mixes this class in, so it is named only in annotations
    from portside.contract.attention import AttentionMetadata

__all__ = ["LatentAttention", "LatentKVCacheSpec"]


@dataclass(frozen=True)
class LatentKVCacheSpec(KVCacheSpec):
    """An MLA model's cache: one row of ``head_size = latent_dim + rope_dim`` values per token and
    layer (``num_kv_heads`` is 1: the row is shared by every head and is not split under tensor
    parallelism), no separate V."""

    latent_dim: int = 0
    """The compressed KV's width (kv_lora_rank); ``head_size - latent_dim`` is the rotary key's."""

    @property
    def rope_dim(self) -> int:
        """The shared rotary key's width (qk_rope_head_dim)."""
        return self.head_size - self.latent_dim

    @property
    def bytes_per_token(self) -> int:
        """One row of every layer for one token (no V: the values are the row's latent part)."""
        return self.num_layers * self.num_kv_heads * kv_row_bytes(self.head_size, self.storage_dtype)


class LatentAttention:
    """The paged latent-attention kernels of an attention backend (a mixin of `AttentionBackend`);
    the defaults are core's reference (`portside.ops.mla`, layout ``[num_blocks, block_size,
    head_size]``). A backend overrides them together, with faster kernels for its platform."""

    latent_graph_support: ClassVar[bool] = False
    """Whether the platform's graph runner runs MLA models, its graphs calling `latent_attention`
    (MLA layers do not cut the model at `ForwardContext.attention` calls, as piecewise runners
    expect). False (the default, and what the reference needs: it writes with a data-dependent
    mask): the model runner keeps the platform's runner only if it runs models op by op
    (`GraphRunner.supports_recurrent_state`), else runs MLA models in `EagerGraphRunner`."""

    def latent_cache_shape(self, num_blocks: int, block_size: int, head_size: int) -> tuple[int, ...]:
        """Shape of one MLA layer's cache (`head_size` values per slot)."""
        return ref.latent_cache_shape(num_blocks, block_size, head_size)

    def write_latent(self, cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store latent [T, head_size] at `slot_mapping` (-1: skip)."""
        ref.write_latent(cache, latent, slot_mapping)

    def read_latent(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The rows at `slots` -> [len(slots), head_size]. For tests; not on the hot path."""
        return ref.read_latent(cache, slots)

    def latent_attention(
        self,
        query: torch.Tensor,  # [T, H, head_size]
        latent: torch.Tensor,  # [T, head_size]
        cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        latent_dim: int,
    ) -> torch.Tensor:
        """Write `latent` at `metadata.slot_mapping`, then attend each query causally over its
        request's cached rows (score = q . row, value = row[:latent_dim]) -> [T, H, latent_dim]
        in the query's dtype. Default: this backend's `write_latent`, then core's reference over
        the reference layout (so a backend whose only override is how it writes keeps it)."""
        self.write_latent(cache, latent, metadata.slot_mapping)
        return ref.paged_latent_attention(query, cache, metadata, scale, latent_dim)
