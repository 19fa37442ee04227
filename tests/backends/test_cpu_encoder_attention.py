"""The cpu backend's encoder attention (`backends/cpu/encoder_attention.py`: SDPA over the
sequences batched by length) against core's reference."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.attention.reference import encoder_attention as reference
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.backends.cpu.encoder_attention import compute_dtype, encoder_attention, length_groups


def _inputs(lengths, heads, d, dtype, seed=0, fused=False):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    packed = torch.randn(sum(lengths), 3, heads, d, generator=gen).to(dtype)
    q, k, v = packed[:, 0], packed[:, 1], packed[:, 2]
    return (q, k, v, cu) if fused else (q.contiguous(), k.contiguous(), v.contiguous(), cu)


def _check(lengths, heads=4, d=64, dtype=torch.float32, fused=False, seed=0, fn=encoder_attention):
    q, k, v, cu = _inputs(lengths, heads, d, dtype, seed, fused)
    m = max(lengths, default=0)
    before = [x.clone() for x in (q, k, v)]
    out = fn(q, k, v, cu, m, d**-0.5)
    want = reference(q.float(), k.float(), v.float(), cu, m, d**-0.5).to(dtype)
    assert out.shape == q.shape and out.dtype == dtype
    assert all(torch.equal(x, b) for x, b in zip((q, k, v), before))
    assert_close(out, want, context=f"lengths {list(lengths)}, {heads} heads of {d}, {dtype}")


def test_encoder_length_groups():
    # runs of consecutive equal lengths; empty sequences dropped and breaking runs
    bounds = [0, 4, 8, 9, 13, 13, 17, 21]  # lengths 4, 4, 1, 4, 0, 4, 4
    assert length_groups(bounds) == {4: [(0, 2), (9, 1), (13, 2)], 1: [(8, 1)]}
    assert length_groups([0]) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [32, 64, 80])
def test_encoder_mixed_lengths_match_reference(head_size, dtype):
    _check((7, 100, 1, 64, 16, 64, 7), d=head_size, dtype=dtype, seed=head_size)


@pytest.mark.parametrize(
    "lengths",
    [(1,), (577,), (64,) * 6 + (16,) * 2, (16, 64, 16, 64, 16), (0, 3, 0, 3, 0), (32,) * 4, (0, 8, 8)],
    ids=["one_token", "one_image", "windows_then_edges", "interleaved", "with_empty", "equal", "equal_after_empty"],
)
def test_encoder_sequence_sets(lengths):
    _check(lengths, heads=2, d=64)


def test_encoder_fused_qkv_views():
    _check((7, 100, 1, 64, 16, 64), dtype=torch.bfloat16, fused=True, seed=5)
    _check((16,) * 5, fused=True, seed=6)  # one length: SDPA's output returned as it is


def test_encoder_equal_lengths_output_is_a_fresh_tensor():
    q, k, v, cu = _inputs((8, 8), 2, 16, torch.float32, fused=True)
    out = encoder_attention(q, k, v, cu, 8, 0.25)
    assert out.is_contiguous() and out.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()


def test_encoder_empty_batch_and_float64_fallback():
    e = torch.empty(0, 2, 8)
    assert encoder_attention(e, e, e, torch.zeros(1, dtype=torch.int32), 0, 1.0).shape == (0, 2, 8)
    q, k, v, cu = _inputs((3, 5), 2, 8, torch.float64)  # not an SDPA dtype here: the reference
    out = encoder_attention(q, k, v, cu, 5, 0.3)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(q, k, v, cu, 5, 0.3).double())


def test_encoder_compute_dtype():
    assert compute_dtype(torch.float32) == torch.float32
    from portside.backends.cpu.platform import has_native_bf16

    assert compute_dtype(torch.bfloat16) == (torch.bfloat16 if has_native_bf16() else torch.float32)


@pytest.mark.parametrize("backend", [CpuAttentionBackend, NativeAttentionBackend], ids=lambda b: b.__name__)
def test_encoder_through_the_backends(backend):
    _check((9, 30, 9), heads=3, d=80, dtype=torch.bfloat16, fn=backend().encoder_attention)
