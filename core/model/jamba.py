"""Jamba (AI21): Mamba-1 layers with an attention layer every `attn_layer_period` layers (at
`attn_layer_offset`), and a mixture of experts in place of the MLP every `expert_layer_period`
layers (at `expert_layer_offset`). Attention has no positional encoding; the Mamba layers
RMS-norm their dt, B and C (`Mamba1Mixer` with inner norms); the router takes the top-k of a
softmax without renormalising.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from portside.contract import ForwardContext
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderAttention, GatedMLP
from portside.model.hybrid_decoder import HybridForCausalLM, HybridLayer, Rope
from portside.model.layers import RMSNorm
from portside.model.mamba1_mixer import Mamba1Mixer
from portside.model.moe import SparseMoEBlock

__all__ = ["JambaForCausalLM"]


def jamba_layout(hf: Any, i: int) -> tuple[bool, bool]:
    """(layer i attends, layer i has experts), as JambaConfig's layers_block_type and layers_num_experts."""
    attends = i % hf.attn_layer_period == hf.attn_layer_offset
    experts = hf.num_experts > 1 and i % hf.expert_layer_period == hf.expert_layer_offset
    return attends, experts


class JambaLayer(HybridLayer):
    """input_layernorm -> attention or Mamba -> residual; pre_ff_layernorm -> MLP or experts -> residual."""

    def __init__(self, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        hf, hidden, eps = args.hf_config, args.hidden_size, args.rms_norm_eps
        attends, experts = jamba_layout(hf, i)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(hidden, eps, dtype)
        if attends:
            self.self_attn = DecoderAttention(args, i, tp, dtype, None, RMSNorm)
        else:
            if hf.hidden_act != "silu":
                raise ValueError(f"Jamba: hidden_act {hf.hidden_act!r} in the Mamba layers' convolution; portside's "
                                 "causal_conv1d kernels apply silu")
            self.mamba = Mamba1Mixer(
                hidden, hf.mamba_expand * hidden, hf.mamba_d_state, hf.mamba_d_conv, hf.mamba_dt_rank,
                hf.mamba_conv_bias, hf.mamba_proj_bias, True, eps, tp, dtype,
            )
        self.feed_forward: nn.Module
        if experts:
            self.feed_forward = SparseMoEBlock(hidden, hf.num_experts, hf.num_experts_per_tok, args.intermediate_size,
                                               False, tp.ops, tp.comm, tp.rank, tp.size, dtype)
        else:
            self.feed_forward = GatedMLP(hidden, args.intermediate_size, False, args.hidden_act, tp, dtype)

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None,
                state_idx: int | None) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.self_attn is not None:
            attn = self.self_attn
            q, k, v = attn.qkv(x, rope[0], rope[1])
            assert attn_idx is not None
            mixed = attn.out(ctx.attention(attn_idx, q, k, v, attn.scale, **attn.features))
        else:
            assert state_idx is not None
            mixed = self.mamba(x, ctx.state_caches[state_idx], ctx.recurrent)
        h = h + mixed
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class JambaForCausalLM(HybridForCausalLM):
    renames = (*HybridForCausalLM.renames, (".feed_forward.router.", ".feed_forward.gate."))

    @classmethod
    def make_layer(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> HybridLayer:
        return JambaLayer(args, i, tp, dtype)
