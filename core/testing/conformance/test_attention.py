"""Attention contract: the platform's paged attention equals core's reference
(`portside.attention.reference`) over the standard shape set, for the declared block sizes and
dtypes, and its forward pass stores the new tokens' K/V at their slots.

The per-layer features (`ATTENTION_FEATURES`) are checked the way a model meets them, through
`ForwardContext.attention`: a feature the backend lists in `features` reaches its `forward` as a
keyword argument; any other runs core's fallback over the backend's `write_kv`/`read_kv`, which
must give the reference's result too (so a backend that implements no feature passes).

Each 8-bit KV-cache dtype the platform declares (`Platform.kv_cache_dtypes`) runs too (ids
ending `-kv_<dtype>`): the backend built for it must list it, its forward must match the
reference's attention over the reference's 8-bit cache within `KV_CACHE_TOLERANCES`, and what it
stored must read back within `KV_ROUND_TRIP`. Its pool starts zeroed (`allocate_kv_cache`) with
noise written through `write_kv` into slots the batch must not read.
"""

from __future__ import annotations

import os

import pytest
import torch

from portside.attention.reference import cache_shape as reference_cache_shape
from portside.attention.reference import paged_attention
from portside.attention.reference import write_kv as reference_write_kv
from portside.contract import ATTENTION_FEATURES, KV_CACHE_DTYPES, AttentionBackend, ForwardContext, Platform
from portside.platform import discover_platforms
from portside.testing.conformance.cases import (
    FEATURE_SETS,
    AttentionCase,
    batches,
    build_metadata,
    contract_failure,
    engine_config,
    feature_batches,
    feature_cases,
    feature_settings,
    kv_cache_cases,
    ordered,
    pool_size,
    random_block_tables,
    standard_cases,
    unused_slots,
)
from portside.testing.conformance.plugin import DEVICE_ENV
from portside.testing.tolerances import KV_CACHE_TOLERANCES, TOLERANCES, kv_round_trip_bound


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per (block size, GQA, head size, dtype) the platform declares, and per (feature
    set, case) for the features."""
    param = next((p for p in ("attention_case", "feature_case") if p in metafunc.fixturenames), None)
    if param is None:
        return
    name = metafunc.config.getoption("--device", default=None) or os.environ.get(DEVICE_ENV)
    platform = next((e.platform for e in discover_platforms() if e.name == name and e.platform is not None), None)
    if platform is None:  # the fixtures skip or fail with the reason
        metafunc.parametrize(param, [None], ids=["unavailable"])
        return
    declared = (platform.block_sizes, platform.supported_dtypes, platform.default_block_size)
    kv = (getattr(platform, "kv_cache_dtypes", ("auto",)), platform.supported_dtypes, platform.default_block_size)
    if param == "attention_case":
        cases = standard_cases(*declared) + kv_cache_cases(*kv)
        metafunc.parametrize(param, cases, ids=[c.id for c in cases])
    else:
        pairs = [(f, c) for f in FEATURE_SETS for c in feature_cases(*declared) + kv_cache_cases(*kv, features=True)]
        metafunc.parametrize(param, pairs, ids=[f"{f}-{c.id}" for f, c in pairs])


def _path(backend: AttentionBackend, features: dict[str, object]) -> str:
    """Which code `ForwardContext.attention` runs for these features (for failure messages)."""
    if not features:
        return "forward()"
    if features.keys() <= backend.features:
        return f"forward(**{features}) (the backend lists {sorted(features)} in `features`)"
    return (f"core's fallback for {features} over the backend's write_kv/read_kv (`features` lists only "
            f"{sorted(backend.features)})")  # fmt: skip


def _run_batch(platform: type[Platform], case: AttentionCase, batch: str, requests, gen: torch.Generator,
               features: dict[str, object] | None = None) -> None:  # fmt: skip
    features = features or {}
    device = platform.device(0)
    bs, h, kvh, d, dtype = case.block_size, case.num_heads, case.num_kv_heads, case.head_size, case.dtype
    cdt = case.cache_dtype
    backend = platform.attention_backend(engine_config(platform, dtype, bs, kv_cache_dtype=case.kv_cache_dtype))
    where = f"{case.id}, batch {batch!r} (num_cached, num_new per request: {list(requests)}), {_path(backend, features)}"
    if case.quantized and case.kv_cache_dtype not in backend.kv_cache_dtypes:
        contract_failure("attention", f"the platform declares --kv-cache-dtype {case.kv_cache_dtype} but the backend "
                         f"built for it, {backend.name}, lists only {sorted(backend.kv_cache_dtypes)} in kv_cache_dtypes")
    why = backend.supports(d, dtype, bs)
    if why is not None:
        pytest.skip(f"{backend.name} does not support {case.id}: {why}")
    requests = ordered(requests)
    needed = sum(-(-(c + n) // bs) for c, n in requests)
    pool = pool_size(needed, bs, kvh, d, cdt)
    tables = random_block_tables(requests, bs, pool, gen)

    if case.quantized:
        # An 8-bit cache starts zeroed, with noise (as the backend quantizes it) in the slots the
        # batch must not read; the reference's is its own 8-bit layout.
        cache = backend.allocate_kv_cache(backend.cache_shape(pool, bs, kvh, d, cdt), cdt, device)
        noise = unused_slots(requests, tables, bs, pool, gen)
        k = torch.randn(noise.numel(), kvh, d, generator=gen).to(dtype)
        backend.write_kv(cache, k.to(device), (2 * k).to(device), noise.to(device))
        ref_cache = torch.zeros(reference_cache_shape(pool, bs, kvh, d, cdt), dtype=cdt)
    else:
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
    ctx = ForwardContext(backend, [cache], backend.prepare(md))  # what a model's layer 0 gets
    on_device = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in features.items()}  # sinks
    with platform.inference_mode():
        out = ctx.attention(0, q.to(device), k.to(device), v.to(device), scale, **on_device)
    platform.synchronize()

    reference_write_kv(ref_cache, k, v, md.slot_mapping.cpu())
    expected = paged_attention(q, ref_cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables.cpu(), scale,
                               **features)  # type: ignore[arg-type]  # fmt: skip
    if out.shape != expected.shape or out.dtype != dtype:
        contract_failure("attention", f"forward() returned {tuple(out.shape)} {out.dtype}; expected "
                         f"{tuple(expected.shape)} {dtype} ({where})")  # fmt: skip
    err = (out.cpu().float() - expected.float()).abs()
    tol = KV_CACHE_TOLERANCES[cdt] if case.quantized else TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
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
    if case.quantized:
        stored = all(bool(((back.cpu().float() - x.float()).abs() <= kv_round_trip_bound(x, cdt)).all())
                     for back, x in ((k_back, k), (v_back, v)))
    else:
        stored = torch.equal(k_back.cpu(), k) and torch.equal(v_back.cpu(), v)
    if not stored:
        contract_failure("attention", f"forward() did not store the new tokens' K/V at slot_mapping ({where})")


def test_paged_attention_matches_reference(conformance_platform: type[Platform], attention_case: AttentionCase) -> None:
    gen = torch.Generator().manual_seed(1234)
    for batch, requests in batches(attention_case.block_size).items():
        _run_batch(conformance_platform, attention_case, batch, requests, gen)


def test_attention_features_match_reference(conformance_platform: type[Platform], feature_case) -> None:
    feature, case = feature_case
    gen = torch.Generator().manual_seed(4321)
    for features in feature_settings(feature, case.block_size, case.num_heads):
        for batch, requests in feature_batches(case.block_size).items():
            _run_batch(conformance_platform, case, batch, requests, gen, features)


def test_kv_cache_dtype_declarations(conformance_platform: type[Platform]) -> None:
    """`Platform.kv_cache_dtypes` and each backend's `kv_cache_dtypes` name canonical
    `KV_CACHE_DTYPES`, and the backend built for a declared 8-bit cache lists it."""
    platform = conformance_platform
    declared = tuple(getattr(platform, "kv_cache_dtypes", ("auto",)))
    canonical = set(KV_CACHE_DTYPES) - {"fp8"}
    if "auto" not in declared or set(declared) - canonical:
        contract_failure("attention", f"{platform.__name__}.kv_cache_dtypes = {declared}: must hold 'auto' and only "
                         f"canonical --kv-cache-dtype names {sorted(canonical)}")  # fmt: skip
    dtype = torch.float32 if torch.float32 in platform.supported_dtypes else platform.supported_dtypes[0]
    for name in declared:
        backend = platform.attention_backend(engine_config(platform, dtype, platform.default_block_size,
                                                           kv_cache_dtype=name))  # fmt: skip
        listed = set(backend.kv_cache_dtypes)
        if name not in listed or "auto" not in listed or listed - canonical:
            contract_failure("attention", f"with --kv-cache-dtype {name} the platform builds {backend.name}, whose "
                             f"kv_cache_dtypes {sorted(listed)} must hold 'auto' and {name!r} and only canonical names")


def test_attention_feature_declarations(conformance_platform: type[Platform]) -> None:
    platform = conformance_platform
    for dtype in platform.supported_dtypes:
        backend = platform.attention_backend(engine_config(platform, dtype, platform.default_block_size))
        listed, refused = backend.features, backend.unsupported_features
        unknown = (listed | refused) - set(ATTENTION_FEATURES)
        if unknown:
            contract_failure("attention", f"{backend.name} declares features {sorted(unknown)}, which are not "
                             f"ATTENTION_FEATURES {ATTENTION_FEATURES} ({dtype})")  # fmt: skip
        if listed & refused:
            contract_failure("attention", f"{backend.name} lists {sorted(listed & refused)} both in `features` "
                             f"and in `unsupported_features` ({dtype})")  # fmt: skip
