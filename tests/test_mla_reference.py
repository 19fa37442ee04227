"""Core's latent-attention reference (`portside.ops.mla`) against the plain per-request causal
attention of `portside.ops.attention.attend` (one KV head: key = the whole latent row, value =
its first latent_dim values), over the conformance kit's mixed batches, and the contract's
`LatentKVCacheSpec` sizes."""

from __future__ import annotations

import pytest
import torch

from portside.contract import AttentionBackend, KVCacheSpec, LatentKVCacheSpec
from portside.ops import mla
from portside.ops.attention import attend
from portside.testing.conformance.cases import batches, build_metadata, ordered, random_block_tables


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,latent_dim,rope_dim", [(4, 32, 8), (3, 64, 16)])
def test_latent_attention_equals_per_request_mqa(block_size: int, heads: int, latent_dim: int, rope_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    d = latent_dim + rope_dim
    for requests in batches(block_size).values():
        requests = ordered(requests)
        pool = 64
        tables = random_block_tables(requests, block_size, pool, gen)
        cache = torch.randn(mla.latent_cache_shape(pool, block_size, d), generator=gen)
        prefix = {i: torch.randn(c, d, generator=gen) for i, (c, _) in enumerate(requests)}
        for i, (c, _) in enumerate(requests):  # the cached prefix, written at its slots
            slots = torch.tensor([tables[i][p // block_size] * block_size + p % block_size for p in range(c)], dtype=torch.long)
            mla.write_latent(cache, prefix[i], slots)
        md = build_metadata(requests, tables, block_size, torch.device("cpu"))
        q = torch.randn(md.num_tokens, heads, d, generator=gen)
        latent = torch.randn(md.num_tokens, d, generator=gen)
        out = mla.latent_attention(q, latent, cache, md, 0.3, latent_dim)
        assert out.shape == (md.num_tokens, heads, latent_dim)
        qsl = md.query_start_loc_cpu
        for i in range(len(requests)):
            rows = torch.cat([prefix[i], latent[qsl[i] : qsl[i + 1]]])  # the whole sequence
            want = attend(q[qsl[i] : qsl[i + 1]], rows[:, None], rows[:, None, :latent_dim], 0.3)
            torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], want)


def test_padding_tokens_are_skipped_and_zero() -> None:
    """Tokens past the last request (a padded batch) are neither written nor attended."""
    cache = torch.zeros(mla.latent_cache_shape(4, 4, 6))
    md = build_metadata(((0, 3),), [[2]], 4, torch.device("cpu"))
    md.slot_mapping = torch.cat([md.slot_mapping, torch.tensor([-1, -1])])
    q, latent = torch.randn(5, 2, 6), torch.randn(5, 6)
    out = mla.latent_attention(q, latent, cache, md, 1.0, 4)
    assert torch.equal(out[3:], torch.zeros(2, 2, 4))
    assert torch.equal(mla.read_latent(cache, torch.arange(8, 11)), latent[:3])
    assert int((cache != 0).any(-1).sum()) == 3


def test_latent_spec_counts_one_row_per_token_and_layer() -> None:
    spec = LatentKVCacheSpec(num_layers=27, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, latent_dim=512)
    assert spec.rope_dim == 64 and spec.bytes_per_token == 27 * 576 * 2
    full = KVCacheSpec(num_layers=27, num_kv_heads=16, head_size=192, dtype=torch.bfloat16)
    assert full.bytes_per_token == 2 * 27 * 16 * 192 * 2
    assert isinstance(spec, KVCacheSpec)


def test_every_backend_inherits_the_reference() -> None:
    from portside.attention.reference import ReferenceAttentionBackend

    backend = ReferenceAttentionBackend()
    assert isinstance(backend, AttentionBackend)
    assert backend.latent_cache_shape(3, 16, 576) == (3, 16, 576)
