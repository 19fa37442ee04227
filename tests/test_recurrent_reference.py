"""Core's recurrent-layer references (`portside.ops.recurrent`: causal conv1d, the Mamba-2 and
Mamba-1 scans, the gated delta rule) against a naive oracle written here (token by token, in
float64), and the gated delta rule against transformers' own torch implementations (Qwen3-Next).

The references batch the decodes of a step and run each prefill chunk in a chunked form; the
oracle is the recurrence itself. Batches are ragged, decodes first, with and without an initial
state, in non-contiguous slots (the others must be left as they were, bit for bit), with prompts
shorter than, equal to, longer than and not a multiple of the chunk length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from portside.ops import recurrent as ref
from portside.testing.conformance.cases import conv_inputs, gdr_inputs, recurrent_metadata, selective_inputs, ssd_inputs

NUM_SLOTS = 8  # + 1 scratch slot, as the runner allocates
# Reference (fp32 math, chunked) against the float64 oracle on the same inputs; bf16: the inputs
# and the output are bf16 (the oracle reads the same rounded inputs), so one bf16 rounding of
# the output plus the state's rounding where the state is bf16.
TOL = {
    torch.float32: {"atol": 2e-6, "rtol": 2e-6},
    torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3},
}


@dataclass(frozen=True)
class Batch:
    lengths: tuple[int, ...]
    has_initial: tuple[bool, ...]
    slots: tuple[int, ...]

    @property
    def starts(self) -> list[int]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def md(self):
        return recurrent_metadata(list(self.lengths), list(self.slots), list(self.has_initial))

    def requests(self):
        qsl = self.starts
        return [(qsl[i], qsl[i + 1], s, init) for i, (s, init) in enumerate(zip(self.slots, self.has_initial))]


CHUNK = ref.CHUNK
BATCHES = {
    "decodes": Batch((1, 1, 1), (True, False, True), (3, 0, 5)),
    # longer than a chunk and not a multiple, exactly one chunk, short, two chunks and one token
    "prefills": Batch((2 * CHUNK + 22, CHUNK, 7, 2 * CHUNK + 1), (False, True, True, True), (3, 0, 5, 7)),
    "mixed": Batch((1, 1, 1, 3 * CHUNK + 8, 3, CHUNK + 1), (True, False, True, True, False, True), (6, 3, 0, 5, 1, 7)),
}


def _pool(shape: tuple[int, ...], dtype: torch.dtype, batch: Batch, gen: torch.Generator, scale: float = 0.5) -> torch.Tensor:
    """A state pool [NUM_SLOTS + 1, *shape]: random states; NaN in the slots of requests without
    an initial state (a kernel must not read them)."""
    pool = (torch.randn(NUM_SLOTS + 1, *shape, generator=gen) * scale).to(dtype)
    for slot, init in zip(batch.slots, batch.has_initial):
        if not init:
            pool[slot] = math.nan
    return pool


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOL[dtype]
    err = (got.double() - want).abs()
    bad = err > tol["atol"] + tol["rtol"] * want.abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} out of {tol}, max abs err "
                           f"{err.max().item():.3e}, max |want| {want.abs().max().item():.3e}")  # fmt: skip


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32 against fp32 (two orders of the same sums)."""
    tol = TOL[torch.float32]
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


def _check_states(pool: torch.Tensor, before: torch.Tensor, want: dict[int, torch.Tensor], dtype: torch.dtype, what: str):
    assert pool.dtype == before.dtype, f"{what}: the state pool changed dtype"
    for slot in range(pool.shape[0]):
        if slot in want:
            _check(pool[slot], want[slot], dtype if pool.dtype != torch.float32 else torch.float32, f"{what} state slot {slot}")
        else:
            assert torch.equal(pool[slot].nan_to_num(7.0), before[slot].nan_to_num(7.0)), f"{what}: untouched slot {slot} changed"


def _initial(pool: torch.Tensor, slot: int, init: bool) -> torch.Tensor:
    return pool[slot].double() if init else torch.zeros(pool.shape[1:], dtype=torch.float64)


# ---- the oracle: the recurrences, token by token, float64 -------------------------------------


def oracle_conv(x, w, bias, pool, batch, activation):
    K = w.shape[1]
    x, w = x.double(), w.double()
    y, states = torch.zeros_like(x), {}
    for a, b, slot, init in batch.requests():
        window = _initial(pool, slot, init)  # [C, K - 1]
        for t in range(a, b):
            full = torch.cat([window, x[t][:, None]], dim=1)  # [C, K]
            out = (full * w).sum(1) + (0 if bias is None else bias.double())
            y[t] = F.silu(out) if activation == "silu" else out
            window = full[:, 1:]
        states[slot] = window
    return y, states if K > 1 else {}


