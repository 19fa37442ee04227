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
from portside.backend_api import AttentionBackend, AttentionMetadata, ForwardContext
from portside.backends.cpu import kernels
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.backends.cpu.ipex_attention import ipex_unavailable_reason

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


def test_native_falls_back_for_bf16():
    backend = _native_backend()
    case = make_case(backend, [1, 1, 4], [5, 30, 4], 4, 2, 64, 8, dtype=torch.bfloat16, seed=9)
    check(backend, case, torch.bfloat16)


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
