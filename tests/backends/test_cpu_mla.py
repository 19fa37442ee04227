"""The cpu backends' latent attention (`backends/cpu/mla.py`, `csrc/mla.cpp`) against core's
reference (`portside.ops.mla`).

Both backends: `CpuAttentionBackend` (batched torch decodes and prefills) and
`NativeAttentionBackend` (decodes in ``portside_cpu_native::mla_decode``), with the reference
patched to raise while they run, and the native backend's torch decode path too, so a test fails
if a call silently fell back. Batches are the conformance kit's (decodes at block boundaries,
ragged prefills, prefill chunks over cached prefixes mixed with decodes) plus long decodes that
the kernel splits over threads and long prefills (several SDPA blocks); shapes from DeepSeek-V2's 512 + 64 down to odd small ones
(96 + 32, 16 + 8, 24 + 7), 1 to 20 heads (several head vectors, a remainder); fp32 and bf16
with the tolerances of `portside.testing.tolerances`. Slots no request reads hold large noise.
"""

from __future__ import annotations

import pytest
import torch

from portside.backends.cpu import mla as cpu_mla
from portside.backends.cpu import native_ops
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.ops import mla as ref
from portside.testing.conformance.cases import batches, build_metadata, ordered, random_block_tables
from portside.testing.tolerances import assert_close

REFERENCE = ref.latent_attention
# (heads, latent_dim, rope_dim, block size)
SHAPES = [(16, 512, 64, 16), (1, 96, 32, 32), (5, 16, 8, 16), (20, 24, 7, 4)]
LONG = ((700, 1), (90, 1), (333, 1))
LONG_PREFILLS = ((0, 300), (200, 150))  # more query rows (tokens x heads) than one prefill SDPA call takes


def _native_reason() -> str | None:
    return native_ops.unavailable_reason()


@pytest.fixture(params=["torch", "native"])
def backend(request, monkeypatch):
    """A cpu backend whose latent calls must not reach core's reference (nor, for the native
    one, the torch decode path)."""

    def refuse(*args, **kwargs):
        raise AssertionError("fell back")

    if request.param == "native":
        if _native_reason() is not None:
            pytest.skip(f"the native operators do not build here: {_native_reason()}")
        assert native_ops.ready()
        monkeypatch.setattr(cpu_mla, "torch_latent_decode", refuse)
        b = NativeAttentionBackend()
    else:
        b = CpuAttentionBackend()
    monkeypatch.setattr(ref, "latent_attention", refuse)
    return b


def run(backend, requests, heads, latent_dim, rope_dim, bs, dtype, gen, pad=0):
    """(the backend's output, the reference's over the same stored rows) for one batch; `pad`
    tokens with slot -1 appended."""
    d = latent_dim + rope_dim
    requests = ordered(requests)
    pool = 2 * sum(-(-(c + n) // bs) for c, n in requests) + 3
    tables = random_block_tables(requests, bs, pool, gen)
    cache = (100 * torch.randn(backend.latent_cache_shape(pool, bs, d), generator=gen)).to(dtype)  # unread: noise
    if any(c for c, _ in requests):  # the cached prefixes, through the backend's write
        md = build_metadata(tuple((0, c) for c, _ in requests if c), [t for (c, _), t in zip(requests, tables) if c], bs,
                            torch.device("cpu"))  # fmt: skip
        backend.write_latent(cache, torch.randn(md.num_tokens, d, generator=gen).to(dtype), md.slot_mapping)
    md = build_metadata(requests, tables, bs, torch.device("cpu"))
    if pad:
        md.slot_mapping = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=torch.int64)])
    q = torch.randn(md.num_tokens, heads, d, generator=gen).to(dtype)
    latent = torch.randn(md.num_tokens, d, generator=gen).to(dtype)
    before = cache.clone()
    scale = d**-0.5
    out = backend.latent_attention(q, latent, cache, backend.prepare(md), scale, latent_dim)
    want_cache = before.float()
    ref.write_latent(want_cache, latent.float(), md.slot_mapping)
    assert torch.equal(cache.float(), want_cache), "the new rows are stored at their slots, nothing else changes"
    md.slot_mapping = torch.full_like(md.slot_mapping, -1)  # written above
    want = REFERENCE(q.float(), latent.float(), want_cache, md, scale, latent_dim)
    return out, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,latent_dim,rope_dim,bs", SHAPES, ids=[f"h{h}-l{l}-r{r}-bs{b}" for h, l, r, b in SHAPES])
