"""Triton multi-LoRA shrink/expand vs core's reference (`portside.ops.lora`).

Under the interpreter on CPU tensors (conftest sets TRITON_INTERPRET), so sizes are small: T = 1,
6 and 37 tokens over 1 to 3 slots (some tokens on none, a slot no token uses, every token on
one), rank 8 (padded in a 16-wide tile) and 16, in / N not multiples of the tiles, y a strided
column slice, fp32 / bf16 / fp16, and tiles small enough that a slot's tokens span several row
tiles.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.contract import LoRAMapping
from portside.ops import lora as ref

triton = pytest.importorskip("triton")

from portside.backends.triton.launch import ArchInfo, LoRALaunch, choose_lora_launch  # noqa: E402  (after the interpreter is set)
from portside.backends.triton.lora import lora_expand, lora_shrink  # noqa: E402
from portside.backends.triton.moe import TritonModelOps  # noqa: E402

pytestmark = pytest.mark.triton


def make_case(t: int, s: int, r: int, k: int, n: int, slots: list[int], dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(t * 7 + s)
    x = torch.randn(t, k, generator=gen).to(dtype)
    a = (torch.randn(s, 2 * r, k, generator=gen) * k**-0.5).to(dtype)  # two projections stacked
    b = (torch.randn(s, n, r, generator=gen) * (0.5 * r**-0.5)).to(dtype)
    out = torch.randn(t, n + 9, generator=gen).to(dtype)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    return [v.to(device) for v in (x, a, b, out)], LoRAMapping(slot_t.to(device), s), LoRAMapping(slot_t, s)


CASES = {
    "decode": (1, 1, 8, 40, 24, [0]),
    "unused-slot": (6, 3, 16, 72, 40, [2, -1, 0, 2, -1, 2]),
    "requests": (37, 2, 8, 100, 72, [-1] * 5 + [1] * 20 + [0] * 12),
    "one-slot": (37, 2, 16, 48, 24, [1] * 37),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,s,r,k,n,slots", CASES.values(), ids=CASES.keys())
def test_shrink_expand_match_reference(t, s, r, k, n, slots, dtype, kernel_device) -> None:  # type: ignore[no-untyped-def]
    (x, a, b, out), mapping, host_map = make_case(t, s, r, k, n, slots, dtype, kernel_device)
    ops = TritonModelOps()
    y = ops.lora_shrink(x, a, mapping)  # [T, 2R]
    assert y.shape == (t, 2 * r) and y.dtype == dtype
    want_y = ref.lora_shrink(x.cpu().float(), a.cpu().float(), host_map).to(dtype)
    assert_close(y.cpu(), want_y, context=f"shrink {t=} {s=} {r=}")
    idle = torch.tensor(slots) < 0
    assert not y.cpu()[idle].any()

    y2 = y[:, r:]  # the second projection's columns: row stride 2R
    before = out.cpu().clone()  # (.cpu() and .float() of a CPU fp32 tensor are the tensor itself)
    want = before.float().clone()
    ref.lora_expand(y2.cpu().float(), b.cpu().float(), host_map, want, 4)
    ops.lora_expand(y2, b, mapping, out, 4)
    got = out.cpu()
    assert_close(got, want.to(dtype), context=f"expand {t=} {s=} {r=}")
    assert torch.equal(got[idle], before[idle])
    assert torch.equal(got[:, :4], before[:, :4]) and torch.equal(got[:, 4 + n :], before[:, 4 + n :])


def test_small_tiles_span_a_slot(kernel_device) -> None:  # type: ignore[no-untyped-def]
    """16-row, 16-column tiles: slot 1's 20 tokens take two row tiles, N = 72 five column tiles."""
    (x, a, b, out), mapping, host_map = make_case(37, 2, 8, 100, 72, CASES["requests"][5], torch.float32, kernel_device)
    launch = LoRALaunch(16, 16, 16, 4, 1, "ieee", upcast=True)
    arch = ArchInfo(vendor="interpreter", num_sms=2)
    import portside.backends.triton.lora as tl_lora

    y = torch.zeros(37, 16, device=kernel_device)
    tl_lora._launch(x, a, y, mapping, False, launch)
    assert_close(y.cpu(), ref.lora_shrink(x.cpu(), a.cpu(), host_map))
    want = out.cpu().clone()
    ref.lora_expand(y.cpu()[:, :8], b.cpu(), host_map, want, 0)
    tl_lora._launch(y[:, :8], b, out[:, : b.shape[1]], mapping, True, launch)
    assert_close(out.cpu(), want)
    assert lora_shrink(x, a, LoRAMapping(torch.full((37,), -1, device=kernel_device), 2), arch).abs().sum() == 0


def test_expand_refuses_columns_outside_the_output(kernel_device) -> None:  # type: ignore[no-untyped-def]
    (x, a, b, out), mapping, _ = make_case(6, 3, 16, 72, 40, CASES["unused-slot"][5], torch.float32, kernel_device)
    with pytest.raises(ValueError, match="outside an output"):
        lora_expand(x[:, :16], b, mapping, out, 10)


def test_launch_choice() -> None:
    gpu = ArchInfo(vendor="nvidia", num_sms=132, capability=(9, 0))
    decode = choose_lora_launch(gpu, 64, 16, 16, 4096, torch.bfloat16)  # shrink: 4 tokens per slot
    assert (decode.block_m, decode.block_n, decode.block_k, decode.upcast) == (16, 16, 64, False)
    prefill = choose_lora_launch(gpu, 8192, 4, 4096, 16, torch.float32)  # expand
    assert (prefill.block_m, prefill.block_n, prefill.block_k, prefill.input_precision) == (64, 64, 16, "ieee")
