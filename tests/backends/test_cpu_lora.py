"""The cpu backend's multi-LoRA (`portside.backends.cpu.lora`): the grouped eager path and its
opaque operators against core's reference, and a compiled layer tracing through the operators
(whole graph, no break) with the same result. The kit (`-k lora`) covers dtypes and shapes."""

from __future__ import annotations

import torch

from portside.backends.cpu.moe import CpuModelOps
from portside.contract import LoRAMapping, ModelOps
from portside.ops import lora as ref

SLOTS = [0, 2, -1, 2, 1, 0, -1]


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(7, 40, generator=gen), torch.randn(3, 16, 40, generator=gen), torch.randn(3, 12, 8, generator=gen)
    return x, a, b, torch.tensor(SLOTS)


def _layer(ops, x, a, b, slots, out, num_slots=3):  # noqa: ANN001, ANN202  (a fused layer: one shrink, two expands)
    mapping = LoRAMapping(slots, num_slots)
    y = ops.lora_shrink(x, a, mapping)
    ops.lora_expand(y[:, :8], b, mapping, out, 2)
    ops.lora_expand(y[:, 8:], b, mapping, out, 20)
    return out


def test_operators_match_reference_and_pass_opcheck() -> None:
    x, a, b, slots = _inputs()
    mapping = LoRAMapping(slots, 3)
    seg = mapping.segments()
    y = torch.ops.portside_cpu.lora_shrink(x, a, seg.order, seg.counts)
    torch.testing.assert_close(y, ref.lora_shrink(x, a, mapping))
    out = torch.randn(7, 30)
    want = out.clone()
    torch.ops.portside_cpu.lora_expand(y[:, 8:], b, seg.order, seg.counts, out, 5)
    ref.lora_expand(y[:, 8:], b, mapping, want, 5)
    torch.testing.assert_close(out, want)
    torch.library.opcheck(torch.ops.portside_cpu.lora_shrink.default, (x, a, seg.order, seg.counts))
    torch.library.opcheck(torch.ops.portside_cpu.lora_expand.default, (y[:, :8], b, seg.order, seg.counts, out, 3))


def test_compiled_layer_traces_through_the_operators() -> None:
    x, a, b, slots = _inputs()
    ops = CpuModelOps()
    want = _layer(ModelOps(), x, a, b, slots, torch.zeros(7, 40))
    torch.testing.assert_close(_layer(ops, x, a, b, slots, torch.zeros(7, 40)), want)
    compiled = torch.compile(lambda *args: _layer(ops, *args), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, a, b, slots, torch.zeros(7, 40)), want)


def test_plan_in_place_for_few_stretches_else_one_padded_batch_else_by_slot() -> None:
    from portside.backends.cpu.lora import plan

    requests = torch.tensor([-1] * 5 + [1] * 20 + [0] * 12 + [1] * 3)  # prefill chunks: 3 stretches
    scattered = torch.tensor([0, 1] * 20)  # 40 one-token stretches on 2 slots, 20 each
    uneven = torch.tensor([0, 1] * 20 + [0] * 180)  # 41 stretches; slot 0: 200 tokens, slot 1: 20
    assert plan(LoRAMapping(requests, 2)) == (True, ((1, 5, 20), (0, 25, 12), (1, 37, 3)), None)
    in_place, runs, padded = plan(LoRAMapping(scattered, 2))
    assert (in_place, runs) == (False, ((0, 0, 20), (1, 20, 20)))
    assert padded is not None and padded.slots == (0, 1) and padded.rows == 20 and padded.slot_index is None
    assert padded.gather.tolist() == list(range(0, 40, 2)) + list(range(1, 40, 2))
    assert padded.scatter.tolist() == [t // 2 + 20 * (t % 2) for t in range(40)]
    # padding slot 1 to 200 rows would add 180 rows to 220 tokens: by slot
    assert plan(LoRAMapping(uneven, 2)) == (False, ((0, 0, 200), (1, 200, 20)), None)
    gen = torch.Generator().manual_seed(1)
    x, a, b = torch.randn(40, 24, generator=gen), torch.randn(2, 16, 24, generator=gen), torch.randn(2, 12, 8, generator=gen)
    ops, ref_ops = CpuModelOps(), ModelOps()
    for slots in (requests, scattered):
        for dtype in (torch.float32, torch.bfloat16):
            args = (x.to(dtype), a.to(dtype), b.to(dtype), slots)
            got = _layer(ops, *args, torch.zeros(40, 40, dtype=dtype))
            torch.testing.assert_close(got, _layer(ref_ops, *args, torch.zeros(40, 40, dtype=dtype)))


def test_padded_batch_pads_short_slots_skips_tokens_without_adapter_and_gathers_scattered_slots() -> None:
    """The padded batch against the reference: slots of unequal counts (the short ones padded),
    tokens on no adapter among them (their rows untouched), slots in use that are not consecutive
    (gathered, not a view), fp32 and bf16, into a fused layer's column slices."""
    from portside.backends.cpu.lora import plan

    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([5, 1, -1, 3, 5, 1, 3, -1, 5, 1, 3, 5] * 6)  # 72 tokens: 24 on 5, 18 on 1 and 3, 12 none
    _, _, padded = plan(LoRAMapping(slots, 6))
    assert padded is not None and padded.slots == (1, 3, 5) and padded.rows == 24
    assert padded.slot_index is not None and padded.slot_index.tolist() == [1, 3, 5]
    x = torch.randn(72, 40, generator=gen)
    a, b = torch.randn(6, 16, 40, generator=gen), torch.randn(6, 12, 8, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        args = (x.to(dtype), a.to(dtype), b.to(dtype), slots)
        start = torch.randn(72, 40, generator=gen).to(dtype)
        got = _layer(CpuModelOps(), *args[:3], slots, start.clone(), num_slots=6)
        want = _layer(ModelOps(), *args[:3], slots, start.clone(), num_slots=6)
        torch.testing.assert_close(got, want)
        assert torch.equal(got[slots == -1], start[slots == -1])
