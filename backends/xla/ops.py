"""Model-layer kernels that trace to static shapes under XLA (`XlaPlatform.model_ops`).

Core's mixture-of-experts reference gathers each expert's tokens with ``nonzero``: a
data-dependent shape, so a new XLA program for every routing. Here every expert runs densely on
every token and a ``[T, E]`` combine-weight matrix (each token's routing weight of an expert, 0
where not routed) sums their outputs: one fixed graph per token bucket, at E / top_k times the
expert FLOPs and ``[T, E, 2I]`` activations. Fine for the small expert counts of tests; a TPU
serving a large MoE wants a grouped-matmul (Pallas gmm) kernel instead.
"""

from __future__ import annotations

import torch

from portside.contract import ModelOps
from portside.contract.model_ops import SWIGLU_OAI_ALPHA

__all__ = ["XlaModelOps"]


class XlaModelOps(ModelOps):
    name = "xla-dense"

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, activation="silu", *, w13_bias=None, w2_bias=None,
                    swiglu_alpha=SWIGLU_OAI_ALPHA, swiglu_limit=7.0):  # fmt: skip
        num_experts = w13.shape[0]
        experts = torch.arange(num_experts, device=x.device)
        routed = topk_ids.unsqueeze(-1) == experts  # [T, k, E]
        combine = (topk_weights.float().unsqueeze(-1) * routed).sum(dim=1)  # [T, E] fp32
        gate_up = torch.einsum("th,eoh->teo", x, w13)  # [T, E, 2I]
        if w13_bias is not None:
            gate_up = gate_up + w13_bias.to(gate_up.dtype)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, E, I] each
        h = self.activate(gate, activation, up, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        y = torch.einsum("tei,ehi->teh", h, w2)  # [T, E, hidden]
        if w2_bias is not None:
            y = y + w2_bias.to(y.dtype)
        return torch.einsum("teh,te->th", y.float(), combine).to(x.dtype)
