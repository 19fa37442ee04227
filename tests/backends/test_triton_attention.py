"""Triton KV-cache write and paged attention vs the pure-torch reference.

Without a GPU these run in the Triton interpreter on CPU tensors (conftest sets TRITON_INTERPRET),
about 5 ms per program-iteration, so shapes are small but chosen to catch bugs: kv_len 1,
block_size and block_size + 1, ragged batches, GQA 1/4/8, head sizes 64/128 and 80/96 (the
padded path), random non-contiguous block tables from a large pool, mixed prefill + decode
batches, and the split-KV path. Cache slots that hold no token are NaN, so reading one shows.
The per-layer features (sliding window, logit softcap) are tested at the end, against the same
reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.attention import reference
from portside.contract import AttentionMetadata, ForwardContext

triton = pytest.importorskip("triton")

from portside.backends.triton import kv_cache as triton_kv  # noqa: E402  (after the interpreter is set)
from portside.backends.triton.attention import TritonAttentionBackend  # noqa: E402
from portside.backends.triton.graphs import StaticDecodeBatch  # noqa: E402
from portside.backends.triton.launch import ArchInfo, choose_attention_launch, detect_arch  # noqa: E402
from portside.backends.triton.paged_attention import paged_attention  # noqa: E402

pytestmark = pytest.mark.triton

POOL = 97  # KV blocks in the pool; tables draw from all of it, so ids are large and scattered


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D] (new tokens)
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, POOL, BS, KVH, D], holds the cached prefixes; NaN elsewhere
    metadata: AttentionMetadata


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Batch:
    """A batch whose request i computes its last q_lens[i] of seq_lens[i] tokens; decodes first."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    perm = torch.randperm(POOL, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    kv_cache = torch.full((2, POOL, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    slots, used = [], 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        n = -(-seq_len // block_size)
        tables[i, :n] = perm[used : used + n].int()
        used += n
        seq_slots = [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(seq_len)]
        cached = seq_len - q_len
        if cached:
            shape = (cached, num_kv_heads, head_size)
            k = torch.randn(shape, generator=gen).to(dtype)
            v = torch.randn(shape, generator=gen).to(dtype)
            reference.write_kv(kv_cache, k, v, torch.tensor(seq_slots[:cached]))
        slots += seq_slots[cached:]
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    num_decodes = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        num_decode_tokens=num_decodes,
    )
    to = lambda t: t.to(device)  # noqa: E731
    return Batch(to(query), to(key), to(value), to(kv_cache), metadata)


def expected_output(batch: Batch, scale: float, **features: object) -> torch.Tensor:
    """The reference on CPU: write the new K/V into a copy of the cache, then attend."""
    cache = batch.kv_cache.cpu().clone()
    md = batch.metadata
    reference.write_kv(cache, batch.key.cpu(), batch.value.cpu(), md.slot_mapping.cpu())
    return reference.paged_attention(
        batch.query.cpu(), cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables.cpu(), scale, **features
    )


def run_backend(batch: Batch, backend: TritonAttentionBackend, scale: float, **features: object) -> torch.Tensor:
    return backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, scale, **features).cpu()


# ---- KV-cache write ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_matches_reference_and_skips_padding(dtype: torch.dtype, kernel_device: torch.device) -> None:
    num_tokens, kvh, head, bs = 6, 2, 80, 16
    cache = torch.zeros(2, 9, bs, kvh, head, dtype=dtype, device=kernel_device)
    expected = cache.cpu().clone()
    key = torch.randn(num_tokens, kvh, head).to(dtype)
    value = torch.randn(num_tokens, kvh, head).to(dtype)
    slots = torch.tensor([5, 143, -1, 16, 17, -1])  # 143 = last slot of block 8; -1 = padding
    triton_kv.write_kv(cache, key.to(kernel_device), value.to(kernel_device), slots.to(kernel_device))
    reference.write_kv(expected, key, value, slots)
    assert torch.equal(cache.cpu(), expected)  # a copy: bit-exact, also for bf16
    k, v = TritonAttentionBackend().read_kv(cache, torch.tensor([143, 16], device=kernel_device))
    assert torch.equal(k.cpu(), key[[1, 3]]) and torch.equal(v.cpu(), value[[1, 3]])
    untouched = torch.ones(2, 9 * bs, dtype=torch.bool)
    untouched[:, [5, 143, 16, 17]] = False
    assert not cache.cpu().view(2, 9 * bs, kvh, head)[untouched].any()


