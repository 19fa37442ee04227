"""Attention contract: the platform's paged attention equals core's reference
(`portside.attention.reference`) over the standard shape set, for the declared block sizes and
dtypes, and its forward pass stores the new tokens' K/V at their slots."""

from __future__ import annotations

import os

import pytest
import torch

from portside.attention.reference import paged_attention
from portside.attention.reference import write_kv as reference_write_kv
from portside.backend_api import Platform
from portside.platform import discover_platforms
from portside.testing.conformance.cases import (
    AttentionCase,
    batches,
    build_metadata,
    contract_failure,
    engine_config,
    ordered,
    pool_size,
    random_block_tables,
    standard_cases,
)
from portside.testing.conformance.plugin import DEVICE_ENV
from portside.testing.tolerances import TOLERANCES


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per (block size, GQA, head size, dtype) the platform declares."""
    if "attention_case" not in metafunc.fixturenames:
        return
    name = metafunc.config.getoption("--device", default=None) or os.environ.get(DEVICE_ENV)
    platform = next((e.platform for e in discover_platforms() if e.name == name and e.platform is not None), None)
    if platform is None:  # the fixtures skip or fail with the reason
        metafunc.parametrize("attention_case", [None], ids=["unavailable"])
        return
    cases = standard_cases(platform.block_sizes, platform.supported_dtypes, platform.default_block_size)
    metafunc.parametrize("attention_case", cases, ids=[c.id for c in cases])


def _run_batch(platform: type[Platform], case: AttentionCase, batch: str, requests, gen: torch.Generator) -> None:
    where = f"{case.id}, batch {batch!r} (num_cached, num_new per request: {list(requests)})"
    device = platform.device(0)
    bs, h, kvh, d, dtype = case.block_size, case.num_heads, case.num_kv_heads, case.head_size, case.dtype
    backend = platform.attention_backend(engine_config(platform, dtype, bs))
    why = backend.supports(d, dtype, bs)
    if why is not None:
        pytest.skip(f"{backend.name} does not support {case.id}: {why}")
    requests = ordered(requests)
    needed = sum(-(-(c + n) // bs) for c, n in requests)
    pool = pool_size(needed, bs, kvh, d, dtype)
    tables = random_block_tables(requests, bs, pool, gen)

    # Both caches start as noise: a backend must read only the slots of the sequence.
    cache = torch.randn(backend.kv_cache_shape(pool, bs, kvh, d), generator=gen).to(dtype).to(device)
    ref_cache = torch.randn(2, pool, bs, kvh, d, generator=gen).to(dtype)

    # The cached prefix of every request, stored through the backend's own write_kv.
    if any(c for c, _ in requests):
        md = build_metadata(tuple((0, c) for c, _ in requests if c), [t for (c, _), t in zip(requests, tables) if c], bs, torch.device("cpu"))
        k = torch.randn(md.num_tokens, kvh, d, generator=gen).to(dtype)
        v = torch.randn(md.num_tokens, kvh, d, generator=gen).to(dtype)
        backend.write_kv(cache, k.to(device), v.to(device), md.slot_mapping.to(device))
        reference_write_kv(ref_cache, k, v, md.slot_mapping)

    md = build_metadata(requests, tables, bs, device)
    t = md.num_tokens
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    k = torch.randn(t, kvh, d, generator=gen).to(dtype)
    v = torch.randn(t, kvh, d, generator=gen).to(dtype)
    scale = d**-0.5
    with platform.inference_mode():
        out = backend.forward(q.to(device), k.to(device), v.to(device), cache, backend.prepare(md), scale)
    platform.synchronize()

    reference_write_kv(ref_cache, k, v, md.slot_mapping.cpu())
    expected = paged_attention(q, ref_cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables.cpu(), scale)
    if out.shape != expected.shape or out.dtype != dtype:
        contract_failure("attention", f"forward() returned {tuple(out.shape)} {out.dtype}; expected "
                         f"{tuple(expected.shape)} {dtype} ({where})")  # fmt: skip
    err = (out.cpu().float() - expected.float()).abs()
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    bad = err > tol["atol"] + tol["rtol"] * expected.float().abs()
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        req = next(i for i in range(md.num_reqs) if md.query_start_loc_cpu[i + 1] > row)
        contract_failure("attention", f"output differs from core's reference ({where}): {int(bad.sum())} of "
                         f"{bad.numel()} elements out of tolerance {tol}, max abs err {err.max().item():.3e}; first bad "
                         f"token {row} (request {req}, seq_len {md.seq_lens_cpu[req]})")  # fmt: skip

    # forward() must also have stored the new tokens' K/V.
    live = md.slot_mapping
    k_back, v_back = backend.read_kv(cache, live)
    if not (torch.equal(k_back.cpu(), k) and torch.equal(v_back.cpu(), v)):
        contract_failure("attention", f"forward() did not store the new tokens' K/V at slot_mapping ({where})")


def test_paged_attention_matches_reference(conformance_platform: type[Platform], attention_case: AttentionCase) -> None:
    gen = torch.Generator().manual_seed(1234)
    for batch, requests in batches(attention_case.block_size).items():
        _run_batch(conformance_platform, attention_case, batch, requests, gen)
