"""Core's recurrent-layer references (`portside.ops.recurrent`), which the xla backend's
`XlaModelOps` inherits, on torch-xla's device (PJRT CPU in the xla leg; skipped without
torch-xla): each kernel over a ragged step (decodes first, one without a state; prefills with
and without a state, one longer than a chunk of the chunked forms; non-contiguous slots) gives
the CPU results, leaves the other slots as they were, and runs without an ATen CPU fallback (a
lowering gap would copy tensors to the host and back on every call).

The references are traced as written: Python loops over the host copies of the metadata
(`*_cpu`) and over chunks, no device value read back, so no host sync. The traced program
depends on the step's request lengths, so an XLA device compiles one per distinct batch
composition (hybrid models run eagerly, outside the bucketed graphs).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.contract import RecurrentMetadata
from portside.ops import recurrent as ref

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
pytestmark = [pytest.mark.xla,
              pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not importable (the xla leg installs it)")]

if HAS_XLA:
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla starts its runtime

LENGTHS = [1, 1, 1, 6, 70, 3]  # 70: more than one chunk of the chunked references
SLOTS = [6, 0, 3, 2, 7, 4]
INIT = [True, True, False, True, False, True]
NUM_SLOTS = 8  # + 1 scratch


@pytest.fixture(scope="module")
def xla_device() -> torch.device:
    from portside.backends.xla.platform import XlaPlatform

    avail = XlaPlatform.is_available()
    if not avail:
        pytest.skip(f"tpu platform unavailable: {avail.reason}")
    return XlaPlatform.device()


def metadata(device: torch.device | str) -> RecurrentMetadata:
    qsl = [0]
    for n in LENGTHS:
        qsl.append(qsl[-1] + n)
    return RecurrentMetadata(
        state_slots=torch.tensor(SLOTS, dtype=torch.int64, device=device),
        has_initial_state=torch.tensor(INIT, dtype=torch.bool, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl, state_slots_cpu=list(SLOTS), has_initial_state_cpu=list(INIT),
        num_decodes=next(i for i, n in enumerate(LENGTHS) if n != 1),
    )  # fmt: skip


def operands(name: str) -> tuple[tuple, torch.Tensor, dict]:
    """(operands before the state, the state cache, keyword arguments) on CPU, seeded."""
    gen = torch.Generator().manual_seed(len(name))
    T = sum(LENGTHS)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    if name == "causal_conv1d":
        return (rnd(T, 24), rnd(24, 4, scale=0.5), rnd(24)), rnd(NUM_SLOTS + 1, 24, 3), {"activation": "silu"}
    if name == "ssd_scan":
        H, P, G, N = 4, 8, 2, 16
        args = (rnd(T, H, P), rnd(T, H, scale=0.5) - 1.0, -torch.exp(rnd(H, scale=0.5)), rnd(T, G, N), rnd(T, G, N))
        kwargs = {"D": rnd(H), "dt_bias": rnd(H, scale=0.3), "dt_limit": (0.0, 0.9)}
        return args, rnd(NUM_SLOTS + 1, H, P, N, scale=0.5), kwargs
    if name == "selective_scan":
        Dm, N = 24, 8
        args = (rnd(T, Dm), rnd(T, Dm, scale=0.5) - 1.0, -torch.exp(rnd(Dm, N, scale=0.5)), rnd(T, N), rnd(T, N))
        kwargs = {"D": rnd(Dm), "z": rnd(T, Dm), "dt_bias": rnd(Dm, scale=0.3)}
        return args, rnd(NUM_SLOTS + 1, Dm, N, scale=0.5), kwargs
    Hk, Hv, K, V = 2, 4, 16, 8
    args = (rnd(T, Hk, K), rnd(T, Hk, K), rnd(T, Hv, V), -F.softplus(rnd(T, Hv)), torch.sigmoid(rnd(T, Hv)))
    return args, rnd(NUM_SLOTS + 1, Hv, K, V, scale=0.5), {"scale": K**-0.5, "use_qk_l2norm": True}


@pytest.mark.parametrize("name", ["causal_conv1d", "ssd_scan", "selective_scan", "gated_delta_rule"])
def test_reference_on_the_xla_device_matches_cpu(name: str, xla_device: torch.device) -> None:
    import torch_xla
    import torch_xla.debug.metrics as met

    from portside.backends.xla.ops import XlaModelOps

    args, state, kwargs = operands(name)
    want_state = state.clone()
    want = getattr(ref, name)(*args, want_state, metadata("cpu"), **kwargs)

    def dev(v):  # type: ignore[no-untyped-def]
        return v.to(xla_device) if isinstance(v, torch.Tensor) else v

    dev_state = state.to(xla_device)
    torch_xla.sync()
    met.clear_counters()
    with torch.no_grad():
        got = getattr(XlaModelOps(), name)(*map(dev, args), dev_state, metadata(xla_device),
                                           **{k: dev(v) for k, v in kwargs.items()})  # fmt: skip
    torch_xla.sync()
    fallbacks = sorted(n for n in met.counter_names() if n.startswith("aten::"))
    assert not fallbacks, f"{name}: ops run on the host (CPU fallback): {fallbacks}"
    got_state = dev_state.cpu()
    assert_close(got.cpu(), want, context=f"{name} output")  # fp32 (measured: max abs error 2e-6)
    assert_close(got_state, want_state, context=f"{name} state")
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in SLOTS]
    assert torch.equal(got_state[untouched], state[untouched])
