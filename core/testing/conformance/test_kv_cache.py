"""KV-cache contract: the shape holds exactly K and V for every slot, and write/read round-trip
(slot -1 skipped, nothing else touched), for every declared dtype and block size and every 8-bit
cache the platform declares (`Platform.kv_cache_dtypes`: quantized on write, so read back within
`KV_ROUND_TRIP`, and sized by `kv_row_bytes`)."""

from __future__ import annotations

import math

import torch

from portside.contract import Platform, dequantize_kv, is_quantized_kv, kv_cache_torch_dtype, kv_row_bytes
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


def _block_slots(ids: list[int], block_size: int) -> torch.Tensor:
    return (torch.tensor(ids)[:, None] * block_size + torch.arange(block_size)).reshape(-1)


def _crafted_rows(cdt: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Stored 8-bit rows of `shape` (last axis: a row) that quantizing their values again would
    change: int8 values within +-100 (a quantizer makes +-127 of the largest) and arbitrary fp32
    scales; fp8: finite random values."""
    if cdt == torch.int8:
        values = torch.randint(-100, 101, (*shape[:-1], shape[-1] - 4), generator=gen, dtype=torch.int8)
        scales = (torch.rand((*shape[:-1], 1), generator=gen) * 0.05 + 1e-3).view(torch.int8)
        return torch.cat([values, scales], dim=-1)
    return (torch.randn(shape, generator=gen) * 4).to(cdt)


def test_kv_block_layout_round_trips_8bit_blocks(conformance_platform: type[Platform]) -> None:
    """Each 8-bit cache the platform declares: a neutral block carries the stored rows (fp8
    values; int8 values and their fp32 scales, `quantize_kv`'s format), so it decodes to what the
    backend's `read_kv` returns, and a block written into other block ids reads back bit-exact
    (no second quantization) with the same values at its new slots, touching no other block."""
    from portside.contract import KVCacheSpec

    platform = conformance_platform
    device = platform.device(0)
    gen = torch.Generator().manual_seed(2)
    model = torch.float32 if torch.float32 in platform.supported_dtypes else platform.supported_dtypes[0]
    bs = platform.default_block_size
    for name in [n for n in getattr(platform, "kv_cache_dtypes", ("auto",)) if n != "auto"]:
        cdt = kv_cache_torch_dtype(name, model)
        backend = platform.attention_backend(engine_config(platform, model, bs, kv_cache_dtype=name))
        if backend.supports(HEAD_SIZE, model, bs) is not None:
            continue
        where = f"--kv-cache-dtype {name}, block_size={bs}"
        spec = KVCacheSpec(num_layers=2, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=model, cache_dtype=cdt)
        layout = platform.kv_block_layout(spec, bs)
        io = platform.kv_block_io(backend, layout)
        row = kv_row_bytes(HEAD_SIZE, cdt)
        if layout.block_bytes != spec.bytes_per_block(bs):
            contract_failure("kv-transfer", f"KVBlockLayout.block_bytes = {layout.block_bytes}, not the cache's "
                             f"{spec.bytes_per_block(bs)} bytes per block ({where})")
        shape = backend.cache_shape(NUM_BLOCKS, bs, NUM_KV_HEADS, HEAD_SIZE, cdt)
        src = [torch.zeros(shape, dtype=cdt, device=device) for _ in range(spec.num_layers)]
        ids, new_ids = [6, 1], [3, 8]
        slots, new_slots = _block_slots(ids, bs).to(device), _block_slots(new_ids, bs).to(device)
        for cache in src:
            k = 3 * torch.randn(slots.numel(), NUM_KV_HEADS, HEAD_SIZE, generator=gen)
            backend.write_kv(cache, k.to(model).to(device), torch.randn(k.shape, generator=gen).to(model).to(device), slots)
        raw = io.read(src, ids).reshape(len(ids), -1).view(torch.uint8).clone()
        if raw.shape[1] != layout.block_bytes:
            contract_failure("kv-transfer", f"a neutral block is {raw.shape[1]} bytes, block_bytes says "
                             f"{layout.block_bytes} ({where})")
        rows = raw.view(cdt).reshape(len(ids), spec.num_layers, 2, bs * NUM_KV_HEADS, row)
        for layer, cache in enumerate(src):
            for kv, got in enumerate(backend.read_kv(cache, slots)):
                want = dequantize_kv(rows[:, layer, kv].reshape(-1, NUM_KV_HEADS, row))
                if not torch.allclose(got.cpu().float(), want, rtol=1e-6, atol=0):
                    contract_failure("kv-transfer", f"layer {layer}'s neutral {'KV'[kv]} rows are not the backend's "
                                     f"stored values (and scales) in quantize_kv's format ({where}): read_stored_kv "
                                     "must return the rows as stored")
        dst = [torch.zeros(shape, dtype=cdt, device=device) for _ in range(spec.num_layers)]
        crafted = _crafted_rows(cdt, (len(ids), spec.num_layers, 2, bs * NUM_KV_HEADS, row), gen)
        io.write(dst, new_ids, crafted.reshape(len(ids), -1).view(torch.uint8))  # rows no quantizer of ours makes
        back = io.read(dst, new_ids).reshape(crafted.shape)
        if not torch.equal(back.view(torch.uint8), crafted.view(torch.uint8)):
            contract_failure("kv-transfer", f"kv_block_io: stored rows written and read back changed: quantized again "
                             f"rather than stored as they are ({where})")
        k, v = backend.read_kv(dst[1], new_slots)
        if not torch.allclose(v.cpu().float(), dequantize_kv(crafted[:, 1, 1].reshape(-1, NUM_KV_HEADS, row)),
                              rtol=1e-6, atol=0):
            contract_failure("kv-transfer", f"read_kv of written neutral rows is not their values ({where})")
        io.write(dst, new_ids, raw)
        if not torch.equal(io.read(dst, new_ids).reshape(len(ids), -1).view(torch.uint8), raw):
            contract_failure("kv-transfer", f"kv_block_io: 8-bit blocks written and read back are not bit-exact "
                             f"(quantized again?) ({where})")
        for layer in range(spec.num_layers):
            old, new = backend.read_kv(src[layer], slots), backend.read_kv(dst[layer], new_slots)
            if not all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(old, new)):
                contract_failure("kv-transfer", f"a restored 8-bit block does not read_kv as the saved one ({where})")
        others = [b for b in range(NUM_BLOCKS) if b not in new_ids]
        if io.read(dst, others).reshape(len(others), -1).view(torch.uint8).count_nonzero():
            contract_failure("kv-transfer", f"kv_block_io: write() touched blocks it was not given ({where})")


def test_kv_block_layout_round_trips_latent_and_draft_blocks(conformance_platform: type[Platform]) -> None:
    """A latent (MLA) model's blocks, carrying a speculative draft's K/V layer after them
    (`KVBlockLayout.draft`): the neutral bytes are the latent rows as `read_latent` returns them,
    then the draft's K/V, and blocks written into other block ids read back bit-equal there."""
    from portside.contract import KVCacheSpec, LatentKVCacheSpec

    platform = conformance_platform
    device = platform.device(0)
    gen = torch.Generator().manual_seed(3)
    dtype = platform.supported_dtypes[0]
    bs = platform.default_block_size
    backend = platform.attention_backend(engine_config(platform, dtype, bs))
    if backend.supports(HEAD_SIZE, dtype, bs) is not None:
        return
    width = 40  # latent 32 + rope 8
    target = LatentKVCacheSpec(num_layers=2, num_kv_heads=1, head_size=width, dtype=dtype, latent_dim=32)
    draft = KVCacheSpec(num_layers=1, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=dtype)
    layout = platform.kv_block_layout(target, bs).with_draft(platform.kv_block_layout(draft, bs))
    io = platform.kv_block_io(backend, layout)
    esize = torch.empty((), dtype=dtype).element_size()
    if layout.block_bytes != (target.num_layers * width + 2 * NUM_KV_HEADS * HEAD_SIZE) * bs * esize:
        contract_failure("kv-transfer", f"KVBlockLayout.block_bytes = {layout.block_bytes} for 2 latent layers of "
                         f"{width} values and a draft K/V layer, per token of {bs}")

    def caches() -> list[torch.Tensor]:
        latent = [torch.zeros(backend.latent_cache_shape(NUM_BLOCKS, bs, width), dtype=dtype, device=device)
                  for _ in range(target.num_layers)]
        return latent + [torch.zeros(backend.cache_shape(NUM_BLOCKS, bs, NUM_KV_HEADS, HEAD_SIZE, dtype), dtype=dtype,
                                     device=device)]

    src, ids, new_ids = caches(), [7, 2], [0, 5]
    n = len(ids)
    slots, new_slots = _block_slots(ids, bs).to(device), _block_slots(new_ids, bs).to(device)
    for cache in src[:-1]:
        backend.write_latent(cache, torch.randn(slots.numel(), width, generator=gen).to(dtype).to(device), slots)
    kv = [torch.randn(slots.numel(), NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype).to(device) for _ in range(2)]
    backend.write_kv(src[-1], kv[0], kv[1], slots)
    raw = io.read(src, ids).reshape(n, -1).view(torch.uint8).clone()
    own = layout.parts()[0].own_bytes
    rows = raw[:, :own].contiguous().view(dtype).reshape(n, target.num_layers, bs * width)
    for layer in range(target.num_layers):
        if not torch.equal(rows[:, layer].reshape(-1, width), backend.read_latent(src[layer], slots).cpu()):
            contract_failure("kv-transfer", f"layer {layer}'s neutral latent rows are not what read_latent returns")
    draft_rows = raw[:, own:].contiguous().view(dtype).reshape(n, 2, bs * NUM_KV_HEADS * HEAD_SIZE)
    if not all(torch.equal(draft_rows[:, i].reshape(-1, NUM_KV_HEADS, HEAD_SIZE), kv[i].cpu()) for i in range(2)):
        contract_failure("kv-transfer", "the draft's K/V is not after the target's layers in the neutral block")
    dst = caches()
    io.write(dst, new_ids, raw)
    if not torch.equal(io.read(dst, new_ids).reshape(n, -1).view(torch.uint8), raw):
        contract_failure("kv-transfer", "kv_block_io: latent + draft blocks written and read back are not bit-equal")
    if not torch.equal(backend.read_latent(dst[0], new_slots).cpu(), backend.read_latent(src[0], slots).cpu()):
        contract_failure("kv-transfer", "kv_block_io: a latent block's token t is not at slot block * block_size + t")
    if io.read(dst, [b for b in range(NUM_BLOCKS) if b not in new_ids]).count_nonzero():
        contract_failure("kv-transfer", "kv_block_io: write() touched blocks it was not given (latent + draft)")
