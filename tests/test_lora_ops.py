"""Core's multi-LoRA reference (`portside.ops.lora`) against a naive loop over tokens, and the
mapping's grouping (`segments`, `runs`) exactly."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.contract import LoRAMapping, ModelOps
from portside.ops.lora import lora_expand, lora_shrink


def naive_shrink(x: torch.Tensor, a: torch.Tensor, slots: list[int]) -> torch.Tensor:
    y = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            y[t] = a[s].double() @ x[t].double()
    return y


def naive_expand(y: torch.Tensor, b: torch.Tensor, slots: list[int], out: torch.Tensor, off: int) -> torch.Tensor:
    want = out.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            want[t, off : off + b.shape[1]] += b[s].double() @ y[t].double()
    return want


def _slots(kind: str, t: int, s: int, gen: torch.Generator) -> list[int]:
    if kind == "none":
        return [-1] * t
    if kind == "one":
        return [s - 1] * t
    return torch.randint(-1, s, (t,), generator=gen).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mixed", "one", "none"])
@pytest.mark.parametrize("t,s,r,k,n", [(1, 1, 8, 24, 40), (7, 3, 16, 33, 19), (29, 4, 8, 64, 72)])
def test_reference_matches_naive_loop(t: int, s: int, r: int, k: int, n: int, kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(t * 100 + s)
    slots = _slots(kind, t, s, gen)
    mapping = LoRAMapping(torch.tensor(slots, dtype=torch.int64), num_slots=s)
    x = torch.randn(t, k, generator=gen).to(dtype)
    a = (torch.randn(s, r, k, generator=gen) * k**-0.5).to(dtype)
    a[0, r // 2 :] = 0  # slot 0 holds an adapter of half the rank
    b = (torch.randn(s, n, r, generator=gen) * r**-0.5).to(dtype)

    y = lora_shrink(x, a, mapping)
    assert y.shape == (t, r) and y.dtype == dtype
    assert_close(y.double(), naive_shrink(x, a, slots), dtype)
    assert not y[torch.tensor(slots) < 0].any()

    wide = torch.randn(t, 3 * r, generator=gen).to(dtype)  # y as a column slice, as a fused qkv layer passes it
    y_view = wide[:, r : 2 * r]
    out = torch.randn(t, n + 10, generator=gen).to(dtype)
    before = out.clone()
    want = naive_expand(y_view, b, slots, out, 5)
    lora_expand(y_view, b, mapping, out, 5)
    assert_close(out.double(), want, dtype)
    untouched = torch.tensor(slots) < 0
    assert torch.equal(out[untouched], before[untouched])
    assert torch.equal(out[:, :5], before[:, :5]) and torch.equal(out[:, 5 + n :], before[:, 5 + n :])


def test_model_ops_defaults_are_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    mapping = LoRAMapping(torch.tensor([1, -1, 0, 1]), num_slots=2)
    x, a, b = torch.randn(4, 16, generator=gen), torch.randn(2, 8, 16, generator=gen), torch.randn(2, 12, 8, generator=gen)
    ops = ModelOps()
    y = ops.lora_shrink(x, a, mapping)
    assert torch.equal(y, lora_shrink(x, a, mapping))
    out, want = torch.zeros(4, 12), torch.zeros(4, 12)
    ops.lora_expand(y, b, mapping, out, 0)
    lora_expand(y, b, mapping, want, 0)
    assert torch.equal(out, want)


def test_segments_and_runs() -> None:
    mapping = LoRAMapping(torch.tensor([2, -1, 0, 2, -1, 0, 2]), num_slots=4)
    seg = mapping.segments()
    assert seg.order.tolist() == [2, 5, 0, 3, 6, 1, 4]  # slot 0, slot 2 (token order), then no adapter
    assert seg.starts.tolist() == [0, 2, 2, 5] and seg.counts.tolist() == [2, 0, 3, 0]
    assert seg.num_active.tolist() == [5]
    assert mapping.runs() == ((0, 0, 2), (2, 2, 3))
    assert mapping.any_active
    assert mapping.segments() is seg  # built once per step, shared by every layer
    assert mapping.cached("k", lambda: [1]) is mapping.cached("k", lambda: [2])

    idle = LoRAMapping(torch.full((3,), -1), num_slots=2)
    assert not idle.any_active and idle.runs() == () and idle.segments().num_active.tolist() == [0]
    empty = LoRAMapping(torch.zeros(0, dtype=torch.int64), num_slots=2)
    assert lora_shrink(torch.zeros(0, 8), torch.zeros(2, 4, 8), empty).shape == (0, 4)


def test_platforms_declare_lora_support() -> None:
    from portside.backends.cpu.platform import CpuPlatform
    from portside.backends.cuda.platform import CudaPlatform
    from portside.backends.rocm.platform import RocmPlatform
    from portside.backends.xla.platform import XlaPlatform

    assert CpuPlatform.supports_lora and CudaPlatform.supports_lora and RocmPlatform.supports_lora
    assert not XlaPlatform.supports_lora  # no static-shape kernel: the engine refuses enable_lora there
