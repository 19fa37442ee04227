"""Latent-attention contract (MLA, `portside.contract.LatentAttention`): the attention backend's
`latent_attention` equals core's reference (`portside.ops.mla`), run in fp32 on the CPU on the
same rounded inputs, and `write_latent` / `read_latent` store and return the rows exactly.

Each (block size, dtype) the platform declares runs each latent shape (heads, latent_dim,
rope_dim: DeepSeek-V2's 512 + 64, and smaller odd ones) over the standard batches (decodes at
block boundaries, ragged prefills, prefill chunks over cached prefixes mixed with decodes). The
pool is the backend's own layout (`latent_cache_shape`), filled with noise through its
`write_latent` in slots the batch must not read; the reference's is its own. A padding token
(slot -1) must not be written. A backend that overrides nothing runs the reference and passes.
"""

from __future__ import annotations

import os

import pytest
import torch

from portside.contract import AttentionBackend, Platform
from portside.ops import mla as ref
from portside.platform import discover_platforms
from portside.testing.conformance.cases import (
    batches,
    build_metadata,
    contract_failure,
    engine_config,
    on_cpu,
    ordered,
    random_block_tables,
    unused_slots,
)
from portside.testing.conformance.plugin import DEVICE_ENV
from portside.testing.tolerances import TOLERANCES

