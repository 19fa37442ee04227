"""cpu paged attention (the torch path, the native C kernels, and IPEX's kernels in the ipex leg)
vs the reference.

Each case fills a backend's own cache layout through its `write_kv` and the reference's
canonical cache through `reference.write_kv` with the same prefix K/V, then attends a batch of
new tokens (decodes first, then prefill chunks). Shapes that catch bugs: kv_len 1, block_size and
block_size + 1, ragged batches, GQA 1/4/8, head sizes 64/128, random non-contiguous block
tables drawn from a large pool, slots of -1 (padding, skipped). Unused cache slots hold random
garbage (finite), so reading one shows.

The OpenVINO path (dense segments in OpenVINO, attention between them) is checked here against
the same model run eagerly over the reference attention backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.attention import reference
from portside.backends.cpu import kernels
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.backends.cpu.ipex_attention import ipex_unavailable_reason
from portside.contract import AttentionBackend, AttentionMetadata, ForwardContext

POOL = 67  # KV blocks in the pool; tables draw from all of it


def _ipex_backend() -> AttentionBackend:
    reason = ipex_unavailable_reason()
    if reason:
        if os.environ.get("PORTSIDE_REQUIRE_IPEX"):
            pytest.fail(f"the ipex leg needs IPEX: {reason}")
        pytest.skip(reason)
    from portside.backends.cpu.ipex_attention import IpexAttentionBackend

    return IpexAttentionBackend()


def _native_backend() -> AttentionBackend:
    reason = kernels.native_unavailable_reason()
    if reason:
        pytest.skip(f"native cpu kernels unavailable: {reason}")
    return NativeAttentionBackend()


BACKENDS = {"torch": CpuAttentionBackend, "native": _native_backend, "ipex": _ipex_backend}


@pytest.fixture(params=list(BACKENDS), ids=list(BACKENDS))
def backend(request) -> AttentionBackend:
    return BACKENDS[request.param]()


@dataclass
class Case:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D] new tokens
    value: torch.Tensor
    ref_cache: torch.Tensor  # canonical, prefixes written
    cache: torch.Tensor  # the backend's layout, prefixes written
    metadata: AttentionMetadata


def make_case(
    backend: AttentionBackend,
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    pad_tokens: int = 0,
) -> Case:
    """Request i computes its last q_lens[i] of seq_lens[i] tokens; decodes (q_len 1) come first.
    `pad_tokens` appends padding query rows whose slot is -1 (the batch's last request owns them)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    perm = torch.randperm(POOL, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // block_size)
        tables[i, :n] = perm[used : used + n]
        used += n
    ref_cache = torch.randn(2, POOL, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    cache = torch.randn(backend.kv_cache_shape(POOL, block_size, num_kv_heads, head_size), generator=gen).to(dtype)
    queries, keys, values, slots, qsl = [], [], [], [], [0]
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        slot_of = [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(s)]
        k = torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype)
        prefix = torch.tensor(slot_of[: s - q], dtype=torch.int64)
        reference.write_kv(ref_cache, k[: s - q], v[: s - q], prefix)
        backend.write_kv(cache, k[: s - q], v[: s - q], prefix)
        queries.append(torch.randn(q, num_heads, head_size, generator=gen).to(dtype))
        keys.append(k[s - q :])
        values.append(v[s - q :])
        slots += slot_of[s - q :]
        qsl.append(qsl[-1] + q)
    if pad_tokens:
        queries.append(torch.randn(pad_tokens, num_heads, head_size, generator=gen).to(dtype))
        keys.append(torch.randn(pad_tokens, num_kv_heads, head_size, generator=gen).to(dtype))
        values.append(torch.randn(pad_tokens, num_kv_heads, head_size, generator=gen).to(dtype))
        slots += [-1] * pad_tokens
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        num_decode_tokens=_num_decodes(q_lens),
    )
    return Case(torch.cat(queries), torch.cat(keys), torch.cat(values), ref_cache, cache, md)


def _num_decodes(q_lens: list[int]) -> int:
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    return n


