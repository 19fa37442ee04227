"""KV-cache contract: the shape holds exactly K and V for every slot, and write/read round-trip
(slot -1 skipped, nothing else touched), for every declared dtype and block size and every 8-bit
cache the platform declares (`Platform.kv_cache_dtypes`: quantized on write, so read back within
`KV_ROUND_TRIP`, and sized by `kv_row_bytes`)."""

from __future__ import annotations

import math

import torch

from portside.contract import Platform, is_quantized_kv, kv_cache_torch_dtype, kv_row_bytes
from portside.testing.conformance.cases import contract_failure, engine_config
from portside.testing.tolerances import kv_round_trip_bound

NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE = 9, 2, 64


def _params(platform: type[Platform]) -> list[tuple[int, torch.dtype, str]]:
    """(block size, model dtype, --kv-cache-dtype): every dtype with its own cache, then each
    declared 8-bit cache with an fp32 model (or the first declared dtype)."""
    params = [(bs, dt, "auto") for dt in platform.supported_dtypes for bs in platform.block_sizes]
    model = torch.float32 if torch.float32 in platform.supported_dtypes else platform.supported_dtypes[0]
    kv = [name for name in getattr(platform, "kv_cache_dtypes", ("auto",)) if name != "auto"]
    return params + [(bs, model, name) for name in kv for bs in platform.block_sizes]


def test_kv_cache_round_trip(conformance_platform: type[Platform]) -> None:
    platform = conformance_platform
    device = platform.device(0)
    gen = torch.Generator().manual_seed(0)
    for block_size, dtype, kv_name in _params(platform):
        cdt = kv_cache_torch_dtype(kv_name, dtype)
        quantized = is_quantized_kv(cdt)
        where = f"block_size={block_size}, dtype={dtype}" + (f", --kv-cache-dtype {kv_name}" if quantized else "")
        backend = platform.attention_backend(engine_config(platform, dtype, block_size, kv_cache_dtype=kv_name))
        if backend.supports(HEAD_SIZE, dtype, block_size) is not None:
            continue
        shape = backend.cache_shape(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_SIZE, cdt)
        if not (isinstance(shape, tuple) and all(isinstance(s, int) for s in shape)):
            contract_failure("kv-cache", f"kv_cache_shape() must return a tuple of ints; got {shape!r} ({where})")
        row = kv_row_bytes(HEAD_SIZE, cdt)
        expected = 2 * NUM_BLOCKS * block_size * NUM_KV_HEADS * row
        nbytes = math.prod(shape) * torch.empty((), dtype=cdt).element_size()
        if nbytes != expected:
            contract_failure("kv-cache", f"kv_cache_shape{(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_SIZE)} = {shape} "
                             f"holds {nbytes} bytes of {cdt}, not 2 * blocks * block_size * kv_heads * kv_row_bytes "
                             f"(head_size, {cdt}) = {expected}: core sizes the pool from KVCacheSpec and would over- or "
                             f"under-commit ({where})")  # fmt: skip
        cache = torch.zeros(shape, dtype=cdt, device=device)
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
        if quantized:
            same = all(bool(((back.cpu().float() - x.float()).abs() <= kv_round_trip_bound(x, cdt)).all())
                       for back, x in ((k, key[~skip]), (v, value[~skip])))
        else:
            same = torch.equal(k.cpu(), key[~skip]) and torch.equal(v.cpu(), value[~skip])
        if not same:
            contract_failure("kv-cache", f"read_kv() does not return what write_kv() stored at the same slots ({where})"
                             + (" within KV_ROUND_TRIP (one quantization step)" if quantized else ""))
        untouched = torch.ones(total, dtype=torch.bool)
        untouched[written] = False
        rest = torch.arange(total)[untouched]
        k_rest, v_rest = backend.read_kv(cache, rest.to(device))
        if k_rest.count_nonzero() or v_rest.count_nonzero():
            contract_failure("kv-cache", f"write_kv() wrote outside the given slots (slot -1 must be skipped) ({where})")
        if quantized:  # values and scales are the backend's bytes: at most the written rows' are set
            if int(cache.view(torch.uint8).count_nonzero()) > 2 * written.numel() * NUM_KV_HEADS * row:
                contract_failure("kv-cache", f"the cache holds more bytes than the written rows take: K/V landed "
                                 f"outside their slots ({where})")  # fmt: skip
        elif int(cache.count_nonzero()) != int(k.count_nonzero() + v.count_nonzero()):
            contract_failure("kv-cache", f"the cache holds data read_kv() cannot see: K/V landed outside their slots ({where})")


def test_kv_block_layout_round_trips_a_block(conformance_platform: type[Platform]) -> None:
    """`Platform.kv_block_layout` / `kv_block_io` (KV tiers and connectors): neutral blocks written
    into the backend's caches read back bit-equal, land at the right slots (`read_kv` sees them),
    touch no other block, and are `block_bytes` long; so blocks saved on one backend load on another."""
    from portside.contract import KVCacheSpec

    platform = conformance_platform
    device = platform.device(0)
    gen = torch.Generator().manual_seed(1)
    dtype = platform.supported_dtypes[0]
    block_size = platform.default_block_size
    backend = platform.attention_backend(engine_config(platform, dtype, block_size))
    if backend.supports(HEAD_SIZE, dtype, block_size) is not None:
        return
    spec = KVCacheSpec(num_layers=2, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=dtype)
    layout = platform.kv_block_layout(spec, block_size)
    io = platform.kv_block_io(backend, layout)
    shape = backend.cache_shape(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_SIZE, dtype)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
    ids = [7, 2, 5]
    blocks = torch.randn(len(ids), spec.num_layers, 2, block_size, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    io.write(caches, ids, blocks)
    back = io.read(caches, ids)
    if back.shape != blocks.shape or not torch.equal(back.cpu(), blocks):
        contract_failure("kv-transfer", f"kv_block_io: read() of blocks {ids} does not return what write() stored")
    if back[0].numel() * back.element_size() != layout.block_bytes:
        contract_failure("kv-transfer", f"a neutral block is {back[0].numel() * back.element_size()} bytes, "
                         f"KVBlockLayout.block_bytes says {layout.block_bytes}")
    slot = ids[1] * block_size + 3  # token 3 of the second block, layer 1, through the backend's own read_kv
    k, v = backend.read_kv(caches[1], torch.tensor([slot], device=device))
    if not (torch.equal(k[0].cpu().to(dtype), blocks[1, 1, 0, 3]) and torch.equal(v[0].cpu().to(dtype), blocks[1, 1, 1, 3])):
        contract_failure("kv-transfer", "kv_block_io: a block's token t of layer l is not at slot block * block_size + t")
    others = [b for b in range(NUM_BLOCKS) if b not in ids]
    if io.read(caches, others).count_nonzero():
        contract_failure("kv-transfer", "kv_block_io: write() touched blocks it was not given")
