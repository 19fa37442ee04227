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
    buckets = {padded_rows(r) for r in range(2, CHUNK_ROWS + 1)}
    for rows in (2, 3, 17, 100, 511, 512, 513, 1100):
        x = torch.randn(rows, 64)
        for bias in (b, None):
            with Shapes() as seen:
                out = packed_linear(x, packed, bias)
            assert seen.rows <= buckets, (rows, seen.rows)
            assert out.shape == (rows, 48)
            torch.testing.assert_close(out, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)