def check(backend: AttentionBackend, case: Case, dtype: torch.dtype = torch.float32) -> None:
    md = case.metadata
    scale = case.query.shape[-1] ** -0.5
    num_real = md.query_start_loc_cpu[-1]
    _write_ref(case)
    expected = reference.paged_attention(
        case.query[:num_real], case.ref_cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, scale
    )
    md = backend.prepare(md)
    out = backend.forward(case.query, case.key, case.value, case.cache, md, scale)
    assert out.shape == case.query.shape
    assert_close(out[:num_real], expected, dtype)
    # every new token's K/V landed at its slot in the backend's own layout
    slots = md.slot_mapping[:num_real]
    k, v = backend.read_kv(case.cache, slots)
    assert_close(k, case.key[:num_real], dtype)
    assert_close(v, case.value[:num_real], dtype)


def _write_ref(case: Case) -> None:
    md = case.metadata
    num_real = md.query_start_loc_cpu[-1]
    reference.write_kv(case.ref_cache, case.key[:num_real], case.value[:num_real], md.slot_mapping[:num_real])


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("seq_len", [1, 2, "bs", "bs+1", 45])
def test_decode_lengths(backend, seq_len, block_size):
    s = {"bs": block_size, "bs+1": block_size + 1}.get(seq_len, seq_len)
    case = make_case(backend, [1, 1, 1], [s, 3, 2 * block_size + 3], 4, 2, 64, block_size)
    check(backend, case)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_size", [64, 128])
def test_gqa_and_head_sizes(backend, num_heads, num_kv_heads, head_size):
    case = make_case(backend, [1, 1, 5, 17], [9, 33, 5, 40], num_heads, num_kv_heads, head_size, 16, seed=1)
    check(backend, case)


def test_prefill_only_ragged(backend):
    case = make_case(backend, [16, 17, 3], [16, 17, 3], 4, 2, 64, 16, seed=2)
    check(backend, case)


def test_single_token_prefill_is_not_a_decode(backend):
    # a one-token prompt is scheduled like a decode (query_len 1, nothing cached)
    case = make_case(backend, [1, 4], [1, 20], 4, 2, 64, 8, seed=3)
    check(backend, case)