# ---- paged attention ---------------------------------------------------------------------------

# (q_lens, seq_lens): decodes first, then prefill chunks (with and without a cached prefix).
DECODES_RAGGED = ([1, 1, 1, 1], [1, 16, 17, 33])  # kv_len 1, block_size, block_size + 1
MIXED = ([1, 1, 5, 19], [1, 17, 5, 36])  # a fresh prefill and a chunk after 17 cached tokens


@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(4, 4), (8, 2), pytest.param(16, 2, id="gqa8")],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("head_size", [64, 128])
def test_decode_gqa_and_head_sizes(num_heads: int, num_kv_heads: int, head_size: int, kernel_device) -> None:
    batch = make_batch(*DECODES_RAGGED, num_heads, num_kv_heads, head_size, 16, torch.float32, kernel_device)
    scale = head_size**-0.5
    assert_close(run_backend(batch, TritonAttentionBackend(), scale), expected_output(batch, scale))


@pytest.mark.parametrize("head_size", [80, 96])
def test_mixed_batch_padded_head_sizes(head_size: int, kernel_device) -> None:
    batch = make_batch(*MIXED, 8, 2, head_size, 16, torch.float32, kernel_device, seed=1)
    scale = head_size**-0.5
    assert_close(run_backend(batch, TritonAttentionBackend(), scale), expected_output(batch, scale))


@pytest.mark.parametrize("block_size", [32, 64])
def test_mixed_batch_block_sizes(block_size: int, kernel_device) -> None:
    q_lens, seq_lens = [1, 1, 3], [block_size, block_size + 1, block_size + 9]
    batch = make_batch(q_lens, seq_lens, 4, 1, 64, block_size, torch.float32, kernel_device, seed=2)
    assert_close(run_backend(batch, TritonAttentionBackend(), 0.125), expected_output(batch, 0.125))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_mixed_batch(dtype: torch.dtype, kernel_device) -> None:
    batch = make_batch(*MIXED, 8, 2, 64, 16, dtype, kernel_device, seed=3)
    out = run_backend(batch, TritonAttentionBackend(), 0.125)
    assert out.dtype == dtype
    assert_close(out, expected_output(batch, 0.125))


def test_prefill_only_gqa4_multiple_query_tiles(kernel_device) -> None:
    # 40 new tokens after 9 cached ones: several row tiles per request, causal inside each tile.
    batch = make_batch([40, 2], [49, 2], 4, 1, 64, 16, torch.float32, kernel_device, seed=4)
    assert_close(run_backend(batch, TritonAttentionBackend(), 0.125), expected_output(batch, 0.125))


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_decode(num_splits: int, kernel_device) -> None:
    # 5 splits over 3..6 tiles leaves some partitions empty: the reduce must weigh them zero.
    batch = make_batch([1, 1, 1], [1, 47, 90], 8, 2, 64, 16, torch.float32, kernel_device, seed=5)
    backend = TritonAttentionBackend(num_splits=num_splits)
    assert_close(run_backend(batch, backend, 0.125), expected_output(batch, 0.125))


def test_split_kv_mixed_batch_bf16(kernel_device) -> None:
    batch = make_batch(*MIXED, 4, 2, 96, 16, torch.bfloat16, kernel_device, seed=6)
    backend = TritonAttentionBackend(num_splits=3)
    assert_close(run_backend(batch, backend, 0.1), expected_output(batch, 0.1))


