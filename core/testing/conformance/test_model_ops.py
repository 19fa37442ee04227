"""Model-ops contract: the kernels of `Platform.model_ops()` beyond attention equal core's
references (`portside.ops`) on a few shapes, in every declared dtype: mixture-of-experts routing
(`select_experts`), the experts (`moe_experts`) and both together (`fused_moe`), with and without
the later keyword options (grouped top-k with a correction bias and a scaling factor, as DeepSeek
and GLM-4.5 route; expert biases and gpt-oss's clamped "swiglu_oai"). A platform that overrides
nothing runs the references themselves and passes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portside.contract import ModelOps, Platform
from portside.ops.moe import ACTIVATIONS, CLAMPED_ACTIVATIONS, SCORING, moe_experts, select_experts
from portside.testing.conformance.cases import contract_failure, engine_config
from portside.testing.tolerances import TOLERANCES

# (tokens, hidden, intermediate, experts, top_k): one token (most experts idle), a few, a batch.
MOE_SHAPES = ((1, 64, 32, 2, 1), (5, 64, 32, 8, 2), (37, 128, 96, 8, 2))


@pytest.fixture(scope="module")
def model_ops(conformance_platform: type[Platform]) -> dict[torch.dtype, ModelOps]:
    """The platform's ModelOps for a model of each declared dtype."""
    platform, found = conformance_platform, {}
    for dtype in platform.supported_dtypes:
        ops = platform.model_ops(engine_config(platform, dtype, platform.default_block_size))
        if not isinstance(ops, ModelOps):
            contract_failure("model-ops", f"model_ops() returned a {type(ops).__name__}, not a ModelOps ({dtype})")
        found[dtype] = ops
    return found


def _router_logits(tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct logits per token, exact in every dtype: every dtype routes to the same experts in
    the same order (no ties for a kernel to break differently)."""
    return torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).float() * 0.5 - experts / 4


def _weights(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I], scaled so activations stay O(1)."""
    t, hidden, inter, e, _ = shape
    x = torch.randn(t, hidden, generator=gen)
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) * inter**-0.5
    return x, w13, w2


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        contract_failure("model-ops", f"{what} returned {tuple(got.shape)} {got.dtype}; expected "
                         f"{tuple(want.shape)} {want.dtype}")  # fmt: skip
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    err = (got.cpu().float() - want.float()).abs()
    bad = err > tol["atol"] + tol["rtol"] * want.float().abs()
    if bad.any():
        contract_failure("model-ops", f"{what} differs from core's reference: {int(bad.sum())} of {bad.numel()} "
                         f"elements out of tolerance {tol}, max abs err {err.max().item():.3e}")  # fmt: skip


def test_select_experts_matches_reference(conformance_platform: type[Platform], model_ops) -> None:
    device, gen = conformance_platform.device(0), torch.Generator().manual_seed(5)
    for dtype, ops in model_ops.items():
        for t, _, _, e, k in MOE_SHAPES:
            logits = _router_logits(t, e, gen).to(dtype)
            for scoring in SCORING:
                for renormalize in (False, True):
                    what = f"{type(ops).__name__}.select_experts(top_k={k}, renormalize={renormalize}, " \
                           f"scoring={scoring!r}) on [{t}, {e}] {dtype} logits"  # fmt: skip
                    weights, ids = ops.select_experts(logits.to(device), k, renormalize, scoring)
                    want_weights, want_ids = select_experts(logits, k, renormalize, scoring)
                    if not torch.equal(ids.cpu(), want_ids):
                        contract_failure("model-ops", f"{what} chose experts {ids.cpu().tolist()}, expected "
                                         f"{want_ids.tolist()} (highest score first)")  # fmt: skip
                    _check(weights, want_weights, dtype, what)


def test_moe_experts_matches_reference(conformance_platform: type[Platform], model_ops) -> None:
    """`moe_experts`, and `fused_moe` (routing included), against the reference in fp32 on the
    same (rounded) inputs."""
    device, gen = conformance_platform.device(0), torch.Generator().manual_seed(6)
    for dtype, ops in model_ops.items():
        for shape in MOE_SHAPES:
            t, hidden, inter, e, k = shape
            x, w13, w2 = (w.to(dtype) for w in _weights(shape, gen))
            logits = _router_logits(t, e, gen).to(dtype)
            on_device = [w.to(device) for w in (x, w13, w2)]
            for activation in ACTIVATIONS:
                where = f"T={t}, hidden={hidden}, I={inter}, E={e}, top_k={k}, activation={activation!r}, {dtype}"
                weights, ids = select_experts(logits, k, True)
                want = moe_experts(x.float(), w13.float(), w2.float(), weights, ids, activation).to(dtype)
                got = ops.moe_experts(*on_device, weights.to(device), ids.to(device), activation)
                _check(got, want, dtype, f"{type(ops).__name__}.moe_experts ({where})")
                for renormalize, scoring in ((True, "softmax"), (False, "sigmoid")):
                    weights, ids = select_experts(logits, k, renormalize, scoring)
                    want = moe_experts(x.float(), w13.float(), w2.float(), weights, ids, activation).to(dtype)
                    got = ops.fused_moe(on_device[0], logits.to(device), *on_device[1:], k, renormalize, scoring,
                                        activation)  # fmt: skip
                    _check(got, want, dtype, f"{type(ops).__name__}.fused_moe (renormalize={renormalize}, "
                           f"scoring={scoring!r}, {where})")  # fmt: skip


