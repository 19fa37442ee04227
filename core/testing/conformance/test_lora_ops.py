"""Multi-LoRA contract: the platform's `ModelOps.lora_shrink` / `lora_expand` equal core's
references (`portside.ops.lora`) in every declared dtype, as a fused qkv layer calls them: one
shrink over the stacked A matrices ([S, 3R, in]), then three expands, each from a column slice
of y (a strided view) into its columns of a wider output.

Shapes: T = 1, 5 and 37 tokens; 1 to 4 slots; ranks 8 and 16, some slots holding a smaller
adapter (A rows and B columns past its rank zero); in and N not multiples of 16. Slot maps: a
mix with tokens on no adapter (-1), every token on one slot, and no token on any. Tokens on no
adapter must get y rows of exactly 0 and output rows left exactly as they were, as must the
output's columns outside the expanded range. Tolerances: the dtype table
(`portside.testing.tolerances.TOLERANCES`) against the reference in fp32 on the same rounded
inputs. A platform that overrides nothing runs the references themselves and passes; one that
declares ``supports_lora = False`` is skipped.
"""

from __future__ import annotations

import pytest
import torch

from portside.contract import LoRAMapping, ModelOps, Platform
from portside.ops.lora import lora_expand, lora_shrink
from portside.testing.conformance.cases import contract_failure, engine_config
from portside.testing.tolerances import TOLERANCES

# (tokens T, slots S, max rank R, in, (N_q, N_k, N_v))
SHAPES = ((1, 1, 8, 40, (24, 8, 8)), (5, 2, 16, 72, (40, 24, 24)), (37, 4, 16, 100, (72, 40, 40)))
SLOT_MAPS = ("mixed", "one_slot", "no_adapter")


@pytest.fixture(scope="module")
def model_ops(conformance_platform: type[Platform]) -> dict[torch.dtype, ModelOps]:
    platform = conformance_platform
    if not platform.supports_lora:
        pytest.skip(f"the {platform.name} platform declares supports_lora = False")
    found = {}
    for dtype in platform.supported_dtypes:
        ops = platform.model_ops(engine_config(platform, dtype, platform.default_block_size))
        if not isinstance(ops, ModelOps):
            contract_failure("lora-ops", f"model_ops() returned a {type(ops).__name__}, not a ModelOps ({dtype})")
        found[dtype] = ops
    return found


def _slots(kind: str, t: int, s: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "no_adapter":
        return torch.full((t,), -1, dtype=torch.int64)
    if kind == "one_slot":
        return torch.full((t,), s - 1, dtype=torch.int64)
    slots = torch.randint(-1, s, (t,), generator=gen)
    if t > 1:
        slots[0], slots[-1] = -1, s - 1  # both kinds present
    return slots


def _adapters(s: int, r: int, k: int, ns: tuple[int, ...], gen: torch.Generator):
    """a [S, 3R, in] (q, k, v stacked) and one b [S, N, R] per projection, scaled so y and the
    deltas stay O(1); slot 0 holds an adapter of half the rank (zero padding)."""
    a = torch.randn(s, len(ns) * r, k, generator=gen) * k**-0.5
    bs = [torch.randn(s, n, r, generator=gen) * (0.5 * r**-0.5) for n in ns]
    a.view(s, len(ns), r, k)[0, :, r // 2 :] = 0
    for b in bs:
        b[0, :, r // 2 :] = 0
    return a, bs


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    got = got.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        contract_failure("lora-ops", f"{what} gave {tuple(got.shape)} {got.dtype}; expected {tuple(want.shape)} {want.dtype}")
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    err = (got.float() - want.float()).abs()
    bad = err > tol["atol"] + tol["rtol"] * want.float().abs()
    if bad.any():
        contract_failure("lora-ops", f"{what} differs from core's reference: {int(bad.sum())} of {bad.numel()} "
                         f"elements out of tolerance {tol}, max abs err {err.max().item():.3e}")  # fmt: skip


@pytest.mark.parametrize("kind", SLOT_MAPS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-S{s[1]}-R{s[2]}-in{s[3]}")
def test_lora_shrink_expand_match_reference(conformance_platform: type[Platform], model_ops, shape, kind: str) -> None:  # type: ignore[no-untyped-def]
    t, s, r, k, ns = shape
    device = conformance_platform.device(0)
    gen = torch.Generator().manual_seed(t * 10 + s)
    slots = _slots(kind, t, s, gen)
    a, bs = _adapters(s, r, k, ns, gen)
    x = torch.randn(t, k, generator=gen)
    pad = 3  # output columns before and after the three projections: must stay as they were
    out0 = torch.randn(t, sum(ns) + 2 * pad, generator=gen)
    host_map = LoRAMapping(slots, s)
    idle = slots < 0
    for dtype, ops in model_ops.items():
        where = f"T={t}, S={s}, R={r}, in={k}, N={ns}, slots={kind}, {dtype}"
        xd, ad, bd, outd = x.to(dtype), a.to(dtype), [b.to(dtype) for b in bs], out0.to(dtype)
        mapping = LoRAMapping(slots.to(device), s)

        y = ops.lora_shrink(xd.to(device), ad.to(device), mapping)
        want_y = lora_shrink(xd.float(), ad.float(), host_map).to(dtype)
        _check(y, want_y, dtype, f"{type(ops).__name__}.lora_shrink ({where})")
        if (y.cpu()[idle] != 0).any():
            contract_failure("lora-ops", f"lora_shrink gave nonzero rows for tokens without an adapter ({where})")

        out, want = outd.to(device, copy=True), outd.float().clone()  # (no aliases of outd: a CPU fp32 .to / .float is itself)
        off = pad
        for i, (b, n) in enumerate(zip(bd, ns, strict=True)):
            y_slice = y[:, i * r : (i + 1) * r]  # strided: row stride 3R
            ops.lora_expand(y_slice, b.to(device), mapping, out, off)
            lora_expand(y.cpu()[:, i * r : (i + 1) * r].float(), b.float(), host_map, want, off)
            off += n
        _check(out, want.to(dtype), dtype, f"{type(ops).__name__}.lora_expand x3 from y column slices ({where})")
        got = out.cpu()
        if not torch.equal(got[idle], outd[idle]):
            contract_failure("lora-ops", f"lora_expand changed output rows of tokens without an adapter ({where})")
        if not (torch.equal(got[:, :pad], outd[:, :pad]) and torch.equal(got[:, off:], outd[:, off:])):
            contract_failure("lora-ops", f"lora_expand wrote outside out[:, out_offset : out_offset + N] ({where})")
