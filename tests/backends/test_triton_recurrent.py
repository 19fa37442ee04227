"""Triton recurrent-layer kernels (`portside.backends.triton.recurrent`) vs core's references
(`portside.ops.recurrent`).

Under the interpreter on CPU tensors (conftest sets TRITON_INTERPRET), so shapes are tiny. Each
batch is ragged like a runner's step: decodes first (one without an initial state: a one-token
prompt), then prefill chunks with and without an initial state, on non-contiguous state slots
of a cache whose other slots (the scratch slot too) hold values that must stay as they were.
Token-major operands are column slices of wider tensors (strided, as a projection's output
split into parts); fp32 and bf16, with the tolerances of `portside.testing.tolerances`.
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.contract import RecurrentMetadata
from portside.ops import recurrent as ref

triton = pytest.importorskip("triton")

from portside.backends.triton import recurrent as kern  # noqa: E402  (after the interpreter is set)
from portside.backends.triton.moe import TritonModelOps  # noqa: E402

pytestmark = pytest.mark.triton

NUM_SLOTS = 8  # + 1 scratch
BATCHES = {
    # (tokens per request, slot, has initial state); the one-token requests come first
    "mixed": ([1, 1, 1, 5, 12, 2], [6, 0, 3, 2, 7, 4], [True, True, False, True, False, True]),
    "decodes": ([1, 1, 1], [5, 1, 3], [True, False, True]),
    "prefill": ([45], [2], [True]),
}
# (batch, input dtype, state dtype): fp32 and bf16 on every batch, fp16 inputs with an fp32 state on one
CASES = [(b, d, d) for b in BATCHES for d in (torch.float32, torch.bfloat16)]
CASES.append(("mixed", torch.float16, torch.float32))
CASE_IDS = [f"{b}-{str(d)[6:]}-state_{str(sd)[6:]}" for b, d, sd in CASES]


def metadata(batch: str, device: torch.device) -> RecurrentMetadata:
    lens, slots, init = BATCHES[batch]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return RecurrentMetadata(
        state_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        has_initial_state=torch.tensor(init, dtype=torch.bool, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl, state_slots_cpu=list(slots), has_initial_state_cpu=list(init),
        num_decodes=next((i for i, n in enumerate(lens) if n != 1), len(lens)),
    )  # fmt: skip


class Maker:
    """Random operands (CPU, seeded): token-major ones as column slices of wider tensors."""

    def __init__(self, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.device = dtype, device

    def __call__(self, *shape: int, scale: float = 1.0, shift: float = 0.0, strided: bool = False,
                 dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
        wide = (*shape[:-1], shape[-1] + 7) if strided else shape
        t = (torch.randn(*wide, generator=self.gen) * scale + shift).to(dtype or self.dtype).to(self.device)
        return t[..., 3 : 3 + shape[-1]] if strided else t


def run_both(name: str, state: torch.Tensor, md_dev: RecurrentMetadata, md_cpu: RecurrentMetadata, args: tuple,
             kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(kernel out, kernel state, reference out, reference state) from the same operands; `args`
    are the operands before the state."""
    before = state.cpu().clone()
    got_state = state.clone()
    got = getattr(TritonModelOps(), name)(*args, got_state, md_dev, **kwargs)
    want_state = before.clone()
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    cpu_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    want = getattr(ref, name)(*cpu_args, want_state, md_cpu, **cpu_kwargs)
    touched = torch.zeros(state.shape[0], dtype=torch.bool)
    touched[md_cpu.state_slots_cpu] = True
    assert torch.equal(got_state.cpu()[~touched], before[~touched]), f"{name}: an untouched slot changed"
    return got.cpu(), got_state.cpu(), want, want_state


def check(name: str, got, got_state, want, want_state, dtype: torch.dtype, context: str) -> None:  # type: ignore[no-untyped-def]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, dtype=dtype, context=f"{name} output {context}")
    assert_close(got_state, want_state, dtype=dtype, context=f"{name} state {context}")