def test_chunked_prefill_over_cached_prefix(backend):
    case = make_case(backend, [1, 7, 16], [30, 50, 16], 8, 2, 64, 16, seed=4)
    check(backend, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_chunks_attend_in_runs_of_one_length(backend, dtype):
    """A request's first chunk attends over the step's own K/V (causal SDPA, no gather), each run
    of consecutive first chunks of one length in one call (`TorchAttentionPlan.causal_runs`): here
    three of 12 tokens, one of 5, a later chunk (over its cached prefix), two more of 12, after
    two decodes; every row matches the reference."""
    from portside.backends.cpu.attention import TorchAttentionPlan

    q_lens, seq_lens = [1, 1, 12, 12, 12, 5, 7, 12, 12], [9, 30, 12, 12, 12, 5, 40, 12, 12]
    case = make_case(backend, q_lens, seq_lens, 8, 2, 64, 16, dtype=dtype, seed=21)
    check(backend, case, dtype)
    plan = case.metadata.backend_data
    if isinstance(plan, TorchAttentionPlan):
        assert plan.causal_runs() == [(2, 3, 12, range(0, 3)), (38, 1, 5, range(3, 4)), (50, 2, 12, range(5, 7))]


@pytest.mark.parametrize(("seqs", "length", "heads", "kv_heads", "d"),
                         [(4, 128, 9, 3, 64), (3, 37, 8, 2, 128), (2, 5, 4, 4, 32), (1, 300, 6, 1, 256), (5, 17, 12, 4, 96)])
def test_native_causal_attention_matches_sdpa(seqs, length, heads, kv_heads, d):
    """`portside_cpu_native::causal_attention` (bf16 prompts attending to themselves on AMX tiles):
    lengths not a multiple of the 16-token tiles, GQA / MHA / MQA, head sizes 32..256 (96: a last
    channel group of 32), q/k/v as strided views of one fused projection; within bf16's tolerance
    of causal attention in fp32, and as close as torch's bf16 SDPA is."""
    _native_backend()  # skips without the native library
    from portside.backends.cpu.attention import native_causal

    if not native_causal(d):
        pytest.skip("no AMX-BF16 here (or the kernel does not grant the tile state)")
    gen = torch.Generator().manual_seed(seqs * 100 + d)
    qkv = torch.randn(seqs * length, (heads + 2 * kv_heads) * d, generator=gen).bfloat16()
    q = qkv[:, : heads * d].view(-1, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(-1, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(-1, kv_heads, d)

    def sdpa(q, k, v):
        def views(t):
            return t.view(seqs, length, *t.shape[1:]).transpose(1, 2)

        o = torch.nn.functional.scaled_dot_product_attention(views(q), views(k), views(v), is_causal=True, scale=d**-0.5,
                                                             enable_gqa=heads > kv_heads)
        return o.transpose(1, 2).reshape(q.shape)

    exact = sdpa(q.float(), k.float(), v.float())
    got = torch.ops.portside_cpu_native.causal_attention(q, k, v, seqs, d**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert_close(got.float(), exact, torch.bfloat16)
    torch_err = (sdpa(q, k, v).float() - exact).abs().max()
    assert (got.float() - exact).abs().max() <= 2 * torch_err + 1e-3


def test_padding_slots_are_skipped(backend):
    case = make_case(backend, [1, 1, 6], [5, 21, 6], 4, 2, 64, 8, seed=5, pad_tokens=3)
    check(backend, case)


def test_long_decode_batch(backend):
    lens = [1, 7, 64, 65, 200, 129, 33, 16]
    case = make_case(backend, [1] * len(lens), lens, 8, 2, 64, 16, seed=6)
    check(backend, case)


@pytest.mark.parametrize("lens", [[128], [129], [300], [1, 128, 257, 520]])
def test_decode_split_lengths(backend, lens):
    """Around the native kernel's 128-token splits (flash-decoding: one task per split, merged):
    a lone sequence, one a token past a split, several splits, and a batch of both kinds."""
    case = make_case(backend, [1] * len(lens), lens, 9, 3, 64, 16, seed=9)
    check(backend, case)


def test_forward_without_prepare_matches(backend):
    case = make_case(backend, [1, 5], [12, 9], 4, 2, 64, 8, seed=7)
    scale = 64**-0.5
    _write_ref(case)
    md = case.metadata
    expected = reference.paged_attention(case.query, case.ref_cache, md.query_start_loc_cpu, md.seq_lens_cpu,
                                         md.block_tables, scale)
    assert_close(backend.forward(case.query, case.key, case.value, case.cache, md, scale), expected)


# ---- the native path's own edges ----------------------------------------------------------------


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 6], [1, 1, 1, 1]], ids=["mixed", "decodes-only"])
def test_native_strided_query_and_kv_rows(q_lens):
    """q/k/v as views of one fused qkv projection (token stride > row), as the model hands them,
    in a mixed batch and in a decode-only one (the per-step `kernels.DecodeStep` path)."""
    backend = _native_backend()
    case = make_case(backend, q_lens, [9, 40, 17, 6], 8, 2, 64, 16, seed=8)
    h, kvh, d = 8, 2, 64
    qkv = torch.cat([case.query.flatten(1), case.key.flatten(1), case.value.flatten(1)], dim=1)
    q = qkv[:, : h * d].view(-1, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(-1, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(-1, kvh, d)
    assert not q.is_contiguous()
    check(backend, Case(q, k, v, case.ref_cache, case.cache, case.metadata))


def test_native_falls_back_for_fp16():
    backend = _native_backend()
    case = make_case(backend, [1, 1, 4], [5, 30, 4], 4, 2, 64, 8, dtype=torch.float16, seed=9)
    check(backend, case, torch.float16)


# ---- bf16 (a bf16 model's cache, kv_cache_dtype auto) in the native kernels ---------------------


@pytest.fixture
def no_torch_decodes(monkeypatch):
    """Fails a test whose decodes reach the torch path (`attention._decode`) instead of the kernels."""
    from portside.backends.cpu import attention

    def refuse(*args, **kwargs):
        raise AssertionError("a decode fell back to the torch path")

    monkeypatch.setattr(attention, "_decode", refuse)


BF16_SHAPES = {  # (num_heads, num_kv_heads, head_size)
    "mha-64": (4, 4, 64),
    "gqa4-80": (8, 2, 80),  # a head size that is not a multiple of 16
    "gqa3-128": (9, 3, 128),
    "mqa-128": (8, 1, 128),
}
BF16_BATCHES = {  # (q_lens, seq_lens), decodes first
    "decodes": ([1] * 7, [1, 15, 16, 17, 128, 129, 300]),  # block boundaries, the 128-token splits
    "mixed": ([1, 1, 1, 5, 17], [9, 33, 260, 5, 40]),  # decodes with prefill chunks (SDPA) in one batch
}


@pytest.mark.parametrize("batch", list(BF16_BATCHES))
@pytest.mark.parametrize("shape", list(BF16_SHAPES))
def test_native_bf16_matches_the_reference(shape, batch, no_torch_decodes):
    """bf16 queries / K / V over a bf16 cache: the kernels attend every decode (fp32 inside, the
    output rounded to bf16) within the bf16 tolerance of the reference, and write the new rows."""
    backend = _native_backend()
    heads, kv_heads, d = BF16_SHAPES[shape]
    q_lens, seq_lens = BF16_BATCHES[batch]
    case = make_case(backend, q_lens, seq_lens, heads, kv_heads, d, 16, dtype=torch.bfloat16, seed=11)
    check(backend, case, torch.bfloat16)


def test_native_bf16_padding_and_strided_rows(no_torch_decodes):
    """Slots of -1 skipped; q/k/v as views of one fused bf16 qkv projection."""
    backend = _native_backend()
    case = make_case(backend, [1, 1, 1, 6], [9, 40, 17, 6], 8, 2, 64, 16, dtype=torch.bfloat16, seed=12, pad_tokens=2)
    qkv = torch.cat([case.query.flatten(1), case.key.flatten(1), case.value.flatten(1)], dim=1)
    q = qkv[:, : 8 * 64].view(-1, 8, 64)
    k = qkv[:, 8 * 64 : 10 * 64].view(-1, 2, 64)
    v = qkv[:, 10 * 64 :].view(-1, 2, 64)
    check(backend, Case(q, k, v, case.ref_cache, case.cache, case.metadata), torch.bfloat16)


def _bf16_decode_inputs(seed: int, lens: list[int], heads: int = 9, kv_heads: int = 3, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    bs = 16
    n = -(-max(lens) // bs)
    num_blocks = len(lens) * n + 5
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g).bfloat16()
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * n].view(len(lens), n).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    slots = torch.tensor([int(tables[i, (s - 1) // bs]) * bs + (s - 1) % bs for i, s in enumerate(lens)])
    q = torch.randn(len(lens), heads, d, generator=g)
    k, v = torch.randn(len(lens), kv_heads, d, generator=g), torch.randn(len(lens), kv_heads, d, generator=g)
    return cache, tables, seq_lens, slots, q, k, v


def _reference_decodes(q, cache, tables, seq_lens, scale):
    qsl = list(range(len(seq_lens) + 1))
    return reference.paged_attention(q, cache, qsl, seq_lens.tolist(), tables, scale)


def test_native_fp32_queries_over_a_bf16_cache():
    """The fused step's case: fp32 queries and K/V rows over a bf16 cache. The rows are rounded to
    bf16 as torch rounds (to nearest even), the output is fp32 and matches fp32 attention over
    the bf16 values."""
    if kernels.native_unavailable_reason():
        pytest.skip("native cpu kernels unavailable")
    cache, tables, seq_lens, slots, q, k, v = _bf16_decode_inputs(13, [1, 16, 17, 129, 300])
    out = kernels.DecodeStep(tables, seq_lens, slots)(q, k, v, cache, 0.125)
    assert out.dtype == torch.float32
    flat = cache.view(2, -1, 3, 64)  # [2, slots, KVH, D]
    torch.testing.assert_close(flat[0, slots], k.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(flat[1, slots], v.bfloat16(), rtol=0, atol=0)
    expected = _reference_decodes(q, cache.float(), tables, seq_lens, 0.125)
    assert_close(out, expected, torch.float32)


def test_native_bf16_write_rounds_to_nearest_even():
    """fp32 rows into a bf16 cache: torch's rounding on ties (both directions), the largest finite
    values, subnormals, infinities and NaN."""
    if kernels.native_unavailable_reason():
        pytest.skip("native cpu kernels unavailable")
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF, 0x00008000, 0x80018000,
                         0x7F800000, 0xFF800000, 0x7FC00000, 0x3F800001, 0xBF818000, 0, 0x80000000, 0x00010000,
                         0x7F7F7FFF], dtype=torch.int64)  # fmt: skip
    x = bits.to(torch.int32).view(torch.float32).view(1, 1, 16)
    cache = torch.zeros(2, 1, 4, 1, 16, dtype=torch.bfloat16)
    kernels.write_kv(cache, x, -x, torch.tensor([2]))
    want = x.bfloat16().flatten()
    got_k, got_v = cache[0, 0, 2].flatten(), cache[1, 0, 2].flatten()
    nan = want.isnan()
    assert bool((got_k.isnan() == nan).all()) and bool((got_v.isnan() == nan).all())
    assert torch.equal(got_k[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(got_v[~nan].view(torch.int16), (-want)[~nan].view(torch.int16))


def test_native_bf16_attention_operator_runs_the_installed_plan():
    """`portside_cpu_native::attention` (the graphs' C++ front) over a bf16 cache: bf16 q/k/v are
    written and attended in C++, as `kernels.DecodeStep` does, and within the bf16 tolerance of
    the reference."""
    from portside.backends.cpu import native_ops

    if native_ops.unavailable_reason():
        pytest.skip("native operators unavailable")
    ops = torch.ops.portside_cpu_native
    cache, tables, seq_lens, slots, q, k, v = _bf16_decode_inputs(14, [200, 37, 1])
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    caches = [cache.clone(), cache]
    expected_cache = cache.clone()
    expected = kernels.DecodeStep(tables, seq_lens, slots)(q, k, v, expected_cache, 0.125)
    assert expected.dtype == torch.bfloat16
    ops.set_decode_step(caches, tables, seq_lens, slots)
    try:
        out = ops.attention(q, k, v, 1, 0.125)
    finally:
        ops.clear_decode_step()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(caches[1], expected_cache, rtol=0, atol=0)
    assert_close(out, _reference_decodes(q, expected_cache, tables, seq_lens, 0.125), torch.bfloat16)


def test_native_rejects_block_ids_outside_the_cache():
    backend = _native_backend()
    case = make_case(backend, [1, 1], [5, 20], 4, 2, 64, 8, seed=10)
    case.metadata.block_tables[1, 1] = POOL  # one past the end
    with pytest.raises(ValueError, match="block id outside the cache"):
        backend.forward(case.query, case.key, case.value, case.cache, backend.prepare(case.metadata), 0.125)


# ---- the OpenVINO path ---------------------------------------------------------------------------


@pytest.mark.slow
def test_openvino_segments_match_eager_reference(tiny_llama):
    """The OpenVINO runner's hidden states equal the eager model over the reference attention,
    for a mixed decode + prefill-chunk batch through a paged cache."""
    pytest.importorskip("openvino")
    from portside.backends.cpu.openvino_runner import OpenVinoGraphRunner
    from portside.config import ModelConfig
    from portside.model.registry import load_model

    model = load_model(ModelConfig(path=str(tiny_llama), dtype=torch.float32, max_model_len=256), torch.device("cpu"))
    spec = model.kv_cache_spec()
    ref_backend, cpu_backend = reference.ReferenceAttentionBackend(), CpuAttentionBackend()
    runner = OpenVinoGraphRunner(model, None)
    block_size = 8
    for step, (q_lens, seq_lens) in enumerate([([5, 9], [5, 9]), ([1, 1, 4], [6, 10, 4]), ([1, 3], [7, 7])]):
        if step == 0:
            shape = (2, POOL, block_size, spec.num_kv_heads, spec.head_size)
            ref_caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
            ov_caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
            tables = torch.randperm(POOL, generator=torch.Generator().manual_seed(0))[:12].view(3, 4).int()
        slots, positions, qsl = [], [], [0]
        for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
            for p in range(s - q, s):
                slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
                positions.append(p)
            qsl.append(qsl[-1] + q)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables[: len(q_lens)],
            max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=block_size,
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, num_decode_tokens=_num_decodes(q_lens),
        )  # fmt: skip
        ids = torch.randint(0, model.config.vocab_size, (len(slots),), generator=torch.Generator().manual_seed(step))
        pos = torch.tensor(positions)
        with torch.inference_mode():
            expected = model.forward(ids, pos, ForwardContext(ref_backend, ref_caches, md))
            got = runner(ids, pos, ForwardContext(cpu_backend, ov_caches, cpu_backend.prepare(md)))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert runner.num_ov_calls == 3 * (spec.num_layers + 1)