def _dt64(dt, dt_bias, softplus, limit=(0.0, math.inf)):
    dt = dt.double() + (0 if dt_bias is None else dt_bias.double())
    dt = F.softplus(dt) if softplus else dt
    return dt.clamp(*limit) if limit != (0.0, math.inf) else dt


def oracle_ssd(x, dt, A, B, C, pool, batch, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, math.inf)):
    H, G = x.shape[1], B.shape[1]
    group = torch.arange(H) // (H // G)
    dts = _dt64(dt, dt_bias, dt_softplus, dt_limit)
    x, A, B, C = x.double(), A.double(), B.double(), C.double()
    y, states = torch.zeros_like(x), {}
    for a, b, slot, init in batch.requests():
        h = _initial(pool, slot, init)  # [H, P, N]
        for t in range(a, b):
            Bt, Ct = B[t][group], C[t][group]  # [H, N]
            h = torch.exp(dts[t] * A)[:, None, None] * h + torch.einsum("hp,hn->hpn", dts[t][:, None] * x[t], Bt)
            y[t] = torch.einsum("hpn,hn->hp", h, Ct) + (0 if D is None else D.double()[:, None] * x[t])
        states[slot] = h
    return y, states


def oracle_selective(x, dt, A, B, C, pool, batch, D=None, z=None, dt_bias=None, dt_softplus=True):
    dts = _dt64(dt, dt_bias, dt_softplus)
    x, A, B, C = x.double(), A.double(), B.double(), C.double()
    y, states = torch.zeros_like(x), {}
    for a, b, slot, init in batch.requests():
        h = _initial(pool, slot, init)  # [Dm, N]
        for t in range(a, b):
            h = torch.exp(dts[t][:, None] * A) * h + torch.outer(dts[t] * x[t], B[t])
            out = h @ C[t] + (0 if D is None else D.double() * x[t])
            y[t] = out * F.silu(z[t].double()) if z is not None else out
        states[slot] = h
    return y, states


def oracle_gdr(q, k, v, g, beta, pool, batch, scale, use_qk_l2norm=True):
    Hv = v.shape[1]
    head = torch.arange(Hv) // (Hv // q.shape[1])
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o, states = torch.zeros_like(v), {}
    for a, b, slot, init in batch.requests():
        S = _initial(pool, slot, init)  # [Hv, K, V]
        for t in range(a, b):
            qt, kt = q[t][head] * scale, k[t][head]  # [Hv, K]
            S = S * torch.exp(g[t])[:, None, None]
            correction = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", kt, S))
            S = S + torch.einsum("hk,hv->hkv", kt, correction)
            o[t] = torch.einsum("hk,hkv->hv", qt, S)
        states[slot] = S
    return o, states


# ---- inputs ---------------------------------------------------------------------------------


# (batch, inputs' dtype, state dtype): every batch in fp32; bf16 (states in bf16 or fp32) on the mixed one.
RUNS = [pytest.param(name, torch.float32, torch.float32, id=f"{name}-fp32") for name in BATCHES] + [
    pytest.param("mixed", torch.bfloat16, torch.bfloat16, id="mixed-bf16"),
    pytest.param("mixed", torch.bfloat16, torch.float32, id="mixed-bf16-fp32state"),
]


def _rounded(ts, dtype):
    return [None if t is None else t.to(dtype) for t in ts]


# ---- reference == oracle --------------------------------------------------------------------


@pytest.mark.parametrize("batch,dtype,state_dtype", RUNS)
@pytest.mark.parametrize("C,K,use_bias,activation", [(8, 2, True, "silu"), (40, 3, False, None), (24, 4, True, "silu")])
def test_causal_conv1d(batch, dtype, state_dtype, C, K, use_bias, activation):
    b, gen = BATCHES[batch], torch.Generator().manual_seed(1)
    x, w, bias = _rounded(conv_inputs(b.tokens, C, K, gen), dtype)
    bias = bias if use_bias else None
    pool = _pool((C, K - 1), state_dtype, b, gen)
    before = pool.clone()
    got = ref.causal_conv1d(x, w, bias, pool, b.md(), activation)
    want, states = oracle_conv(x, w, bias, before, b, activation)
    assert got.dtype == dtype and got.shape == x.shape
    _check(got, want, dtype, "causal_conv1d")
    _check_states(pool, before, states, dtype, "causal_conv1d")


