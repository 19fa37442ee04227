"""The DeepSeek mixture-of-experts block (DeepSeek-V2/V3/R1, Kimi K2, GLM-4.5): routed experts
stacked as in `portside.model.moe.MoEExperts` plus ``n_shared_experts`` shared experts, one dense
gated MLP of ``n_shared_experts * moe_intermediate_size`` every token goes through.

Routing (`routing_options`, from the checkpoint's config, as transformers and the reference
implementations route):

- ``topk_method`` "greedy" (DeepSeek-V2): softmax over the experts, the top-k;
- "group_limited_greedy" (DeepSeek-V2): the same among the ``topk_group`` best of ``n_group``
  groups, a group scored by its best expert;
- "noaux_tc" (DeepSeek-V3, R1, Kimi K2, GLM-4.5; the default of those model types): sigmoid
  scores; experts chosen by score + ``e_score_correction_bias`` among the best ``topk_group`` of
  ``n_group`` groups (a group scored by its two best), weighted by their unbiased scores.

Then the weights are renormalised where ``norm_topk_prob`` and multiplied by
``routed_scaling_factor``. (transformers' DeepSeek-V2 router ignores ``norm_topk_prob``; every
DeepSeek-V2 checkpoint has it false.) The router runs in fp32 on an fp32 weight, as transformers
keeps it.

Checkpoint names under ``mlp.``: ``gate.weight`` [E, hidden], ``gate.e_score_correction_bias``
[E] (noaux_tc), ``experts.{e}.{gate,up,down}_proj.weight`` or transformers 5's fused
``experts.gate_up_proj`` / ``experts.down_proj``, ``shared_experts.{gate,up,down}_proj.weight``.

Under tensor parallelism every rank routes the same way and holds a slice of every expert's (and
the shared experts') intermediate dimension; the routed and shared partial sums are added and
all-reduced once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from portside.contract import Communicator, ModelOps
from portside.model.decoder import TP, GatedMLP
from portside.model.layers import ReplicatedLinear, _param, default_weight_loader
from portside.model.moe import MoEExperts

__all__ = ["DeepseekMoE", "routing_options", "topk_method", "TOPK_METHODS"]

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_NOAUX_MODEL_TYPES = ("deepseek_v3", "glm4_moe", "kimi_k2")  # noaux_tc where the config names no topk_method


def topk_method(hf: Any) -> str:
    """The config's ``topk_method``, else its model type's ("noaux_tc" for DeepSeek-V3's kind)."""
    default = "noaux_tc" if getattr(hf, "model_type", "") in _NOAUX_MODEL_TYPES else "greedy"
    return str(getattr(hf, "topk_method", None) or default)


def routing_options(hf: Any) -> dict[str, Any]:
    """`ModelOps.select_experts` arguments for config `hf` (renormalize, scoring and the keyword
    options; the correction bias is the block's parameter): see the module docstring."""
    method = topk_method(hf)
    if method not in TOPK_METHODS:
        raise ValueError(f"MoE topk_method {method!r} is not supported; portside supports {', '.join(TOPK_METHODS)}")
    scoring = getattr(hf, "scoring_func", None) or ("sigmoid" if method == "noaux_tc" else "softmax")
    groups = int(getattr(hf, "n_group", None) or 1)
    options: dict[str, Any] = dict(renormalize=bool(getattr(hf, "norm_topk_prob", False)), scoring=scoring,
                                   scaling_factor=float(getattr(hf, "routed_scaling_factor", None) or 1.0))  # fmt: skip
    if method != "greedy" and groups > 1:
        options.update(num_groups=groups, topk_groups=int(getattr(hf, "topk_group", None) or groups),
                       group_scoring="top2_sum" if method == "noaux_tc" else "max")  # fmt: skip
    return options


class SharedExperts(GatedMLP):
    """The shared experts: a gated MLP whose down projection's partial sum (this rank's slice of
    the intermediate dimension) is left for the block's one all-reduce."""

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> this rank's term of [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        h = self.act(gate) * up
        down = self.down_proj
        y = down.matmul(h)
        if down.lora is not None:
            down.lora.apply(h, y)
        return y


class DeepseekMoE(nn.Module):
    """x [T, hidden] -> routed experts' weighted sum + shared experts' output [T, hidden] (summed
    over tensor-parallel ranks)."""

    def __init__(self, hf_config: Any, ops: ModelOps, comm: Communicator, tp_rank: int, tp_size: int,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        hf = hf_config
        num_experts, hidden = int(hf.n_routed_experts), int(hf.hidden_size)
        inter = int(hf.moe_intermediate_size)
        self.top_k = int(hf.num_experts_per_tok)
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} of {num_experts} routed experts")
        self.ops, self.comm, self.tp_size = ops, comm, tp_size
        options = routing_options(hf)
        self.renormalize, self.scoring = options.pop("renormalize"), options.pop("scoring")
        self.options = options
        self.gate = ReplicatedLinear(hidden, num_experts, False, torch.float32)  # fp32, as transformers keeps it
        self.gate.quantizable = False
        if topk_method(hf) == "noaux_tc":
            self.gate.e_score_correction_bias = _param(num_experts, dtype=torch.float32, loader=default_weight_loader)
        self.experts = MoEExperts(num_experts, hidden, inter, tp_rank, tp_size, dtype)
        shared = int(getattr(hf, "n_shared_experts", None) or 0)
        tp = TP(comm, tp_rank, tp_size, ops)
        act = getattr(hf, "hidden_act", None) or "silu"
        self.shared_experts = SharedExperts(hidden, shared * inter, False, act, tp, dtype) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """(router logits [T, E] fp32, the routing options with this layer's correction bias)."""
        logits = self.gate(x.float())
        bias = getattr(self.gate, "e_score_correction_bias", None)
        return logits, dict(self.options, correction_bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        logits, options = self.route(x)
        ex = self.experts
        if ex.quant13 is not None:
            weights, ids = self.ops.select_experts(logits, self.top_k, self.renormalize, self.scoring, **options)
            y = self.ops.quantized_moe_experts(x, ex.quant13, ex.quant2, weights, ids)  # type: ignore[arg-type]
        else:
            y = self.ops.fused_moe(x, logits, ex.w13, ex.w2, self.top_k, self.renormalize, self.scoring, **options)
        if self.shared_experts is not None:
            y = y + self.shared_experts.partial(x)
        return self.comm.all_reduce(y) if self.tp_size > 1 else y
