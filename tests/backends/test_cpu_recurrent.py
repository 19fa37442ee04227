"""The cpu backend's recurrent-layer kernels (`backends/cpu/recurrent.py`, `csrc/recurrent.cpp`)
against core's references (`portside.ops.recurrent`), through `CpuModelOps` as a model calls them.

Every call runs one ragged step: two decodes first, then prefill chunks with and without an
initial state, on slots out of order, with slots no request holds (they must stay as they were).
Chunks of 9 tokens run Mamba-2's row layout (fewer than 16 tokens), of 17 and 23 its transposed
one; shapes vary the head ratios (G = 1 and G = H; Hv / Hk = 1 and 2), kernel widths 2..4, and
sizes that are and are not whole vectors (the in-place state rows, the padded copies). The
reference is patched to raise while the cpu kernels run, so a test fails if a call silently took
it. Inputs are scaled so outputs are O(1).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from portside.backends.cpu import native_ops
from portside.contract import RecurrentMetadata
from portside.ops import recurrent as ref
from portside.testing.tolerances import TOLERANCES

if native_ops.unavailable_reason() is not None:
    pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}", allow_module_level=True)

from portside.backends.cpu.moe import CpuModelOps  # noqa: E402

# fp32: both sides compute in fp32, summing in other orders (and the kernels fuse multiply-adds)
# over up to 23 tokens of a recurrence: a few ulps of O(1) values. bf16 outputs: the table's
# (one bf16 rounding step may go the other way); the fp32 states of a bf16 step are fp32 sums.
TOL = {torch.float32: {"atol": 5e-5, "rtol": 5e-5}, torch.bfloat16: TOLERANCES[torch.bfloat16]}
KERNELS = ("causal_conv1d", "ssd_scan", "selective_scan", "gated_delta_rule")
REF = {name: getattr(ref, name) for name in KERNELS}
NUM_SLOTS = 9
# (tokens, slot, has initial state): decodes first; slots 2, 4, 7, 8 held by no request
BATCH = ((1, 5, True), (1, 1, True), (9, 6, False), (23, 3, True), (17, 0, False))


@pytest.fixture
def ops(monkeypatch):
    """`CpuModelOps` with core's references raising: every call must take the native kernels."""

    def refuse(*args, **kwargs):
        raise AssertionError("the cpu kernel fell back to core's reference")

    for name in KERNELS:
        monkeypatch.setattr(ref, name, refuse)
    return CpuModelOps()


def _md(batch=BATCH) -> RecurrentMetadata:
    qsl = [0]
    for n, _, _ in batch:
        qsl.append(qsl[-1] + n)
    slots, init = [s for _, s, _ in batch], [i for _, _, i in batch]
    return RecurrentMetadata(state_slots=torch.tensor(slots), has_initial_state=torch.tensor(init),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_start_loc_cpu=qsl,
                             state_slots_cpu=slots, has_initial_state_cpu=init,
                             num_decodes=sum(1 for n, _, _ in batch if n == 1))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g, scale=1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _check(got, want, dtype, what):
    tol = TOL[dtype]
    err = (got.float() - want.float()).abs().max().item()
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}\nmax abs err {err:.3e}")


def _check_states(got, want, initial, dtype, what):
    """Slots a request held: as the reference left them; the others: untouched, bit for bit."""
    held = sorted({s for _, s, _ in BATCH})
    free = [s for s in range(NUM_SLOTS) if s not in held]
    torch.testing.assert_close(got[free], initial[free], atol=0, rtol=0, msg=lambda m: f"{what}: a free slot changed: {m}")
    _check(got[held], want[held], dtype if got.dtype == torch.bfloat16 else torch.float32, f"{what} (state)")


def _strided(x: torch.Tensor) -> torch.Tensor:
    """x as a view into a wider tensor (rows further apart than their length, as a split projection's)."""
    wide = torch.zeros(x.shape[0], x[0].numel() + 3, dtype=x.dtype)
    wide[:, 1 : 1 + x[0].numel()] = x.reshape(x.shape[0], -1)
    return wide[:, 1 : 1 + x[0].numel()].unflatten(1, x.shape[1:])


DTYPES = (torch.float32, torch.bfloat16)
T = sum(n for n, _, _ in BATCH)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("C", "K", "bias", "activation"), [(37, 4, True, "silu"), (300, 3, False, "silu"),
                                                             (16, 2, True, None), (64, 4, False, None)])
