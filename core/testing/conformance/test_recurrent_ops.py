"""Recurrent-layer contract: the kernels of `Platform.model_ops()` for linear-attention and
state-space layers (`portside.contract.RecurrentKernels`: `causal_conv1d`, `ssd_scan`,
`selective_scan`, `gated_delta_rule`) equal core's references (`portside.ops.recurrent`), run in
fp32 on the CPU on the same rounded inputs, in every declared dtype, with states in the model's
dtype and (reduced-precision models) in fp32.

Each shape runs three steps: decodes alone (with and without an initial state), prefill chunks
alone (one token long to past 128 tokens, not multiples of a chunk), and decodes followed by
prefill chunks, the last with its inputs as strided views of one fused projection, as models
pass them. A fourth step holds speculative decoding's verify rows, which keep each token's state
in slots of their own (`RecurrentMetadata.token_state_slots_cpu`); it runs through
`kernels_for`, as models call the kernels, so an override that does not declare it
(`token_state_kernels`) is checked on the reference. Slots are scattered in a pool; the slots no
request holds must be left as they were, the inputs unchanged. A platform that overrides nothing
runs the references themselves and passes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from portside.contract import ModelOps, Platform, kernels_for
from portside.ops import recurrent as ref
from portside.testing.conformance.cases import (
    RECURRENT_TOLERANCES,
    contract_failure,
    conv_inputs,
    engine_config,
    gdr_inputs,
    recurrent_metadata,
    selective_inputs,
    ssd_inputs,
)

POOL = 12  # state slots, + 1 scratch
# name -> (lengths, has initial state, slots): decodes come first, as the runner orders them.
STEPS = {
    "decodes": ((1, 1, 1, 1), (True, False, True, True), (3, 0, 11, 5)),
    "prefills": ((150, 64, 7, 129, 2), (False, True, True, True, False), (3, 0, 5, 7, 10)),
    "mixed": ((1, 1, 1, 300, 3, 65), (True, False, True, True, False, True), (6, 3, 0, 5, 1, 11)),
    "verify": ((1, 1, 4, 30, 2), (True, True, True, True, True), (6, 3, 0, 5, 1)),
}
KEPT = {"verify": [[], [], [8, 9, 2], [], [4]]}  # the verify rows' per-token state slots
STRIDED = "mixed"  # this step's inputs are views of one fused tensor
CONV_SHAPES = ((256, 4), (96, 3), (64, 2))  # (channels, kernel width)
SSD_SHAPES = ((4, 1, 64, 128), (8, 2, 32, 64))  # (heads, groups, head dim, state size)
SELECTIVE_SHAPES = ((128, 16), (64, 8))  # (channels, state size)
GDR_SHAPES = ((2, 4, 128, 128, True), (2, 2, 64, 64, False))  # (key heads, value heads, K, V, l2-normalise q, k)


@pytest.fixture(scope="module")
def recurrent_ops(conformance_platform: type[Platform]) -> dict[torch.dtype, ModelOps]:
    """The platform's ModelOps for a model of each declared dtype."""
    platform, found = conformance_platform, {}
    for dtype in platform.supported_dtypes:
        ops = platform.model_ops(engine_config(platform, dtype, platform.default_block_size))
        if not isinstance(ops, ModelOps):
            contract_failure("recurrent", f"model_ops() returned a {type(ops).__name__}, not a ModelOps ({dtype})")
        found[dtype] = ops
    return found


def _state_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    return (dtype,) if dtype == torch.float32 else (dtype, torch.float32)


def _fused(parts: list[torch.Tensor], strided: bool) -> list[torch.Tensor]:
    """The per-token tensors as they are, or as views of one [T, sum of widths] tensor."""
    if not strided:
        return parts
    T = parts[0].shape[0]
    fused = torch.cat([p.reshape(T, -1) for p in parts], dim=1)
    views, at = [], 0
    for p in parts:
        width = p[0].numel()
        views.append(fused[:, at : at + width].view(p.shape))
        at += width
    return views


