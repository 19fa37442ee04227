"""cpu eager linears: oneDNN only ever sees a bounded set of row counts.

oneDNN keeps a primitive (about 0.6 MiB) per input shape in caches of 1024 entries; a server fed
its raw step sizes grew by megabytes a round (ci/bench/soak.py, ci/bench/results/soak.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from portside.backends.cpu.eager_linears import CHUNK_ROWS, packed_linear, padded_rows, prepack_unavailable_reason


def test_padded_rows_are_few_buckets_with_at_most_a_quarter_of_padding():
    buckets = {padded_rows(r) for r in range(1, CHUNK_ROWS + 1)}
    assert len(buckets) == 24 and max(buckets) == CHUNK_ROWS
    for r in range(1, CHUNK_ROWS + 1):
        p = padded_rows(r)
        assert p >= r and padded_rows(p) == p  # a bucket is its own bucket
        if r > 16:
            assert p - r <= r / 4


@pytest.mark.skipif(prepack_unavailable_reason() is not None, reason=str(prepack_unavailable_reason()))
def test_packed_linear_matches_f_linear_and_sends_only_bucket_shapes_to_onednn():
    class Shapes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "_linear_pointwise" in str(func):
                self.rows.add(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    w, b = torch.randn(48, 64), torch.randn(48)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    # up to CHUNK_ROWS the buckets, past it the next multiple of CHUNK_ROWS, in one call
    buckets = {padded_rows(r) for r in range(2, CHUNK_ROWS + 1)} | {2 * CHUNK_ROWS, 3 * CHUNK_ROWS}
    for rows in (2, 3, 17, 100, 511, 512, 513, 1100, 1536):
        x = torch.randn(rows, 64)
        for bias in (b, None):
            with Shapes() as seen:
                out = packed_linear(x, packed, bias)
            assert len(seen.rows) == 1 and seen.rows <= buckets, (rows, seen.rows)
            assert out.shape == (rows, 48)
            torch.testing.assert_close(out, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)


def _amx_op():
    from portside.backends.cpu import native_ops

    if native_ops.unavailable_reason() is not None:
        pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}")
    native_ops.load()
    return torch.ops.portside_cpu_native.linear_amx


@pytest.mark.parametrize(("rows", "k", "n", "bias"), [(2, 64, 16, False), (16, 576, 960, True), (64, 576, 576, False),
                                                       (5, 48, 20, True), (33, 100, 3072, False), (128, 1536, 97, True),
                                                       (1, 40, 8, False)])
def test_linear_amx_is_fp32_sums_rounded_once(rows, k, n, bias):
    """`portside_cpu_native::linear_amx`: the bf16 linear on AMX tiles (rows and channels padded
    to the tile sizes, the bias added in fp32) equals the fp32 sums of the same bf16 values rounded
    to bf16 once, up to one rounding step; on a CPU without AMX-BF16 it is `F.linear`."""
    op = _amx_op()
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    exact = F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    got = op(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got, exact, atol=1e-6, rtol=2 ** -7)
    strided = torch.randn(rows, 2 * k, generator=gen).bfloat16()[:, ::2]  # rows not dense: copied first
    torch.testing.assert_close(op(strided, w, b), F.linear(strided.float(), w.float(), None if b is None else b.float()).bfloat16(),
                               atol=1e-6, rtol=2 ** -7)


def test_linear_amx_repacks_a_new_weight_at_a_freed_ones_address():
    """Its tile-ordered copy of a weight is kept while the weight lives: a new weight allocated at a
    freed one's address (same shape) is packed again, not served the stale copy; and the fallbacks
    (fp32, more dimensions) are `F.linear`."""
    op = _amx_op()
    x = torch.randn(8, 64).bfloat16()
    addresses = []
    for v in [torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)).bfloat16() for seed in range(4)]:
        w = torch.empty_like(v).copy_(v)  # freed below: the next one of the same size may take its place
        addresses.append(w.data_ptr())
        torch.testing.assert_close(op(x, w, None), F.linear(x.float(), w.float()).bfloat16(), atol=1e-6, rtol=2 ** -7)
        del w
    assert len(set(addresses)) < len(addresses)  # an address was reused (else this test shows nothing)
    xf, wf = torch.randn(4, 64), torch.randn(32, 64)
    torch.testing.assert_close(op(xf, wf, None), F.linear(xf, wf))
    x3 = torch.randn(2, 4, 64).bfloat16()
    torch.testing.assert_close(op(x3, w := torch.randn(32, 64).bfloat16(), None), F.linear(x3, w))
