"""Mixture-of-experts, written for clarity: the reference `ModelOps` inherits and every backend's
fast path is tested against.

Shapes: ``x`` [T, hidden]; ``router_logits`` [T, E]; ``w13`` [E, 2 * I, hidden] (each expert's
gate rows, then its up rows: one matmul gives both); ``w2`` [E, hidden, I]. Under tensor
parallelism I is this rank's slice of every expert, and the caller sums the ranks' outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SCORING", "ACTIVATIONS", "select_experts", "moe_experts"]

SCORING = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "gelu_tanh")


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts: (weights [T, top_k] fp32, ids [T, top_k] int64), by score
    (softmax over all experts, or each logit's sigmoid), highest first; `renormalize` makes each
    token's weights sum to 1."""
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"MoE scoring {scoring!r} is not one of {SCORING}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"MoE activation {activation!r} is not one of {ACTIVATIONS}")


def _dense_expert(x: torch.Tensor, w: torch.Tensor, e: int) -> torch.Tensor:
    return F.linear(x, w[e])


def moe_experts(
    x: torch.Tensor,
    w13: Any,
    w2: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    linear: Callable[[torch.Tensor, Any, int], torch.Tensor] = _dense_expert,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), where expert e is
    ``w2[e] @ (act(gate) * up)`` with ``gate, up = w13[e] @ x``; [T, hidden] in x's dtype,
    accumulated in fp32. One expert at a time, over the tokens routed to it. `linear(x, w, e)`
    multiplies by expert e's slice of a stacked weight (quantized ones pass their own)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(_num_experts(w13)):
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        gate, up = linear(x[rows], w13, e).chunk(2, dim=-1)
        y = linear(activate(gate, activation) * up, w2, e)  # [n, hidden]
        out.index_add_(0, rows, y.float() * topk_weights[rows, slot].unsqueeze(1).float())
    return out.to(x.dtype)


def _num_experts(w: Any) -> int:
    if isinstance(w, torch.nn.ModuleList):  # a stacked QuantParts: its parts' experts
        w = w[0]
    return int(w.shape[0]) if isinstance(w, torch.Tensor) else int(w.qweight.shape[0])  # a stacked QuantWeight
