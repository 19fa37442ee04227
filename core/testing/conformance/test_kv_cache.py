"""KV-cache contract: the shape holds exactly K and V for every slot, and write/read round-trip
(slot -1 skipped, nothing else touched)."""

from __future__ import annotations

import math

import torch

from portside.backend_api import Platform
from portside.testing.conformance.cases import contract_failure, engine_config

NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE = 9, 2, 64


def _params(platform: type[Platform]) -> list[tuple[int, torch.dtype]]:
    return [(bs, dt) for dt in platform.supported_dtypes for bs in platform.block_sizes]


def test_kv_cache_round_trip(conformance_platform: type[Platform]) -> None:
    platform = conformance_platform
    device = platform.device(0)
    gen = torch.Generator().manual_seed(0)
    for block_size, dtype in _params(platform):
        where = f"block_size={block_size}, dtype={dtype}"
        backend = platform.attention_backend(engine_config(platform, dtype, block_size))
        if backend.supports(HEAD_SIZE, dtype, block_size) is not None:
            continue
        shape = backend.kv_cache_shape(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_SIZE)
        if not (isinstance(shape, tuple) and all(isinstance(s, int) for s in shape)):
            contract_failure("kv-cache", f"kv_cache_shape() must return a tuple of ints; got {shape!r}")
        expected = 2 * NUM_BLOCKS * block_size * NUM_KV_HEADS * HEAD_SIZE
        if math.prod(shape) != expected:
            contract_failure("kv-cache", f"kv_cache_shape{(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_SIZE)} = {shape} "
                             f"holds {math.prod(shape)} elements, not 2 * blocks * block_size * kv_heads * head_size = "
                             f"{expected}: core sizes the pool from KVCacheSpec and would over- or under-commit")  # fmt: skip
        cache = torch.zeros(shape, dtype=dtype, device=device)
        total = NUM_BLOCKS * block_size
        slots = torch.randperm(total, generator=gen)[: min(total, 3 * block_size + 5)]
        n = slots.numel()
        key = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        value = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        skip = torch.zeros(n, dtype=torch.bool)
        skip[::4] = True  # every 4th token is padding: slot -1, written nowhere
        mapping = torch.where(skip, torch.full_like(slots, -1), slots)
        backend.write_kv(cache, key.to(device), value.to(device), mapping.to(device))
        written = slots[~skip]
        k, v = backend.read_kv(cache, written.to(device))
        if k.shape != (written.numel(), NUM_KV_HEADS, HEAD_SIZE) or v.shape != k.shape:
            contract_failure("kv-cache", f"read_kv() returned shapes {tuple(k.shape)}, {tuple(v.shape)}; expected "
                             f"[{written.numel()}, {NUM_KV_HEADS}, {HEAD_SIZE}] ({where})")  # fmt: skip
        if not (torch.equal(k.cpu(), key[~skip]) and torch.equal(v.cpu(), value[~skip])):
            contract_failure("kv-cache", f"read_kv() does not return what write_kv() stored at the same slots ({where})")
        untouched = torch.ones(total, dtype=torch.bool)
        untouched[written] = False
        rest = torch.arange(total)[untouched]
        k_rest, v_rest = backend.read_kv(cache, rest.to(device))
        if k_rest.count_nonzero() or v_rest.count_nonzero():
            contract_failure("kv-cache", f"write_kv() wrote outside the given slots (slot -1 must be skipped) ({where})")
        if int(cache.count_nonzero()) != int(k.count_nonzero() + v.count_nonzero()):
            contract_failure("kv-cache", f"the cache holds data read_kv() cannot see: K/V landed outside their slots ({where})")
