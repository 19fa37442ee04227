"""Core's mixture-of-experts references (`portside.ops.moe`) and the default `ModelOps` against a
naive loop over tokens: softmax and sigmoid scoring, renormalisation on and off, top-1 and top-2
of 2 and 8 experts, both activations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from portside.contract import ModelOps
from portside.ops.moe import ACTIVATIONS, SCORING, moe_experts, select_experts

T, HIDDEN, INTER = 6, 16, 12
ROUTINGS = [(2, 1), (2, 2), (8, 1), (8, 2)]  # (experts, top_k)


def naive_route(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str) -> list[list[tuple[int, float]]]:
    """Per token: [(expert, weight)] for its top_k experts, highest score first."""
    routes = []
    for row in logits.double().tolist():
        if scoring == "softmax":
            total = sum(math.exp(x) for x in row)
            scores = [math.exp(x) / total for x in row]
        else:
            scores = [1 / (1 + math.exp(-x)) for x in row]
        top = sorted(range(len(row)), key=lambda e: -scores[e])[:top_k]
        norm = sum(scores[e] for e in top) if renormalize else 1.0
        routes.append([(e, scores[e] / norm) for e in top])
    return routes


def naive_moe(x, w13, w2, routes, activation):
    act = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}[activation]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, route in enumerate(routes):
        for e, weight in route:
            gate, up = w13[e, :INTER].double() @ x[t].double(), w13[e, INTER:].double() @ x[t].double()
            out[t] += weight * (w2[e].double() @ (act(gate) * up))
    return out


def inputs(experts: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, HIDDEN, generator=gen)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) * INTER**-0.5
    logits = torch.randn(T, experts, generator=gen)
    return x, w13, w2, logits


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("scoring", SCORING)
@pytest.mark.parametrize("experts, top_k", ROUTINGS)
def test_select_experts_matches_a_loop(experts, top_k, scoring, renormalize):
    logits = inputs(experts)[3]
    weights, ids = select_experts(logits, top_k, renormalize, scoring)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, top_k)
    routes = naive_route(logits, top_k, renormalize, scoring)
    assert ids.tolist() == [[e for e, _ in r] for r in routes]
    torch.testing.assert_close(weights, torch.tensor([[w for _, w in r] for r in routes], dtype=torch.float32))
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("experts, top_k", ROUTINGS)
def test_moe_experts_matches_a_loop(experts, top_k, activation):
    x, w13, w2, logits = inputs(experts, seed=1)
    routes = naive_route(logits, top_k, True, "softmax")
    ids = torch.tensor([[e for e, _ in r] for r in routes])
    weights = torch.tensor([[w for _, w in r] for r in routes], dtype=torch.float32)
    out = moe_experts(x, w13, w2, weights, ids, activation)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, naive_moe(x, w13, w2, routes, activation).float())


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("scoring", SCORING)
@pytest.mark.parametrize("experts, top_k", ROUTINGS)
def test_default_model_ops_fused_moe_matches_a_loop(experts, top_k, scoring, renormalize):
    x, w13, w2, logits = inputs(experts, seed=2)
    out = ModelOps().fused_moe(x, logits, w13, w2, top_k, renormalize, scoring)
    want = naive_moe(x, w13, w2, naive_route(logits, top_k, renormalize, scoring), "silu")
    torch.testing.assert_close(out, want.float())


def test_moe_experts_keeps_the_dtype_and_accumulates_in_fp32():
    x, w13, w2, logits = inputs(8, seed=3)
    weights, ids = select_experts(logits, 2, True)
    out = moe_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    want = moe_experts(x.bfloat16().float(), w13.bfloat16().float(), w2.bfloat16().float(), weights, ids)
    torch.testing.assert_close(out, want.bfloat16(), atol=1.5e-2, rtol=1e-2)


def test_unknown_scoring_and_activation_are_refused():
    x, w13, w2, logits = inputs(2)
    with pytest.raises(ValueError, match="scoring 'tanh'"):
        select_experts(logits, 1, True, "tanh")
    weights, ids = select_experts(logits, 1, True)
    with pytest.raises(ValueError, match="activation 'relu'"):
        moe_experts(x, w13, w2, weights, ids, "relu")