LATENT_SHAPES = ((16, 512, 64), (4, 128, 32), (3, 96, 16))  # (heads, latent_dim, rope_dim)
MAX_POOL = 256  # blocks: scattered ids, small enough for the reference


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per (block size, dtype) the platform declares, and per latent shape."""
    if "latent_case" not in metafunc.fixturenames:
        return
    name = metafunc.config.getoption("--device", default=None) or os.environ.get(DEVICE_ENV)
    platform = next((e.platform for e in discover_platforms() if e.name == name and e.platform is not None), None)
    if platform is None:  # the fixtures skip or fail with the reason
        metafunc.parametrize("latent_case", [None], ids=["unavailable"])
        return
    full = os.environ.get("PORTSIDE_CONFORMANCE_FULL") == "1"
    # every shape at the default block size; the smallest block size (rows split over more blocks)
    # with the odd shape only, unless PORTSIDE_CONFORMANCE_FULL asks for every size and shape
    small = min(platform.block_sizes)
    pairs = [(bs, shape) for bs in platform.block_sizes for shape in LATENT_SHAPES] if full else [
        *((platform.default_block_size, shape) for shape in LATENT_SHAPES),
        *([(small, LATENT_SHAPES[-1])] if small != platform.default_block_size else [])]  # fmt: skip
    cases = [(bs, dtype, shape) for bs, shape in pairs for dtype in platform.supported_dtypes]
    ids = [f"bs{bs}-{str(dtype).removeprefix('torch.')}-h{h}-l{latent}-r{rope}" for bs, dtype, (h, latent, rope) in cases]
    metafunc.parametrize("latent_case", cases, ids=ids)


def _backend(platform: type[Platform], dtype: torch.dtype, block_size: int) -> AttentionBackend:
    backend = platform.attention_backend(engine_config(platform, dtype, block_size))
    if not isinstance(backend, AttentionBackend):
        contract_failure("latent", f"attention_backend() returned a {type(backend).__name__}, not an AttentionBackend")
    return backend


def _run_batch(platform: type[Platform], backend: AttentionBackend, case, batch: str, requests, gen: torch.Generator) -> None:
    bs, dtype, (h, latent_dim, rope_dim) = case
    d = latent_dim + rope_dim
    device = platform.device(0)
    where = f"bs {bs}, {dtype}, heads {h}, latent {latent_dim} + rope {rope_dim}, batch {batch!r} {list(requests)}"
    requests = ordered(requests)
    needed = sum(-(-(c + n) // bs) for c, n in requests)
    pool = max(2 * needed + 1, min(MAX_POOL, 4 * needed + 8))
    tables = random_block_tables(requests, bs, pool, gen)

    cache = backend.allocate_kv_cache(backend.latent_cache_shape(pool, bs, d), dtype, device)
    noise = unused_slots(requests, tables, bs, pool, gen)
    with platform.inference_mode():
        backend.write_latent(cache, (100 * torch.randn(noise.numel(), d, generator=gen)).to(dtype).to(device),
                             noise.to(device))  # fmt: skip
    ref_cache = (100 * torch.randn(ref.latent_cache_shape(pool, bs, d), generator=gen)).to(dtype)

    if any(c for c, _ in requests):  # the cached prefixes, through the backend's own write_latent
        md = build_metadata(tuple((0, c) for c, _ in requests if c), [t for (c, _), t in zip(requests, tables) if c],
                            bs, torch.device("cpu"))  # fmt: skip
        rows = torch.randn(md.num_tokens, d, generator=gen).to(dtype)
        with platform.inference_mode():
            backend.write_latent(cache, rows.to(device), md.slot_mapping.to(device))
        ref.write_latent(ref_cache, rows, md.slot_mapping)

    md = build_metadata(requests, tables, bs, device)
    q = torch.randn(md.num_tokens, h, d, generator=gen).to(dtype)
    latent = torch.randn(md.num_tokens, d, generator=gen).to(dtype)
    scale = d**-0.5
    with platform.inference_mode():
        out = backend.latent_attention(q.to(device), latent.to(device), cache, backend.prepare(md), scale, latent_dim)
    platform.synchronize()
    expected = ref.latent_attention(q.float(), latent.float(), ref_cache.float(), on_cpu(md), scale, latent_dim)

    if out.shape != expected.shape or out.dtype != dtype:
        contract_failure("latent", f"latent_attention() returned {tuple(out.shape)} {out.dtype}; expected "
                         f"{tuple(expected.shape)} {dtype} ({where})")  # fmt: skip
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    err = (out.cpu().float() - expected).abs()
    bad = err > tol["atol"] + tol["rtol"] * expected.abs()
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        req = next(i for i in range(md.num_reqs) if md.query_start_loc_cpu[i + 1] > row)
        contract_failure("latent", f"latent_attention() differs from core's reference ({where}): {int(bad.sum())} of "
                         f"{bad.numel()} elements out of tolerance {tol}, max abs err {err.max().item():.3e}; first "
                         f"bad token {row} (request {req}, seq_len {md.seq_lens_cpu[req]})")  # fmt: skip
    back = backend.read_latent(cache, md.slot_mapping)
    if not torch.equal(back.cpu(), latent):
        contract_failure("latent", f"latent_attention() did not store the new rows at slot_mapping ({where})")


def test_latent_attention_matches_reference(conformance_platform: type[Platform], latent_case) -> None:
    bs, dtype, _ = latent_case
    backend = _backend(conformance_platform, dtype, bs)
    gen = torch.Generator().manual_seed(46)
    for batch, requests in batches(bs).items():
        _run_batch(conformance_platform, backend, latent_case, batch, requests, gen)


def test_write_latent_skips_padding(conformance_platform: type[Platform]) -> None:
    """Rows written at slots read back exactly; a slot of -1 (a padded token) writes nothing."""
    platform = conformance_platform
    bs = platform.default_block_size
    for dtype in platform.supported_dtypes:
        backend, device = _backend(platform, dtype, bs), platform.device(0)
        gen = torch.Generator().manual_seed(7)
        pool, d = 4, 80
        cache = backend.allocate_kv_cache(backend.latent_cache_shape(pool, bs, d), dtype, device)
        slots = torch.tensor([3, -1, bs + 1, -1, 4 * bs - 1], dtype=torch.int64)
        rows = torch.randn(len(slots), d, generator=gen).to(dtype)
        with platform.inference_mode():
            backend.write_latent(cache, rows.to(device), slots.to(device))
        platform.synchronize()
        every = backend.read_latent(cache, torch.arange(pool * bs, device=device)).cpu()
        want = torch.zeros(pool * bs, d, dtype=dtype)
        keep = slots >= 0
        want[slots[keep]] = rows[keep]
        if not torch.equal(every, want):
            contract_failure("latent", f"write_latent({list(slots.tolist())}) then read_latent of every slot differs "
                             f"from the rows at their slots and zeros elsewhere ({dtype}, block size {bs}); slot -1 "
                             "must write nothing")  # fmt: skip