# (scoring, num_groups, topk_groups, group_scoring, correction bias?, renormalize, scaling factor) on
# 16 experts top-4: DeepSeek-V2's greedy and group_limited_greedy, V3 / GLM-4.5's noaux_tc.
GROUPED_ROUTINGS = (
    ("softmax", 1, None, "max", False, False, 16.0),
    ("softmax", 4, 2, "max", False, False, 2.5),
    ("sigmoid", 4, 2, "top2_sum", True, True, 2.5),
    ("sigmoid", 8, 3, "top2_sum", True, False, 1.0),
)


def test_grouped_select_experts_matches_reference(conformance_platform: type[Platform], model_ops) -> None:
    device, gen = conformance_platform.device(0), torch.Generator().manual_seed(7)
    for dtype, ops in model_ops.items():
        for t in (1, 9):
            logits = _router_logits(t, 16, gen).to(dtype)
            bias = torch.randperm(16, generator=gen).float() / 64  # distinct sums: no ties
            for scoring, groups, topk_groups, how, biased, renormalize, factor in GROUPED_ROUTINGS:
                options: dict[str, Any] = dict(num_groups=groups, topk_groups=topk_groups, group_scoring=how,
                               correction_bias=bias if biased else None, scaling_factor=factor)  # fmt: skip
                what = f"{type(ops).__name__}.select_experts(top_k=4, renormalize={renormalize}, scoring={scoring!r}, " \
                       f"{ {k: v for k, v in options.items() if k != 'correction_bias'} }, bias={biased}) on [{t}, 16] {dtype}"  # fmt: skip
                want_weights, want_ids = select_experts(logits, 4, renormalize, scoring, **options)
                on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
                weights, ids = ops.select_experts(logits.to(device), 4, renormalize, scoring, **on_device)
                if not torch.equal(ids.cpu(), want_ids):
                    contract_failure("model-ops", f"{what} chose experts {ids.cpu().tolist()}, expected "
                                     f"{want_ids.tolist()} (highest score + bias first)")  # fmt: skip
                _check(weights, want_weights, dtype, what)


def test_moe_experts_with_bias_and_clamped_swiglu_match_reference(conformance_platform: type[Platform], model_ops) -> None:
    """`moe_experts` and `fused_moe` with expert biases (w13_bias [E, 2I], w2_bias [E, hidden]),
    each alone and both, for every activation including gpt-oss's clamped "swiglu_oai" (a limit
    small enough that the clamps bite), against the reference in fp32."""
    device, gen = conformance_platform.device(0), torch.Generator().manual_seed(8)
    for dtype, ops in model_ops.items():
        for shape in MOE_SHAPES[1:]:
            t, hidden, inter, e, k = shape
            x, w13, w2 = (w.to(dtype) for w in _weights(shape, gen))
            b13 = (torch.randn(e, 2 * inter, generator=gen) * 0.5).to(dtype)
            b2 = (torch.randn(e, hidden, generator=gen) * 0.5).to(dtype)
            logits = _router_logits(t, e, gen).to(dtype)
            weights, ids = select_experts(logits, k, True)
            on_device = [w.to(device) for w in (x, w13, w2)]
            for activation in ACTIVATIONS + CLAMPED_ACTIVATIONS:
                for biases in ((b13, None), (None, b2), (b13, b2)):
                    extra: dict[str, Any] = dict(swiglu_alpha=1.702, swiglu_limit=0.75) if activation in CLAMPED_ACTIVATIONS else {}
                    where = f"T={t}, hidden={hidden}, I={inter}, E={e}, top_k={k}, activation={activation!r}, " \
                            f"w13_bias={biases[0] is not None}, w2_bias={biases[1] is not None}, {dtype}"  # fmt: skip
                    want = moe_experts(x.float(), w13.float(), w2.float(), weights, ids, activation,
                                       w13_bias=None if biases[0] is None else biases[0].float(),
                                       w2_bias=None if biases[1] is None else biases[1].float(), **extra).to(dtype)  # fmt: skip
                    dev_bias = [None if b is None else b.to(device) for b in biases]
                    got = ops.moe_experts(*on_device, weights.to(device), ids.to(device), activation,
                                          w13_bias=dev_bias[0], w2_bias=dev_bias[1], **extra)  # fmt: skip
                    _check(got, want, dtype, f"{type(ops).__name__}.moe_experts ({where})")
                    got = ops.fused_moe(on_device[0], logits.to(device), *on_device[1:], k, True, "softmax", activation,
                                        w13_bias=dev_bias[0], w2_bias=dev_bias[1], **extra)  # fmt: skip
                    _check(got, want, dtype, f"{type(ops).__name__}.fused_moe ({where})")