@pytest.mark.parametrize("batch,dtype,state_dtype", RUNS)
@pytest.mark.parametrize("H,G,P,N,options", [
    (4, 1, 8, 16, "D,bias"), (4, 4, 16, 8, ""), (6, 2, 8, 8, "D,bias,limit"), (2, 1, 4, 16, "D,nosoftplus"),
])  # fmt: skip
def test_ssd_scan(batch, dtype, state_dtype, H, G, P, N, options):
    b, gen = BATCHES[batch], torch.Generator().manual_seed(2)
    x, dt, A, B, C, D, dt_bias = _rounded(ssd_inputs(b.tokens, H, G, P, N, gen), dtype)
    D = D.float() if "D" in options else None
    dt_bias = dt_bias.float() if "bias" in options else None
    softplus = "nosoftplus" not in options
    if not softplus:
        dt = dt.abs() * 0.3
    limit = (0.05, 0.6) if "limit" in options else (0.0, math.inf)
    pool = _pool((H, P, N), state_dtype, b, gen)
    before = pool.clone()
    got = ref.ssd_scan(x, dt, A.float(), B, C, pool, b.md(), D, dt_bias, softplus, limit)
    want, states = oracle_ssd(x, dt, A.float(), B, C, before, b, D, dt_bias, softplus, limit)
    assert got.dtype == dtype and got.shape == x.shape
    _check(got, want, dtype, "ssd_scan")
    _check_states(pool, before, states, dtype, "ssd_scan")


@pytest.mark.parametrize("batch,dtype,state_dtype", RUNS)
@pytest.mark.parametrize("Dm,N,options", [(8, 4, "D,z,bias"), (24, 16, ""), (16, 8, "z")])
def test_selective_scan(batch, dtype, state_dtype, Dm, N, options):
    b, gen = BATCHES[batch], torch.Generator().manual_seed(3)
    x, dt, A, B, C, D, z, dt_bias = _rounded(selective_inputs(b.tokens, Dm, N, gen), dtype)
    D = D.float() if "D" in options else None
    z = z if "z" in options else None
    dt_bias = dt_bias.float() if "bias" in options else None
    pool = _pool((Dm, N), state_dtype, b, gen)
    before = pool.clone()
    got = ref.selective_scan(x, dt, A.float(), B, C, pool, b.md(), D, z, dt_bias)
    want, states = oracle_selective(x, dt, A.float(), B, C, before, b, D, z, dt_bias)
    assert got.dtype == dtype and got.shape == x.shape
    _check(got, want, dtype, "selective_scan")
    _check_states(pool, before, states, dtype, "selective_scan")


@pytest.mark.parametrize("batch,dtype,state_dtype", RUNS)
@pytest.mark.parametrize("Hk,Hv,K,V,l2", [(2, 2, 16, 8, True), (2, 4, 32, 16, True), (1, 2, 8, 8, False)])
def test_gated_delta_rule(batch, dtype, state_dtype, Hk, Hv, K, V, l2):
    b, gen = BATCHES[batch], torch.Generator().manual_seed(4)
    q, k, v, g, beta = _rounded(gdr_inputs(b.tokens, Hk, Hv, K, V, gen), dtype)
    if not l2:  # unnormalised keys: keep |k|^2 beta below 2 so the delta rule stays stable
        q, k = (F.normalize(t.float(), dim=-1).to(dtype) for t in (q, k))
    pool = _pool((Hv, K, V), state_dtype, b, gen)
    before = pool.clone()
    got = ref.gated_delta_rule(q, k, v, g, beta, pool, b.md(), K**-0.5, l2)
    want, states = oracle_gdr(q, k, v, g, beta, before, b, K**-0.5, l2)
    assert got.dtype == dtype and got.shape == v.shape
    _check(got, want, dtype, "gated_delta_rule")
    _check_states(pool, before, states, dtype, "gated_delta_rule")


# ---- continuing a sequence over several calls -----------------------------------------------


def _kernels(gen, T):
    """Each kernel over one sequence of T tokens: name -> (call(rows, pool, md) -> out, state shape,
    oracle(pool, batch) -> (out, states))."""
    conv = conv_inputs(T, 12, 4, gen)
    ssd = ssd_inputs(T, 4, 2, 8, 8, gen)
    sel = selective_inputs(T, 8, 4, gen)
    gdr = gdr_inputs(T, 2, 4, 16, 8, gen)
    return {
        "causal_conv1d": (lambda s, p, md: ref.causal_conv1d(conv[0][s], conv[1], conv[2], p, md), (12, 3),
                          lambda p, b: oracle_conv(*conv, p, b, "silu")),
        "ssd_scan": (lambda s, p, md: ref.ssd_scan(ssd[0][s], ssd[1][s], ssd[2], ssd[3][s], ssd[4][s], p, md, ssd[5], ssd[6]),
                     (4, 8, 8), lambda p, b: oracle_ssd(*ssd[:5], p, b, ssd[5], ssd[6])),
        "selective_scan": (lambda s, p, md: ref.selective_scan(sel[0][s], sel[1][s], sel[2], sel[3][s], sel[4][s], p, md,
                                                               sel[5], sel[6][s], sel[7]), (8, 4),
                           lambda p, b: oracle_selective(*sel[:5], p, b, *sel[5:])),
        "gated_delta_rule": (lambda s, p, md: ref.gated_delta_rule(gdr[0][s], gdr[1][s], gdr[2][s], gdr[3][s], gdr[4][s],
                                                                   p, md, 16**-0.5), (4, 16, 8),
                             lambda p, b: oracle_gdr(*gdr, p, b, 16**-0.5)),
    }  # fmt: skip