def test_latent_attention_matches_reference(backend, heads, latent_dim, rope_dim, bs, dtype) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + latent_dim)
    for name, requests in {**batches(bs), "long_decodes": LONG, "long_prefills": LONG_PREFILLS}.items():
        out, want = run(backend, requests, heads, latent_dim, rope_dim, bs, dtype, gen)
        assert out.dtype == dtype and out.shape == want.shape
        assert_close(out, want.to(dtype), context=f"{type(backend).__name__}, batch {name} {requests}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_decodes_any_thread_count(backend, threads) -> None:
    """One long decode (batch 1: split over the threads) and a batch of them, whatever the thread count."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        for requests in (((1000, 1),), ((400, 1), (31, 1), (0, 1), (129, 1))):
            out, want = run(backend, requests, 16, 64, 16, 16, torch.float32, gen)
            assert_close(out, want)
    finally:
        torch.set_num_threads(old)


def test_padding_tokens_are_zero_and_not_written(backend) -> None:
    gen = torch.Generator().manual_seed(5)
    out, want = run(backend, batches(16)["mixed"], 3, 32, 16, 16, torch.float32, gen, pad=3)
    assert torch.equal(out[-3:], torch.zeros(3, 3, 32))
    assert_close(out, want)


@pytest.mark.parametrize("qdtype,cdtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_mla_decode_mixed_dtypes_and_strided_queries(qdtype, cdtype) -> None:
    """The operator itself: fp32 queries over a bf16 cache and the reverse, queries a strided view
    of a wider tensor (a projection's output), block tables wider than needed."""
    if _native_reason() is not None:
        pytest.skip(f"the native operators do not build here: {_native_reason()}")
    assert native_ops.ready()
    gen = torch.Generator().manual_seed(3)
    B, H, L, R, bs = 3, 6, 64, 32, 16
    wide = torch.randn(B, H, L + R + 8, generator=gen).to(qdtype)
    q = wide[..., 4 : 4 + L + R]
    cache = torch.randn(20, bs, L + R, generator=gen).to(cdtype)
    tables = torch.randperm(20, generator=gen)[:15].view(3, 5).to(torch.int32)
    lens = torch.tensor([70, 1, 33], dtype=torch.int32)
    out = torch.ops.portside_cpu_native.mla_decode(q, cache, tables, lens, 0.1, L)
    assert out.dtype == qdtype and out.shape == (B, H, L)
    for b in range(B):
        pos = torch.arange(int(lens[b]))
        rows = cache[tables[b, pos // bs].long(), pos % bs].float()
        want = torch.softmax(q[b].float() @ rows.T * 0.1, -1) @ rows[:, :L]
        assert_close(out[b], want.to(qdtype))


def test_mla_decode_refuses_bad_input() -> None:
    """A clear error, not a crash, for a cache whose rows do not match the queries and a block id
    outside the cache."""
    if _native_reason() is not None:
        pytest.skip(f"the native operators do not build here: {_native_reason()}")
    assert native_ops.ready()
    op = torch.ops.portside_cpu_native.mla_decode
    q, cache = torch.randn(1, 2, 24), torch.randn(4, 16, 24)
    lens, tables = torch.tensor([5], dtype=torch.int32), torch.tensor([[2]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="rows hold 20 values"):
        op(q, torch.randn(4, 16, 20), tables, lens, 1.0, 16)
    with pytest.raises(RuntimeError, match="block 9 outside"):
        op(q, cache, torch.tensor([[9]], dtype=torch.int32), lens, 1.0, 16)
    with pytest.raises(RuntimeError, match="length 17 outside"):
        op(q, cache, tables, torch.tensor([17], dtype=torch.int32), 1.0, 16)
