"""Mixture-of-experts, written for clarity: the reference `ModelOps` inherits and every backend's
fast path is tested against.

Shapes: ``x`` [T, hidden]; ``router_logits`` [T, E]; ``w13`` [E, 2 * I, hidden] (each expert's
gate rows, then its up rows: one matmul gives both); ``w2`` [E, hidden, I]; optional biases
``w13_bias`` [E, 2 * I] (gate then up, as w13's rows) and ``w2_bias`` [E, hidden]. Under tensor
parallelism I is this rank's slice of every expert (w13_bias sliced as w13), the caller sums the
ranks' outputs, and so passes ``w2_bias`` on one rank only.

Routing (`select_experts`) covers the routers of Mixtral/Qwen-MoE (softmax, top-k, optionally
renormalised), OLMoE and LFM2 (sigmoid), DeepSeek-V2 (``group_limited_greedy``: the experts split
in ``num_groups`` groups, a group scored by its best expert, only the ``topk_groups`` best groups
eligible), DeepSeek-V3 / GLM-4.5 (``noaux_tc``: sigmoid scores plus a per-expert
``correction_bias`` choose the experts, groups scored by the sum of their two best biased scores,
and the chosen experts weighted by their unbiased scores) and a ``scaling_factor``
(routed_scaling_factor) on the final weights. gpt-oss's router (softmax over the top-k logits) is
softmax scoring with ``renormalize``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "SCORING",
    "GROUP_SCORING",
    "ACTIVATIONS",
    "CLAMPED_ACTIVATIONS",
    "SWIGLU_OAI_ALPHA",
    "select_experts",
    "moe_experts",
]

SCORING = ("softmax", "sigmoid")
GROUP_SCORING = ("max", "top2_sum")
ACTIVATIONS = ("silu", "gelu_tanh")
"""The plain gated activations: ``act(gate) * up``."""
CLAMPED_ACTIVATIONS = ("swiglu_oai",)
"""gpt-oss's clamped SwiGLU, ``clamp(gate, max=limit) * sigmoid(alpha * gate) * (clamp(up, -limit,
limit) + 1)`` (`swiglu_alpha`, `swiglu_limit`)."""
SWIGLU_OAI_ALPHA = 1.702


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    *,
    num_groups: int = 1,
    topk_groups: int | None = None,
    group_scoring: str = "max",
    correction_bias: torch.Tensor | None = None,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts: (weights [T, top_k] fp32, ids [T, top_k] int64).

    scores = softmax over all experts, or each logit's sigmoid (fp32). Experts are chosen by
    ``scores + correction_bias`` ([E], when given), highest first, among the `topk_groups` best
    of `num_groups` equal groups of consecutive experts (a group's score: its best choice score,
    "max", or the sum of its two best, "top2_sum"); with ``num_groups=1`` every expert is
    eligible. The weights are the chosen experts' unbiased scores, made to sum to 1 per token
    where `renormalize`, then multiplied by `scaling_factor`."""
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"MoE scoring {scoring!r} is not one of {SCORING}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1 and (topk_groups or num_groups) < num_groups:
        choice = _limit_to_groups(choice, top_k, num_groups, int(topk_groups or num_groups), group_scoring)
    if correction_bias is None and num_groups <= 1:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        ids = torch.topk(choice, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return weights, ids


def _limit_to_groups(choice: torch.Tensor, top_k: int, num_groups: int, topk_groups: int, how: str) -> torch.Tensor:
    """`choice` [T, E] with the experts outside each token's `topk_groups` best groups at -inf."""
    tokens, experts = choice.shape
    if experts % num_groups:
        raise ValueError(f"{experts} experts do not split into {num_groups} equal groups (n_group)")
    per_group = experts // num_groups
    if not 0 < topk_groups <= num_groups or top_k > topk_groups * per_group:
        raise ValueError(f"top-{top_k} of {experts} experts within the best {topk_groups} of {num_groups} groups: "
                         "topk_group must be in [1, n_group] and leave at least top_k experts")  # fmt: skip
    grouped = choice.view(tokens, num_groups, per_group)
    if how == "max":
        group_scores = grouped.amax(dim=-1)
    elif how == "top2_sum":
        if per_group < 2:
            raise ValueError(f"group score 'top2_sum' needs 2 or more experts per group, not {per_group}")
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        raise ValueError(f"MoE group scoring {how!r} is not one of {GROUP_SCORING}")
    best = torch.topk(group_scores, topk_groups, dim=-1)[1]  # [T, topk_groups]
    keep = torch.zeros(tokens, num_groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)


def activate(
    gate: torch.Tensor,
    activation: str,
    up: torch.Tensor | None = None,
    *,
    swiglu_alpha: float = SWIGLU_OAI_ALPHA,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """An expert's activation by name; with `up`, the gated product ``act(gate) * up`` (the
    clamped "swiglu_oai" is only defined that way)."""
    if activation == "swiglu_oai":
        if up is None:
            raise ValueError("MoE activation 'swiglu_oai' gates `up`: pass it")
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
        return gate * torch.sigmoid(gate * swiglu_alpha) * (up + 1)
    if activation == "silu":
        act = F.silu(gate)
    elif activation == "gelu_tanh":
        act = F.gelu(gate, approximate="tanh")
    else:
        raise ValueError(f"MoE activation {activation!r} is not one of {ACTIVATIONS + CLAMPED_ACTIVATIONS}")
    return act if up is None else act * up


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
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = SWIGLU_OAI_ALPHA,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), where expert e is
    ``w2[e] @ act(gate, up) + w2_bias[e]`` with ``gate, up = w13[e] @ x + w13_bias[e]`` (biases
    where given; act(gate, up) = act(gate) * up, or gpt-oss's clamped "swiglu_oai" with
    `swiglu_alpha` / `swiglu_limit`); [T, hidden] in x's dtype, accumulated in fp32. One expert
    at a time, over the tokens routed to it. `linear(x, w, e)` multiplies by expert e's slice of
    a stacked weight (quantized ones pass their own)."""
    if activation not in ACTIVATIONS + CLAMPED_ACTIVATIONS:
        raise ValueError(f"MoE activation {activation!r} is not one of {ACTIVATIONS + CLAMPED_ACTIVATIONS}")
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(_num_experts(w13)):
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        gate_up = linear(x[rows], w13, e)
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e].to(gate_up.dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        h = activate(gate, activation, up, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        y = linear(h, w2, e)  # [n, hidden]
        if w2_bias is not None:
            y = y + w2_bias[e].to(y.dtype)
        out.index_add_(0, rows, y.float() * topk_weights[rows, slot].unsqueeze(1).float())
    return out.to(x.dtype)


def _num_experts(w: Any) -> int:
    if isinstance(w, torch.nn.ModuleList):  # a stacked QuantParts: its parts' experts
        w = w[0]
    return int(w.shape[0]) if isinstance(w, torch.Tensor) else int(w.qweight.shape[0])  # a stacked QuantWeight