def test_causal_conv1d(ops, dtype, C, K, bias, activation):
    g = _gen(C + K)
    x = _randn(T, C, g=g, dtype=dtype)
    w, b = _randn(C, K, g=g, scale=K**-0.5), _randn(C, g=g, scale=0.1) if bias else None
    state = _randn(NUM_SLOTS, C, K - 1, g=g)
    want_state, got_state = state.clone(), state.clone()
    want = REF["causal_conv1d"](x, w, b, want_state, _md(), activation)
    got = ops.causal_conv1d(_strided(x) if C == 37 else x, w, b, got_state, _md(), activation)
    assert got.dtype == dtype and got.shape == x.shape
    _check(got, want, dtype, "causal_conv1d")
    _check_states(got_state, want_state, state, dtype, "causal_conv1d")


def _ssd_inputs(H, P, G, N, dtype, seed=0):
    g = _gen(seed)
    x = _randn(T, H, P, g=g, dtype=dtype)
    dt = _randn(T, H, g=g)
    A = -torch.empty(H).uniform_(0.5, 2.0, generator=g)
    B, C = _randn(T, G, N, g=g, scale=N**-0.5, dtype=dtype), _randn(T, G, N, g=g, scale=N**-0.5, dtype=dtype)
    D, dt_bias = _randn(H, g=g), _randn(H, g=g, scale=0.5)
    return x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("H", "P", "G", "N"), [(4, 8, 1, 16), (4, 70, 4, 5), (6, 32, 2, 32), (2, 16, 1, 128)])
def test_ssd_scan(ops, dtype, H, P, G, N):
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(H, P, G, N, dtype)
    state = _randn(NUM_SLOTS, H, P, N, g=_gen(1))
    want_state, got_state = state.clone(), state.clone()
    want = REF["ssd_scan"](x, dt, A, B, C, want_state, _md(), D, dt_bias)
    got = ops.ssd_scan(_strided(x), dt, A, _strided(B), C, got_state, _md(), D, dt_bias)
    assert got.dtype == dtype and got.shape == x.shape
    _check(got, want, dtype, "ssd_scan")
    _check_states(got_state, want_state, state, dtype, "ssd_scan")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_ssd_scan_options_and_state_layouts(ops, state_dtype):
    """No D, no dt bias, a dt limit, dt without softplus; the state bf16, or a transposed view
    (strides, no unit last one): read and written where it is."""
    H, P, G, N = 4, 24, 2, 16
    x, dt, A, B, C, _, _ = _ssd_inputs(H, P, G, N, torch.float32, seed=3)
    base = _randn(NUM_SLOTS, H, N, P, g=_gen(4)).to(state_dtype)
    for limit, softplus in (((0.0, math.inf), True), ((0.2, 1.5), True), ((0.0, math.inf), False)):
        dts = dt if softplus else F.softplus(dt)
        state = base.transpose(2, 3)  # [slots, H, P, N], a view
        want_state, got_state = state.clone(), base.clone().transpose(2, 3)
        want = REF["ssd_scan"](x, dts, A, B, C, want_state, _md(), None, None, softplus, limit)
        got = ops.ssd_scan(x, dts, A, B, C, got_state, _md(), None, None, softplus, limit)
        _check(got, want, torch.float32, f"ssd_scan (limit {limit}, softplus {softplus})")
        _check_states(got_state, want_state, state, state_dtype, f"ssd_scan (limit {limit}, softplus {softplus})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("Dm", "N", "with_z", "with_D"), [(70, 16, True, True), (40, 5, False, True),
                                                            (130, 8, True, False)])