def _pool(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A state pool with every slot filled (slots of requests without an initial state hold a
    finished sequence's state, which a kernel must not read)."""
    return (torch.randn(POOL + 1, *shape, generator=gen) * 0.5).to(dtype)


def _compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = RECURRENT_TOLERANCES.get(dtype, RECURRENT_TOLERANCES[torch.bfloat16])
    err = (got.cpu().float() - want.float()).abs()
    bad = err > tol["atol"] + tol["rtol"] * want.float().abs()
    if bad.any():
        contract_failure("recurrent", f"{what} differs from core's reference: {int(bad.sum())} of {bad.numel()} "
                         f"elements out of tolerance {tol}, max abs err {err.max().item():.3e}")  # fmt: skip


def _run(ops: ModelOps, kernel: str, platform: type[Platform], dtype: torch.dtype, step: str, tokens: list[torch.Tensor],
         params: list[torch.Tensor | None], pools: list[torch.Tensor], call, what: str) -> None:
    """Calls `call(ops or None, tokens, params, pools, md)` on the platform (per-token inputs in
    `dtype` on its device, as views of one tensor in the strided step; parameters rounded to
    `dtype`, passed in fp32 as models keep them; `pools` as given) and on the reference (the same
    values in fp32, on the CPU), and compares the outputs, the touched slots, the untouched slots
    and the inputs."""
    lengths, init, slots = STEPS[step]
    device = platform.device(0)
    tokens = [t.to(dtype) for t in tokens]
    params = [None if t is None else t.to(dtype).float() for t in params]
    dev_tokens = _fused([t.to(device, copy=True) for t in tokens], step == STRIDED)
    dev_params = [None if t is None else t.to(device, copy=True) for t in params]
    originals = [t.clone() for t in dev_tokens + dev_params if t is not None]
    dev_pools = [p.to(device, copy=True) for p in pools]
    kept = KEPT.get(step)
    md = recurrent_metadata(list(lengths), list(slots), list(init), device, kept)
    got = call(kernels_for(ops, md), dev_tokens, dev_params, dev_pools, md)
    platform.synchronize()  # a lazy device (XLA) runs the step once, not again for every slot read below
    ref_pools = [p.to(torch.float32, copy=True) for p in pools]
    want = call(None, [t.float() for t in tokens], params, ref_pools,
                recurrent_metadata(list(lengths), list(slots), list(init), "cpu", kept))
    where = f"{type(ops).__name__}.{kernel} ({what}, step {step!r}: lengths {list(lengths)}, {dtype})"
    if got.shape != want.shape or got.dtype != dtype or got.device.type != device.type:
        contract_failure("recurrent", f"{where} returned {tuple(got.shape)} {got.dtype} on {got.device}; expected "
                         f"{tuple(want.shape)} {dtype} on {device}")  # fmt: skip
    _compare(got, want.to(dtype), dtype, f"{where} output")
    for n, (pool, before, want_pool) in enumerate(zip(dev_pools, pools, ref_pools)):
        if pool.dtype != before.dtype or pool.shape != before.shape:
            contract_failure("recurrent", f"{where} changed state tensor {n}'s dtype or shape")
        for slot in range(POOL + 1):
            if slot in slots or any(slot in k for k in kept or []):
                _compare(pool[slot], want_pool[slot], dtype, f"{where} state tensor {n}, slot {slot}")
            elif not torch.equal(pool[slot].cpu(), before[slot]):
                contract_failure("recurrent", f"{where} wrote state tensor {n}'s slot {slot}, which no request holds")
    if any(not torch.equal(t, o) for t, o in zip([t for t in dev_tokens + dev_params if t is not None], originals)):
        contract_failure("recurrent", f"{where} modified an input tensor")


def _ops_or_ref(ops: ModelOps | None):
    return ref if ops is None else ops


def test_causal_conv1d_matches_reference(conformance_platform: type[Platform], recurrent_ops) -> None:
    gen = torch.Generator().manual_seed(21)
    for dtype, ops in recurrent_ops.items():
        for (C, K), activation in zip(CONV_SHAPES, ("silu", None, "silu")):
            for step, (lengths, _, _) in STEPS.items():
                x, w, bias = conv_inputs(sum(lengths), C, K, gen)

                def call(o, t, p, pools, md, activation=activation):
                    return _ops_or_ref(o).causal_conv1d(t[0], p[0].to(t[0].dtype), p[1].to(t[0].dtype), pools[0], md,
                                                        activation)  # fmt: skip

                _run(ops, "causal_conv1d", conformance_platform, dtype, step, [x], [w, bias], [_pool((C, K - 1), dtype, gen)], call,
                     f"C={C}, K={K}, activation={activation!r}")  # fmt: skip


def test_ssd_scan_matches_reference(conformance_platform: type[Platform], recurrent_ops) -> None:
    gen = torch.Generator().manual_seed(22)
    for dtype, ops in recurrent_ops.items():
        for (H, G, P, N), limit in zip(SSD_SHAPES, ((0.0, math.inf), (0.05, 0.6))):
            for state_dtype in _state_dtypes(dtype):
                for step, (lengths, _, _) in STEPS.items():
                    x, dt, A, B, C, D, dt_bias = ssd_inputs(sum(lengths), H, G, P, N, gen)

                    def call(o, t, p, pools, md, limit=limit):
                        return _ops_or_ref(o).ssd_scan(t[0], t[1], p[0], t[2], t[3], pools[0], md, p[1], p[2], True, limit)

                    _run(ops, "ssd_scan", conformance_platform, dtype, step, [x, dt, B, C], [A, D, dt_bias],
                         [_pool((H, P, N), state_dtype, gen)], call,
                         f"H={H}, G={G}, P={P}, N={N}, dt_limit={limit}, state {state_dtype}")  # fmt: skip


def test_selective_scan_matches_reference(conformance_platform: type[Platform], recurrent_ops) -> None:
    gen = torch.Generator().manual_seed(23)
    for dtype, ops in recurrent_ops.items():
        for (Dm, N), gate in zip(SELECTIVE_SHAPES, (True, False)):
            for state_dtype in _state_dtypes(dtype):
                for step, (lengths, _, _) in STEPS.items():
                    x, dt, A, B, C, D, z, dt_bias = selective_inputs(sum(lengths), Dm, N, gen)

                    def call(o, t, p, pools, md, gate=gate):
                        return _ops_or_ref(o).selective_scan(t[0], t[1], p[0], t[2], t[3], pools[0], md, p[1],
                                                             t[4] if gate else None, p[2])  # fmt: skip

                    _run(ops, "selective_scan", conformance_platform, dtype, step, [x, dt, B, C, z], [A, D, dt_bias],
                         [_pool((Dm, N), state_dtype, gen)], call,
                         f"Dm={Dm}, N={N}, z={'given' if gate else None}, state {state_dtype}")  # fmt: skip


def test_gated_delta_rule_matches_reference(conformance_platform: type[Platform], recurrent_ops) -> None:
    gen = torch.Generator().manual_seed(24)
    for dtype, ops in recurrent_ops.items():
        for Hk, Hv, K, V, l2 in GDR_SHAPES:
            for state_dtype in _state_dtypes(dtype):
                for step, (lengths, _, _) in STEPS.items():
                    q, k, v, g, beta = gdr_inputs(sum(lengths), Hk, Hv, K, V, gen)
                    if not l2:  # the model normalises q and k itself
                        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)

                    def call(o, t, p, pools, md, l2=l2, K=K):
                        return _ops_or_ref(o).gated_delta_rule(*t, pools[0], md, K**-0.5, l2)

                    _run(ops, "gated_delta_rule", conformance_platform, dtype, step, [q, k, v, g, beta], [],
                         [_pool((Hv, K, V), state_dtype, gen)], call,
                         f"Hk={Hk}, Hv={Hv}, K={K}, V={V}, use_qk_l2norm={l2}, state {state_dtype}")  # fmt: skip