@pytest.mark.parametrize("batch,dtype,state_dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("width,bias,act", [(4, True, "silu"), (2, False, None)])
def test_causal_conv1d(batch, width, bias, act, dtype, state_dtype, kernel_device) -> None:  # type: ignore[no-untyped-def]
    md, md_cpu = metadata(batch, kernel_device), metadata(batch, torch.device("cpu"))
    T, C = md_cpu.query_start_loc_cpu[-1], 40
    mk = Maker(width + T, dtype, kernel_device)
    x, w = mk(T, C, strided=True), mk(C, width, scale=0.5)
    b = mk(C) if bias else None
    state = mk(NUM_SLOTS + 1, C, width - 1, dtype=state_dtype)
    got, gs, want, ws = run_both("causal_conv1d", state, md, md_cpu, (x, w, b), {"activation": act})
    check("causal_conv1d", got, gs, want, ws, dtype, f"{batch} K={width}")


def test_causal_conv1d_rejects_an_unknown_activation(kernel_device) -> None:  # type: ignore[no-untyped-def]
    md = metadata("decodes", kernel_device)
    x, w, state = torch.zeros(3, 8), torch.zeros(8, 4), torch.zeros(NUM_SLOTS + 1, 8, 3)
    with pytest.raises(ValueError, match="activation 'relu'"):
        TritonModelOps().causal_conv1d(x.to(kernel_device), w.to(kernel_device), None, state.to(kernel_device), md,
                                       "relu")  # fmt: skip


def test_causal_conv1d_chunks_then_decodes(kernel_device) -> None:  # type: ignore[no-untyped-def]
    """One sequence through three calls (a chunk from zeros, a chunk from the state, a decode):
    the outputs are those of one call over the whole sequence."""
    mk = Maker(5, torch.float32, kernel_device)
    x, w, b = mk(12, 24), mk(24, 4), mk(24)
    state = torch.zeros(NUM_SLOTS + 1, 24, 3, device=kernel_device)
    outs = []
    for a, e, init in ((0, 7, False), (7, 11, True), (11, 12, True)):
        md = RecurrentMetadata(torch.tensor([3], device=kernel_device), torch.tensor([init], device=kernel_device),
                               torch.tensor([0, e - a], dtype=torch.int32, device=kernel_device), [0, e - a], [3], [init],
                               num_decodes=int(e - a == 1))  # fmt: skip
        outs.append(kern.causal_conv1d(x[a:e], w, b, state, md))
    whole = RecurrentMetadata(torch.tensor([3]), torch.tensor([False]), torch.tensor([0, 12], dtype=torch.int32),
                              [0, 12], [3], [False])  # fmt: skip
    want_state = torch.zeros(NUM_SLOTS + 1, 24, 3)
    want = ref.causal_conv1d(x.cpu(), w.cpu(), b.cpu(), want_state, whole)
    assert_close(torch.cat(outs).cpu(), want)
    assert_close(state.cpu(), want_state)


SSD_SHAPES = {"H4-P8-G2-N16": (4, 8, 2, 16), "H2-P40-G1-N12": (2, 40, 1, 12)}


@pytest.mark.parametrize("batch,dtype,state_dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shape", SSD_SHAPES)
def test_ssd_scan(batch, shape, dtype, state_dtype, kernel_device) -> None:  # type: ignore[no-untyped-def]
    H, P, G, N = SSD_SHAPES[shape]
    full = shape.startswith("H4")  # D, dt_bias, a dt limit; the other shape: none of them, no softplus
    md, md_cpu = metadata(batch, kernel_device), metadata(batch, torch.device("cpu"))
    T = md_cpu.query_start_loc_cpu[-1]
    mk = Maker(H * P + T, dtype, kernel_device)
    x, B, C = mk(T, H, P, strided=True), mk(T, G, N, strided=True), mk(T, G, N, strided=True)
    dt = mk(T, H, strided=True, scale=0.5, shift=-1.0) if full else mk(T, H, scale=0.05, shift=0.1).abs()
    A = -torch.exp(mk(H, scale=0.5, dtype=torch.float32))
    kwargs = {"D": mk(H), "dt_bias": mk(H, scale=0.3), "dt_limit": (0.05, 0.9)} if full else {"dt_softplus": False}
    state = mk(NUM_SLOTS + 1, H, P, N, scale=0.5, dtype=state_dtype)
    got, gs, want, ws = run_both("ssd_scan", state, md, md_cpu, (x, dt, A, B, C), kwargs)
    check("ssd_scan", got, gs, want, ws, dtype, f"{batch} {shape}")


SEL_SHAPES = {"Dm24-N16": (24, 16), "Dm80-N5": (80, 5)}


@pytest.mark.parametrize("batch,dtype,state_dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shape", SEL_SHAPES)
def test_selective_scan(batch, shape, dtype, state_dtype, kernel_device) -> None:  # type: ignore[no-untyped-def]
    Dm, N = SEL_SHAPES[shape]
    full = shape.startswith("Dm24")  # D, z, dt_bias; the other shape: none of them
    md, md_cpu = metadata(batch, kernel_device), metadata(batch, torch.device("cpu"))
    T = md_cpu.query_start_loc_cpu[-1]
    mk = Maker(Dm + T, dtype, kernel_device)
    x, dt = mk(T, Dm, strided=True), mk(T, Dm, strided=True, scale=0.5, shift=-1.0)
    B, C = mk(T, N, strided=True), mk(T, N, strided=True)
    A = -torch.exp(mk(Dm, N, scale=0.5, dtype=torch.float32))
    kwargs = {"D": mk(Dm), "z": mk(T, Dm, strided=True), "dt_bias": mk(Dm, scale=0.3)} if full else {}
    state = mk(NUM_SLOTS + 1, Dm, N, scale=0.5, dtype=state_dtype)
    got, gs, want, ws = run_both("selective_scan", state, md, md_cpu, (x, dt, A, B, C), kwargs)
    check("selective_scan", got, gs, want, ws, dtype, f"{batch} {shape}")


GDN_SHAPES = {"Hk2-Hv4-K16-V8": (2, 4, 16, 8), "Hk1-Hv1-K24-V40": (1, 1, 24, 40)}


@pytest.mark.parametrize("batch,dtype,state_dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shape", GDN_SHAPES)
def test_gated_delta_rule(batch, shape, dtype, state_dtype, kernel_device) -> None:  # type: ignore[no-untyped-def]
    Hk, Hv, K, V = GDN_SHAPES[shape]
    norm = shape.startswith("Hk2")  # l2-normalised q, k; the other shape: raw, small q and k
    md, md_cpu = metadata(batch, kernel_device), metadata(batch, torch.device("cpu"))
    T = md_cpu.query_start_loc_cpu[-1]
    mk = Maker(Hv * K + T, dtype, kernel_device)
    qk_scale = 1.0 if norm else 0.15
    q, k = mk(T, Hk, K, strided=True, scale=qk_scale), mk(T, Hk, K, strided=True, scale=qk_scale)
    v = mk(T, Hv, V, strided=True)
    g = -torch.nn.functional.softplus(mk(T, Hv, dtype=torch.float32)).to(dtype)
    beta = torch.sigmoid(mk(T, Hv, strided=True, dtype=torch.float32)).to(dtype)
    state = mk(NUM_SLOTS + 1, Hv, K, V, scale=0.5, dtype=state_dtype)
    args = (q, k, v, g, beta)
    kwargs = {"scale": K**-0.5, "use_qk_l2norm": norm}
    got, gs, want, ws = run_both("gated_delta_rule", state, md, md_cpu, args, kwargs)
    check("gated_delta_rule", got, gs, want, ws, dtype, f"{batch} {shape}")


def test_model_ops_use_the_kernels() -> None:
    """cuda/rocm's `ModelOps` (`TritonModelOps`) resolves the recurrent kernels to this module's."""
    for name in ("causal_conv1d", "ssd_scan", "selective_scan", "gated_delta_rule"):
        assert getattr(TritonModelOps, name) is getattr(kern.TritonRecurrentOps, name), name
    assert math.isinf(kern.ssd_scan.__defaults__[-1][1])  # the contract's default dt_limit


def test_verify_steps_run_on_the_reference() -> None:
    """Speculative decoding's verify rows keep each token's state (`token_state_slots_cpu`), which
    these kernels do not write: `kernels_for` gives such steps to core's reference, others to them."""
    from portside.contract import RecurrentKernels, kernels_for

    qsl = [0, 1, 4]
    md = RecurrentMetadata(state_slots=torch.tensor([0, 1]), has_initial_state=torch.tensor([True, True]),
                           query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_start_loc_cpu=qsl,
                           state_slots_cpu=[0, 1], has_initial_state_cpu=[True, True], num_decodes=1)
    ops = TritonModelOps()
    assert kernels_for(ops, md) is ops
    md.token_state_slots_cpu = [[], [2, 3]]
    assert type(kernels_for(ops, md)) is RecurrentKernels