def _in_calls(call, shape, cuts: list[int], slot: int = 2):
    """Run tokens [0, cuts[-1]) of one sequence as successive calls [cuts[i], cuts[i+1]) (a one-token
    call is a decode), continuing from the slot; return (outputs, final state)."""
    pool = torch.zeros(NUM_SLOTS + 1, *shape)
    outs = []
    for i in range(len(cuts) - 1):
        a, b = cuts[i], cuts[i + 1]
        md = recurrent_metadata([b - a], [slot], [i > 0])
        outs.append(call(slice(a, b), pool, md))
    return torch.cat(outs), pool[slot].clone()


@pytest.mark.parametrize("kernel", ["causal_conv1d", "ssd_scan", "selective_scan", "gated_delta_rule"])
def test_two_calls_equal_one(kernel):
    T = 2 * CHUNK + 45
    call, shape, _ = _kernels(torch.Generator().manual_seed(5), T)[kernel]
    whole, state = _in_calls(call, shape, [0, T])
    for cuts in ([0, T // 2 + 3, T], [0, CHUNK, T - 3, T - 2, T - 1, T], [0, 1, T]):
        got, got_state = _in_calls(call, shape, cuts)
        _same(got, whole, f"{kernel} in calls {cuts}")
        _same(got_state, state, f"{kernel} state, calls {cuts}")


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_any_split_of_a_sequence_matches_the_oracle(data):
    """Property: however a sequence is cut into successive calls, every kernel's outputs and final
    state equal the float64 recurrence over the whole sequence."""
    T = data.draw(st.integers(1, 2 * CHUNK + 10), label="T")
    cuts = sorted(set(data.draw(st.lists(st.integers(1, T - 1), max_size=4), label="cuts")) | {0, T}) if T > 1 else [0, 1]
    seed = data.draw(st.integers(0, 2**16), label="seed")
    whole = Batch((T,), (False,), (2,))
    for name, (call, shape, oracle) in _kernels(torch.Generator().manual_seed(seed), T).items():
        got, state = _in_calls(call, shape, cuts)
        want, states = oracle(torch.zeros(NUM_SLOTS + 1, *shape), whole)
        _check(got, want, torch.float32, f"{name} in calls {cuts}")
        _check(state, states[2], torch.float32, f"{name} final state, calls {cuts}")


# ---- transformers as a second oracle (Qwen3-Next's torch gated delta rule) -------------------


def test_gated_delta_rule_matches_transformers():
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    b, gen = BATCHES["mixed"], torch.Generator().manual_seed(6)
    Hk, Hv, K, V = 2, 4, 32, 16
    q, k, v, g, beta = gdr_inputs(b.tokens, Hk, Hv, K, V, gen)
    pool = torch.randn(NUM_SLOTS + 1, Hv, K, V, generator=gen) * 0.5
    before = pool.clone()
    got = ref.gated_delta_rule(q, k, v, g, beta, pool, b.md(), K**-0.5)  # transformers scales q by K ** -0.5
    for a, e, slot, init in b.requests():
        rows = [t[a:e].unsqueeze(0) for t in (q, k, v, g, beta)]
        initial = before[slot : slot + 1] if init else None
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            want, state = getattr(qwen3_next, name)(*rows, initial_state=initial, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)  # fmt: skip
            _same(got[a:e], want[0], f"{name} output, request at {a}")
            _same(pool[slot], state[0], f"{name} state, request at {a}")


# ---- misuse ---------------------------------------------------------------------------------


def test_num_decodes_must_count_one_token_requests():
    md = recurrent_metadata([3, 1], [0, 1], [False, True])
    md.num_decodes = 1  # the first request has 3 tokens: not a decode
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="num_decodes=1 but the first 1 requests hold 3 tokens"):
        ref.causal_conv1d(x, torch.randn(8, 4), None, torch.zeros(3, 8, 3), md)


def test_unknown_activation_is_refused():
    md = recurrent_metadata([2], [0], [False])
    with pytest.raises(ValueError, match="activation 'gelu'"):
        ref.causal_conv1d(torch.randn(2, 8), torch.randn(8, 4), None, torch.zeros(2, 8, 3), md, "gelu")
