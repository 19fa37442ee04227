"""Triton latent attention (`portside.backends.triton.mla`, through `TritonAttentionBackend`)
against core's reference (`portside.ops.mla`).

Under the interpreter on CPU tensors (conftest sets TRITON_INTERPRET). Batches are the
conformance kit's (decodes at block boundaries, ragged prefills, prefill chunks over cached
prefixes mixed with decodes) plus longer decodes split over KV partitions; shapes from
DeepSeek-V2's 512 + 64 down to odd small ones (96 + 32, 16 + 8, 40 + 24), 1 to 16+ heads (a
second head group past 16); fp32 and bf16 with the tolerances of `portside.testing.tolerances`,
and fp8 caches against the reference over the same stored values.
"""

from __future__ import annotations

import pytest
import torch

from portside.ops import mla as ref
from portside.testing.conformance.cases import batches, build_metadata, ordered, random_block_tables
from portside.testing.tolerances import assert_close

triton = pytest.importorskip("triton")

from portside.backends.triton.attention import TritonAttentionBackend  # noqa: E402  (after the interpreter is set)

pytestmark = pytest.mark.triton

# (heads, latent_dim, rope_dim, block size)
SHAPES = [(16, 512, 64, 16), (1, 96, 32, 32), (5, 16, 8, 16), (20, 40, 24, 16)]
LONG = {"long_decodes": ((260, 1), (90, 1), (150, 1))}


def run(backend: TritonAttentionBackend, requests, heads: int, latent_dim: int, rope_dim: int, bs: int,
        dtype: torch.dtype, device: torch.device, gen: torch.Generator, cache_dtype: torch.dtype | None = None,
        pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(the backend's output, the reference's over the same stored rows) for one batch; `pad`
    tokens with slot -1 are appended (a padded step)."""
    d = latent_dim + rope_dim
    requests = ordered(requests)
    pool = 2 * sum(-(-(c + n) // bs) for c, n in requests) + 3
    tables = random_block_tables(requests, bs, pool, gen)
    cache_dtype = cache_dtype or dtype
    cache = torch.full(backend.latent_cache_shape(pool, bs, d), float("nan")).to(cache_dtype).to(device)  # stale: NaN
    if any(c for c, _ in requests):  # the cached prefixes, through the backend's write
        md = build_metadata(tuple((0, c) for c, _ in requests if c), [t for (c, _), t in zip(requests, tables) if c], bs,
                            torch.device("cpu"))  # fmt: skip
        backend.write_latent(cache, torch.randn(md.num_tokens, d, generator=gen).to(dtype).to(device), md.slot_mapping.to(device))
    md = build_metadata(requests, tables, bs, device)
    if pad:
        md.slot_mapping = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=torch.int64, device=device)])
    q = torch.randn(md.num_tokens, heads, d, generator=gen).to(dtype)
    latent = torch.randn(md.num_tokens, d, generator=gen).to(dtype)
    scale = d**-0.5
    out = backend.latent_attention(q.to(device), latent.to(device), cache, md, scale, latent_dim)
    ref_cache = torch.nan_to_num(cache.cpu().float(), nan=0.0)  # what the backend stored, as values (NaN: unread)
    md_cpu = build_metadata(requests, tables, bs, torch.device("cpu"))
    md_cpu.slot_mapping = torch.full_like(md_cpu.slot_mapping, -1)  # the rows are in already
    if pad:
        md_cpu.slot_mapping = torch.cat([md_cpu.slot_mapping, torch.full((pad,), -1, dtype=torch.int64)])
    want = ref.latent_attention(q.float(), latent.float(), ref_cache, md_cpu, scale, latent_dim)
    if cache_dtype == dtype:  # the new rows are stored exactly
        assert torch.equal(backend.read_latent(cache, md.slot_mapping[: md.num_tokens - pad]).cpu(), latent[: md.num_tokens - pad])
    return out.cpu(), want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,latent_dim,rope_dim,bs", SHAPES, ids=[f"h{h}-l{l}-r{r}-bs{b}" for h, l, r, b in SHAPES])
def test_latent_attention_matches_reference(heads, latent_dim, rope_dim, bs, dtype, kernel_device) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + latent_dim)
    backend = TritonAttentionBackend()
    for name, requests in batches(bs).items():
        out, want = run(backend, requests, heads, latent_dim, rope_dim, bs, dtype, kernel_device, gen)
        assert out.dtype == dtype and out.shape == want.shape
        assert_close(out, want.to(dtype), context=f"batch {name} {requests}")


@pytest.mark.parametrize("splits", [1, 3])
def test_long_decodes_split_over_partitions(splits, kernel_device) -> None:
    """Decodes over hundreds of rows, in one partition or split (flash-decoding + the reduce kernel)."""
    gen = torch.Generator().manual_seed(splits)
    backend = TritonAttentionBackend(num_splits=splits)
    out, want = run(backend, LONG["long_decodes"], 4, 64, 16, 16, torch.float32, kernel_device, gen)
    assert_close(out, want)


@pytest.mark.parametrize("splits", [1, 2])
def test_tiles_smaller_than_a_block(splits, kernel_device) -> None:
    """The GPU's tiling (16 rows of a 32- or 64-row block per iteration) under the interpreter."""
    gen = torch.Generator().manual_seed(11)
    backend = TritonAttentionBackend(num_splits=splits)
    backend.latent_block_n = 16
    cases = [(32, "long_decodes")] if splits > 1 else [(32, "mixed"), (64, "decodes")]  # split-KV: decode-only steps
    for bs, name in cases:
        requests = {**batches(bs), **LONG}[name]
        out, want = run(backend, requests, 4, 64, 16, bs, torch.float32, kernel_device, gen)
        assert_close(out, want, context=f"block size {bs}, batch {name}")


def test_padding_tokens_are_zero_and_not_written(kernel_device) -> None:
    gen = torch.Generator().manual_seed(5)
    out, want = run(TritonAttentionBackend(), batches(16)["mixed"], 3, 32, 16, 16, torch.float32, kernel_device, gen, pad=3)
    assert torch.equal(out[-3:], torch.zeros(3, 3, 32))
    assert_close(out, want)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_cache(cache_dtype, kernel_device) -> None:
    """An fp8 latent cache: rows cast on write, decoded in the kernel; against the reference over
    the stored values (so only the kernel's arithmetic is compared)."""
    gen = torch.Generator().manual_seed(8)
    out, want = run(TritonAttentionBackend(), batches(16)["mixed"], 4, 64, 32, 16, torch.bfloat16, kernel_device, gen,
                    cache_dtype=cache_dtype)  # fmt: skip
    assert_close(out, want.to(torch.bfloat16))
