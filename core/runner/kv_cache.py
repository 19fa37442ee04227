"""The runner's KV caches: the checks a model and an attention backend must pass before any cache
is allocated, one cache tensor per layer, and the decode-only dummy context graph runners capture
with.

Public for every model the runner drives, the target and a speculative-decoding draft alike
(`portside.spec_decode.draft_model` allocates its own caches, indexed by the target's block ids,
through these functions).
"""

from __future__ import annotations

from typing import Any

import torch

from portside.contract import (
    AttentionMetadata,
    ForwardContext,
    KVCacheSpec,
    LatentKVCacheSpec,
    Platform,
    kv_cache_dtype_name,
)

__all__ = [
    "allocate_kv_caches",
    "check_attention_features",
    "check_kv_cache_dtype",
    "check_latent_kv_cache_dtype",
    "layer_cache_shape",
    "dummy_decode_context",
]


def check_attention_features(model: object, platform: type[Platform], backend: object) -> None:
    """Refuse a model whose layers need an attention feature the backend declares unsupported
    (`AttentionBackend.unsupported_features`): a clear error at start-up, not a wrong result."""
    refused: frozenset[str] = getattr(backend, "unsupported_features", frozenset())
    features = getattr(model, "attention_features", None)
    if not refused or features is None:
        return
    num_layers: int = getattr(model, "num_layers", None) or model.config.num_layers  # type: ignore[attr-defined]
    for i in range(num_layers):  # this pipeline stage's layers
        for name, value in features(i).items():
            if value is not None and name in refused:
                raise ValueError(
                    f"{model.config.architecture} needs attention feature {name!r} (layer {i}), which the "  # type: ignore[attr-defined]
                    f"{platform.name} platform's attention backend {getattr(backend, 'name', '?')!r} does not support"
                )


def check_kv_cache_dtype(name: str, platform: type[Platform], backend: object) -> None:
    """Refuse an 8-bit cache the attention backend does not store: never silently the model dtype."""
    name = kv_cache_dtype_name(name)
    listed: frozenset[str] = getattr(backend, "kv_cache_dtypes", frozenset({"auto"}))
    if name != "auto" and name not in listed:
        raise ValueError(
            f"--kv-cache-dtype {name}: the {platform.name} platform's attention backend {getattr(backend, 'name', '?')!r} "
            f"stores only {sorted(listed)}; use --kv-cache-dtype auto"
        )


def check_latent_kv_cache_dtype(name: str, spec: KVCacheSpec, architecture: str) -> None:
    """Refuse an 8-bit cache for a model with latent attention (MLA, `LatentKVCacheSpec`): its
    latent rows are stored in the model's dtype only (8-bit latent caches are not implemented)."""
    if isinstance(spec, LatentKVCacheSpec) and kv_cache_dtype_name(name) != "auto":
        raise ValueError(
            f"--kv-cache-dtype {name}: {architecture} uses multi-head latent attention (MLA), whose latent KV cache "
            "is stored in the model's dtype only (an 8-bit latent cache is not implemented); use --kv-cache-dtype auto"
        )


def layer_cache_shape(backend: Any, spec: KVCacheSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The shape of one layer's cache of `num_blocks` blocks: the backend's latent layout for an
    MLA model (`LatentKVCacheSpec`: one row of head_size values per token), else its K/V layout."""
    if isinstance(spec, LatentKVCacheSpec):
        return tuple(backend.latent_cache_shape(num_blocks, block_size, spec.head_size))
    return tuple(backend.cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_size, spec.storage_dtype))


def allocate_kv_caches(backend: Any, spec: KVCacheSpec, num_blocks: int, block_size: int,
                       device: torch.device) -> list[torch.Tensor]:
    """One cache per layer of `spec`, `num_blocks` blocks plus the scratch block (the last)."""
    dtype = spec.storage_dtype
    shape = layer_cache_shape(backend, spec, num_blocks + 1, block_size)
    return [backend.allocate_kv_cache(shape, dtype, device) for _ in range(spec.num_layers)]


def dummy_decode_context(backend: Any, kv_caches: list[torch.Tensor], scratch_block: int, block_size: int,
                         device: torch.device, num_decodes: int) -> ForwardContext:
    """A decode-only batch of `num_decodes` one-token requests writing to the scratch block (for capture)."""
    slot = scratch_block * block_size
    md = AttentionMetadata(
        slot_mapping=torch.full((num_decodes,), slot, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(num_decodes + 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(num_decodes, dtype=torch.int32, device=device),
        block_tables=torch.full((num_decodes, 1), scratch_block, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=1,
        block_size=block_size,
        query_start_loc_cpu=list(range(num_decodes + 1)),
        seq_lens_cpu=[1] * num_decodes,
        num_decode_tokens=num_decodes,
    )
    return ForwardContext(backend, kv_caches, backend.prepare(md))