def test_split_kv_chosen_automatically_for_long_decodes(kernel_device) -> None:
    # A device with many SMs and one long decode: the heuristic splits the context.
    arch = ArchInfo(vendor="nvidia", num_sms=32, capability=(9, 0))
    batch = make_batch([1], [600], 2, 1, 64, 64, torch.float32, kernel_device, seed=7)
    backend = TritonAttentionBackend(arch=arch)
    from portside.backends.triton.launch import choose_num_splits

    assert choose_num_splits(arch, 1, 1, 1, 600, 64) > 1
    assert_close(run_backend(batch, backend, 0.125), expected_output(batch, 0.125))


def test_amd_launch_config_gives_same_result(kernel_device) -> None:
    amd = ArchInfo(vendor="amd", num_sms=304, warp_size=64, arch_name="gfx942")
    batch = make_batch(*MIXED, 8, 2, 64, 16, torch.float32, kernel_device, seed=8)
    assert choose_attention_launch(amd, 64, 4, 19, torch.float32).block_m == 32
    assert_close(run_backend(batch, TritonAttentionBackend(arch=amd), 0.125), expected_output(batch, 0.125))


def test_kernel_direct_call_leaves_cache_untouched(kernel_device) -> None:
    batch = make_batch(*DECODES_RAGGED, 4, 4, 64, 16, torch.float32, kernel_device, seed=9)
    md = batch.metadata
    reference.write_kv(batch.kv_cache, batch.key, batch.value, md.slot_mapping)
    before = batch.kv_cache.clone()
    launch = choose_attention_launch(detect_arch(kernel_device), 64, 1, 1, torch.float32)
    out = torch.empty_like(batch.query)
    paged_attention(batch.query, batch.kv_cache, out, md.query_start_loc, md.seq_lens, md.block_tables, 0.125, launch)
    expected = reference.paged_attention(
        batch.query.cpu(), before.cpu(), md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables.cpu(), 0.125
    )
    assert_close(out.cpu(), expected)
    assert torch.equal(batch.kv_cache.nan_to_num(7.0), before.nan_to_num(7.0))


# ---- graph buffers: padded decode batches give the eager result ----------------------------------


def test_padded_static_decode_batch_matches_eager(kernel_device) -> None:
    """The graph runner's padding (slot -1, seq_len 1 over a scratch block) run through the real
    kernel: rows [0, n) equal the unpadded batch and the padding writes nothing."""
    batch = make_batch([1, 1, 1], [3, 17, 30], 4, 2, 64, 16, torch.float32, kernel_device, seed=10)
    backend = TritonAttentionBackend()
    eager_cache = batch.kv_cache.clone()
    eager = backend.forward(batch.query, batch.key, batch.value, eager_cache, batch.metadata, 0.125)

    static = StaticDecodeBatch.allocate(
        max_size=8, max_blocks_per_seq=4, block_size=16, max_seq_len=64, device=kernel_device, scratch_block=0
    )
    static.input_ids[:] = 99  # stale values from an earlier step must not leak into padding
    static.seq_lens[:] = 50
    ids = torch.arange(3, device=kernel_device)
    positions = batch.metadata.seq_lens.long() - 1
    static.fill(ids, positions, batch.metadata, size=4)
    assert static.seq_lens[:4].tolist() == [3, 17, 30, 1]
    assert static.slot_mapping[:4].tolist()[3] == -1 and static.input_ids[3].item() == 0
    ctx = static.context(4, ForwardContext(backend, [batch.kv_cache], batch.metadata))
    q = torch.cat([batch.query, torch.randn(1, 4, 64, device=kernel_device)])
    k = torch.cat([batch.key, torch.randn(1, 2, 64, device=kernel_device)])
    v = torch.cat([batch.value, torch.randn(1, 2, 64, device=kernel_device)])
    padded = backend.forward(q, k, v, batch.kv_cache, ctx.metadata, 0.125)
    torch.testing.assert_close(padded[:3], eager)
    assert torch.equal(batch.kv_cache.nan_to_num(7.0), eager_cache.nan_to_num(7.0))