def test_selective_scan(ops, dtype, Dm, N, with_z, with_D):
    g = _gen(Dm + N)
    x, dt = _randn(T, Dm, g=g, dtype=dtype), _randn(T, Dm, g=g)
    A = -torch.empty(Dm, N).uniform_(0.5, 4.0, generator=g)
    B, C = _randn(T, N, g=g, scale=N**-0.5, dtype=dtype), _randn(T, N, g=g, scale=N**-0.5, dtype=dtype)
    D = _randn(Dm, g=g) if with_D else None
    z = _randn(T, Dm, g=g, dtype=dtype) if with_z else None
    dt_bias = _randn(Dm, g=g, scale=0.5)
    state = _randn(NUM_SLOTS, Dm, N, g=g)
    want_state, got_state = state.clone(), state.clone()
    want = REF["selective_scan"](x, dt, A, B, C, want_state, _md(), D, z, dt_bias)
    got = ops.selective_scan(_strided(x), dt, A, B, C, got_state, _md(), D, z, dt_bias)
    assert got.dtype == dtype and got.shape == x.shape
    _check(got, want, dtype, "selective_scan")
    _check_states(got_state, want_state, state, dtype, "selective_scan")


def _gdn_inputs(Hk, Hv, K, V, dtype, seed=0):
    g = _gen(seed)
    q, k = _randn(T, Hk, K, g=g, dtype=dtype), _randn(T, Hk, K, g=g, dtype=dtype)
    v = _randn(T, Hv, V, g=g, dtype=dtype)
    gate = F.logsigmoid(_randn(T, Hv, g=g) + 2.0)  # log decay in (-inf, 0), mostly near 0
    beta = torch.sigmoid(_randn(T, Hv, g=g))
    return q, k, v, gate, beta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("Hk", "Hv", "K", "V", "l2norm"), [(2, 2, 16, 40, True), (2, 4, 12, 33, True),
                                                             (2, 4, 64, 64, True), (1, 1, 32, 32, False)])
def test_gated_delta_rule(ops, dtype, Hk, Hv, K, V, l2norm):
    q, k, v, gate, beta = _gdn_inputs(Hk, Hv, K, V, dtype)
    if not l2norm:  # unnormalised keys: keep the delta rule's step small (stable)
        q, k = (F.normalize(t.float(), dim=-1).to(dtype) for t in (q, k))
    state = _randn(NUM_SLOTS, Hv, K, V, g=_gen(5), scale=0.1)
    want_state, got_state = state.clone(), state.clone()
    want = REF["gated_delta_rule"](q, k, v, gate, beta, want_state, _md(), K**-0.5, l2norm)
    got = ops.gated_delta_rule(_strided(q), k, v, gate, beta, got_state, _md(), K**-0.5, l2norm)
    assert got.dtype == dtype and got.shape == v.shape
    _check(got, want, dtype, "gated_delta_rule")
    _check_states(got_state, want_state, state, dtype, "gated_delta_rule")


def test_gated_delta_rule_bf16_state(ops):
    q, k, v, gate, beta = _gdn_inputs(2, 4, 32, 64, torch.bfloat16, seed=2)
    state = _randn(NUM_SLOTS, 4, 32, 64, g=_gen(6), scale=0.1, dtype=torch.bfloat16)
    want_state, got_state = state.clone(), state.clone()
    want = REF["gated_delta_rule"](q, k, v, gate, beta, want_state, _md(), 32**-0.5)
    got = ops.gated_delta_rule(q, k, v, gate, beta, got_state, _md(), 32**-0.5)
    _check(got, want, torch.bfloat16, "gated_delta_rule")
    _check_states(got_state, want_state, state, torch.bfloat16, "gated_delta_rule")


def test_a_slot_outside_the_state_is_refused(ops):
    """A slot past the state tensor is an error naming it, not a write outside it."""
    H, P, G, N = 2, 8, 1, 16
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(H, P, G, N, torch.float32)
    md = _md(BATCH[:-1] + ((17, NUM_SLOTS, False),))
    with pytest.raises(RuntimeError, match=f"state slot {NUM_SLOTS} outside"):
        ops.ssd_scan(x, dt, A, B, C, torch.zeros(NUM_SLOTS, H, P, N), md, D, dt_bias)


def test_unsupported_dtypes_take_the_reference():
    """fp16 activations (no native kernel) go to core's reference, which answers them."""
    H, P, G, N = 2, 8, 1, 16
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(H, P, G, N, torch.float16)
    state = torch.zeros(NUM_SLOTS, H, P, N)
    want_state = state.clone()
    want = REF["ssd_scan"](x, dt, A, B, C, want_state, _md(), D, dt_bias)
    got = CpuModelOps().ssd_scan(x, dt, A, B, C, state, _md(), D, dt_bias)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(state, want_state, atol=0, rtol=0)
