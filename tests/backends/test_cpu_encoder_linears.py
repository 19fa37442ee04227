"""The encoder models' dense layer with its residual add (`portside.model.bert_base.dense_add`)
under the cpu eager runner's mode (`backends/cpu/encoder_linears.py`): one oneDNN call with the
add as its post-op, equal to core's reference; what it cannot fuse runs the reference with its
linear still through the mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from portside.backends.cpu.eager_linears import EagerLinears, PackedWeights, prepack_unavailable_reason
from portside.model.bert_base import dense_add

pytestmark = pytest.mark.skipif(prepack_unavailable_reason() is not None, reason=str(prepack_unavailable_reason()))


class _OneDnnCalls(TorchDispatchMode):
    """Records oneDNN linear calls by kind (plain, binary add) and aten adds."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        if "_linear_pointwise" in name:
            self.calls.append("binary" if "binary" in name else str(args[3]))
        elif "aten.add" in name:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _weights(n_in: int, n_out: int, dtype: torch.dtype = torch.float32, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter((torch.randn(n_out, n_in, generator=gen) * 0.1).to(dtype), requires_grad=False)
    return w, (torch.randn(n_out, generator=gen) * 0.1).to(dtype)


@pytest.mark.parametrize("rows", [2, 37, 600])  # 37 and 600 are padded to oneDNN's row buckets
def test_dense_add_fused_matches_reference(rows):
    w, b = _weights(96, 64, seed=1)
    x, residual = torch.randn(rows, 96), torch.randn(rows, 64)
    want = dense_add(x, w, b, residual)
    with _OneDnnCalls() as seen, torch.inference_mode(), EagerLinears(False, PackedWeights(8)):
        got = dense_add(x, w, b, residual)
    assert seen.calls == ["binary"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_cannot_fuse_runs_the_reference_with_a_packed_linear():
    w, b = _weights(32, 48, seed=2)
    x = torch.randn(5, 32)
    with _OneDnnCalls() as seen, torch.inference_mode(), EagerLinears(False, PackedWeights(8)):
        wide = dense_add(x, w, b, torch.randn(1, 48))  # a broadcast residual
        one = dense_add(x[:1], w, b, torch.zeros(1, 48))  # one row
    assert seen.calls == ["none", "aten.add.Tensor", "aten.add.Tensor"]  # (one row: F.linear, its own kernel)
    assert wide.shape == (5, 48)
    torch.testing.assert_close(one, F.linear(x[:1], w, b))


def test_widened_bf16_weights_are_not_fused():
    w, b = _weights(32, 48, torch.bfloat16, seed=3)
    x, r = torch.randn(6, 32).to(torch.bfloat16), torch.randn(6, 48).to(torch.bfloat16)
    with _OneDnnCalls() as seen, torch.inference_mode(), EagerLinears(False, PackedWeights(8, widen_bf16=True)):
        got = dense_add(x, w, b, r)
    assert got.dtype == torch.bfloat16 and "binary" not in seen.calls
    torch.testing.assert_close(got, (F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16) + r),
                               rtol=1.6e-2, atol=1e-2)