# ---- the full matrix: every supported head size x block size x GQA ratio ---------------------------


@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_mixed_batch_full_matrix(head_size: int, block_size: int, gqa: int, kernel_device) -> None:
    # decodes at kv_len 1, block_size, block_size + 1; a chunk crossing a block boundary.
    q_lens = [1, 1, 1, 4]
    seq_lens = [1, block_size, block_size + 1, block_size + 3]
    batch = make_batch(q_lens, seq_lens, gqa * 2, 2, head_size, block_size, torch.float32, kernel_device, seed=head_size)
    scale = head_size**-0.5
    assert_close(run_backend(batch, TritonAttentionBackend(), scale), expected_output(batch, scale))


# ---- per-layer features: sliding window and logit softcap ----------------------------------------


def hide_outside_window(batch: Batch, window: int) -> None:
    """NaN every cached key/value no query of its request can see (positions before the first
    query's window): the kernel must skip those blocks, and mask the rest of its first block."""
    md = batch.metadata
    bs = md.block_size
    for i, seq_len in enumerate(md.seq_lens_cpu):
        first_query = seq_len - (md.query_start_loc_cpu[i + 1] - md.query_start_loc_cpu[i])
        for p in range(max(0, first_query - window + 1)):
            batch.kv_cache[:, int(md.block_tables[i, p // bs]), p % bs] = float("nan")


def test_backend_declares_every_feature() -> None:
    from portside.contract import ATTENTION_FEATURES

    assert TritonAttentionBackend.features == frozenset(ATTENTION_FEATURES)  # no slow fallback, graphs work


@pytest.mark.parametrize("window", [1, 8, 16, 17, 40])
def test_sliding_window_decodes(window: int, kernel_device) -> None:
    # seq_lens 1, 16, 17, 33 against windows below, at and above them, and block boundaries.
    batch = make_batch(*DECODES_RAGGED, 8, 2, 64, 16, torch.float32, kernel_device, seed=20)
    expected = expected_output(batch, 0.125, sliding_window=window)
    hide_outside_window(batch, window)
    assert_close(run_backend(batch, TritonAttentionBackend(), 0.125, sliding_window=window), expected)


@pytest.mark.parametrize("window", [4, 16, 20])
def test_sliding_window_mixed_batch_with_cached_prefix(window: int, kernel_device) -> None:
    # a chunk of 19 after 17 cached tokens, and one of 20 after 40: two row tiles, each starting
    # its KV loop at its own first block (GQA 4: 16 tokens per tile).
    batch = make_batch([1, 1, 5, 19, 20], [1, 17, 5, 36, 60], 8, 2, 64, 16, torch.float32, kernel_device, seed=21)
    expected = expected_output(batch, 0.125, sliding_window=window)
    hide_outside_window(batch, window)
    assert_close(run_backend(batch, TritonAttentionBackend(), 0.125, sliding_window=window), expected)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_sliding_window_split_kv(num_splits: int, kernel_device) -> None:
    batch = make_batch([1, 1, 1], [5, 47, 90], 4, 1, 64, 16, torch.float32, kernel_device, seed=22)
    expected = expected_output(batch, 0.125, sliding_window=37)
    hide_outside_window(batch, 37)
    backend = TritonAttentionBackend(num_splits=num_splits)
    assert_close(run_backend(batch, backend, 0.125, sliding_window=37), expected)


def test_logit_softcap_mixed_batch(kernel_device) -> None:
    # scale 0.5 makes scores of a few units: a cap of 2 changes them a lot
    batch = make_batch(*MIXED, 8, 2, 64, 16, torch.float32, kernel_device, seed=23)
    expected = expected_output(batch, 0.5, logit_softcap=2.0)
    assert (expected - expected_output(batch, 0.5)).abs().max() > 0.1  # the cap matters here
    assert_close(run_backend(batch, TritonAttentionBackend(), 0.5, logit_softcap=2.0), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_and_softcap_together(dtype: torch.dtype, kernel_device) -> None:
    batch = make_batch([1, 1, 3, 21], [9, 40, 3, 50], 4, 2, 96, 32, dtype, kernel_device, seed=24)
    features = {"sliding_window": 24, "logit_softcap": 5.0}
    expected = expected_output(batch, 0.3, **features)
    hide_outside_window(batch, 24)
    out = run_backend(batch, TritonAttentionBackend(), 0.3, **features)
    assert out.dtype == dtype
    assert_close(out, expected)


def test_padded_static_decode_batch_with_features(kernel_device) -> None:
    """What a captured graph runs: the layer's features through the padded static buffers, via
    `ForwardContext.attention` (the backend's own kernel, not core's fallback)."""
    batch = make_batch([1, 1], [20, 35], 4, 2, 64, 16, torch.float32, kernel_device, seed=25)
    features = {"sliding_window": 10, "logit_softcap": 3.0}
    expected = expected_output(batch, 0.25, **features)
    static = StaticDecodeBatch.allocate(
        max_size=4, max_blocks_per_seq=4, block_size=16, max_seq_len=64, device=kernel_device, scratch_block=0
    )
    static.fill(torch.arange(2, device=kernel_device), batch.metadata.seq_lens.long() - 1, batch.metadata, size=4)
    ctx = static.context(4, ForwardContext(TritonAttentionBackend(), [batch.kv_cache], batch.metadata))
    pad = lambda t: torch.cat([t, torch.randn(2, *t.shape[1:], device=kernel_device)])  # noqa: E731
    out = ctx.attention(0, pad(batch.query), pad(batch.key), pad(batch.value), 0.25, **features)
    assert_close(out[:2].cpu(), expected)


def test_graph_runner_captures_nothing_when_a_feature_needs_the_fallback(kernel_device) -> None:
    from portside.backends.triton.graphs import DeviceGraphRunner, fallback_features
    from portside.config import EngineConfig, ModelConfig

    class WindowedModel:  # a PiecewiseModel as far as the check reads it
        num_layers = 2

        def attention_features(self, i: int) -> dict[str, object]:
            return {"sliding_window": 8 if i == 1 else None, "logit_softcap": None}

    class WithoutFeatures(TritonAttentionBackend):
        features = frozenset()

    model = WindowedModel()
    assert fallback_features(model, TritonAttentionBackend()) == set()
    assert fallback_features(model, WithoutFeatures()) == {"sliding_window"}
    batch = make_batch([1], [5], 4, 2, 64, 16, torch.float32, kernel_device)
    runner = DeviceGraphRunner(model, EngineConfig(model=ModelConfig(path="unused")), sizes=(1, 2))  # type: ignore[arg-type]
    runner.capture(lambda n: ForwardContext(WithoutFeatures(), [batch.kv_cache], batch.metadata))
    assert runner.captured_sizes == ()  # returned before any torch.cuda call: eager every step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_features_replay_in_a_cuda_graph(kernel_device) -> None:
    """A decode layer with a window and a softcap captured over the static buffers, replayed for
    a batch the capture never saw."""
    static = StaticDecodeBatch.allocate(
        max_size=4, max_blocks_per_seq=8, block_size=16, max_seq_len=128, device=kernel_device, scratch_block=0
    )
    first = make_batch([1, 1, 1], [3, 40, 90], 4, 2, 64, 16, torch.bfloat16, kernel_device, seed=26)
    second = make_batch([1, 1, 1, 1], [100, 17, 1, 64], 4, 2, 64, 16, torch.bfloat16, kernel_device, seed=27)
    features = {"sliding_window": 20, "logit_softcap": 4.0}
    expected = expected_output(second, 0.125, **features)
    cache, pristine = second.kv_cache, second.kv_cache.clone()  # the captured cache; `first` only shapes the capture
    q, k, v = (torch.zeros(4, *t.shape[1:], dtype=t.dtype, device=kernel_device) for t in (first.query, first.key, first.value))
    static.fill(torch.zeros(3, dtype=torch.int64, device=kernel_device), first.metadata.seq_lens.long() - 1, first.metadata, 4)
    ctx = static.context(4, ForwardContext(TritonAttentionBackend(), [cache], first.metadata))
    ctx.attention(0, q, k, v, 0.125, **features)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ctx.attention(0, q, k, v, 0.125, **features)
    cache.copy_(pristine)  # undo the warm-up's writes at first's slots
    static.fill(torch.zeros(4, dtype=torch.int64, device=kernel_device), second.metadata.seq_lens.long() - 1, second.metadata, 4)
    q.copy_(second.query), k.copy_(second.key), v.copy_(second.value)
    graph.replay()
    assert_close(out.cpu(), expected)


# ---- fp8 KV caches (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) ----------------------------------------

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_batch(batch: Batch, cache_dtype: torch.dtype) -> Batch:
    """`batch` over an fp8 cache holding its prefixes as `quantize_kv` stores them. Its empty
    slots become fp8 NaN bytes (0x7f), which the kernel decodes to NaN (e5m2) or 480 (e4m3): read,
    either shows."""
    from portside.contract import quantize_kv

    cache = quantize_kv(batch.kv_cache.cpu(), cache_dtype).to(batch.kv_cache.device)
    return Batch(batch.query, batch.key, batch.value, cache, batch.metadata)


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_write_kv_stores_the_reference_bytes(fmt: str, kernel_device: torch.device) -> None:
    cdt = FP8[fmt]
    cache = torch.zeros(2, 9, 16, 2, 64, dtype=torch.uint8, device=kernel_device).view(cdt)
    expected = torch.zeros(2, 9, 16, 2, 64, dtype=cdt)
    key = torch.randn(6, 2, 64) * 100  # past e4m3's 448 too: saturated
    value = torch.randn(6, 2, 64).bfloat16()
    slots = torch.tensor([5, 143, -1, 16, 17, -1])
    TritonAttentionBackend().write_kv(cache, key.to(kernel_device), value.to(kernel_device), slots.to(kernel_device))
    reference.write_kv(expected, key, value, slots)
    assert torch.equal(cache.cpu().view(torch.uint8), expected.view(torch.uint8))
    k, _ = TritonAttentionBackend().read_kv(cache, torch.tensor([143, 16], device=kernel_device))
    assert k.dtype == torch.float32 and torch.equal(k.cpu(), expected.view(2, -1, 2, 64)[0, [143, 16]].float())


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_mixed_batch(fmt: str, dtype: torch.dtype, kernel_device) -> None:
    batch = fp8_batch(make_batch(*MIXED, 8, 2, 64, 16, dtype, kernel_device, seed=40), FP8[fmt])
    expected = expected_output(batch, 0.125)
    assert_close(run_backend(batch, TritonAttentionBackend(), 0.125), expected.to(dtype), dtype=dtype)


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_cache_split_kv_decode_with_features(fmt: str, kernel_device) -> None:
    batch = fp8_batch(make_batch([1, 1, 1], [17, 70, 129], 4, 2, 128, 16, torch.float32, kernel_device, seed=41), FP8[fmt])
    for features in ({}, {"sliding_window": 20, "logit_softcap": 4.0}):
        expected = expected_output(batch, 0.1, **features)
        assert_close(run_backend(batch, TritonAttentionBackend(num_splits=3), 0.1, **features), expected)
