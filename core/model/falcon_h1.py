"""Falcon-H1 (TII): every layer runs attention and a Mamba-2 mixer side by side on the same
normed input and adds both to the residual, then a gated MLP. Its µP multipliers are config
data: the embedding, the LM head, attention's input, keys and output, the mixer's input and
output, one per part of the mixer's in_proj (``ssm_multipliers``: z, x, B, C, dt) and the MLP's
gate and down projections (``mlp_multipliers``). The mixer's width is ``mamba_d_ssm`` (else
``mamba_expand * hidden``); its gated RMSNorm is optional (``mamba_rms_norm``, normalising before
or after the gate: ``mamba_norm_before_gate``; per group of channels).

The mixer is the shared `Mamba2Mixer` (its tensor parallelism: heads split over ranks, B/C
groups split or copied); attention heads split as in the decoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from portside.contract import ForwardContext
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderAttention, GatedMLP
from portside.model.hybrid_decoder import HybridForCausalLM, HybridLayer, Rope
from portside.model.layers import RMSNorm, RowParallelLinear
from portside.model.mamba2_mixer import Mamba2Mixer
from portside.model.rotary import RotaryEmbedding

__all__ = ["FalconH1ForCausalLM"]


def falcon_h1_mixer(hf: Any, hidden_size: int, eps: float, tp: TP, dtype: torch.dtype) -> Mamba2Mixer:
    """The layer's Mamba-2 mixer, sized from the config (mamba_d_ssm: its width, = heads x head dim)."""
    d_ssm = hf.mamba_d_ssm if hf.mamba_d_ssm is not None else int(hf.mamba_expand * hidden_size)
    if hf.mamba_n_heads * hf.mamba_d_head != d_ssm:
        raise ValueError(f"Falcon-H1: mamba_n_heads ({hf.mamba_n_heads}) x mamba_d_head ({hf.mamba_d_head}) != "
                         f"the mixer's width ({d_ssm})")
    mixer = Mamba2Mixer(
        hidden_size, hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups, hf.mamba_d_conv, tp, dtype,
        use_bias=hf.mamba_proj_bias, use_conv_bias=hf.mamba_conv_bias, norm_eps=eps, time_step_limit=hf.time_step_limit,
        activation=hf.hidden_act, use_norm=hf.mamba_rms_norm, norm_groups=hf.mamba_n_groups,
        norm_before_gate=hf.mamba_norm_before_gate, proj_multipliers=hf.ssm_multipliers,
    )
    if hf.projectors_bias != hf.mamba_proj_bias:  # out_proj's bias is projectors_bias, in_proj's mamba_proj_bias
        mixer.out_proj = RowParallelLinear(d_ssm, hidden_size, hf.projectors_bias, tp.rank, tp.size, dtype, tp.comm)
    return mixer


class FalconH1Attention(DecoderAttention):
    """The decoder's attention with keys times `key_multiplier` (applied after rotary: a scalar)."""

    key_multiplier = 1.0

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = super().qkv(x, cos, sin)
        return q, k * self.key_multiplier, v


class FalconH1MLP(GatedMLP):
    """down(up(x) * act(gate(x) * gate_multiplier)) * down_multiplier."""

    gate_multiplier = down_multiplier = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1Layer(HybridLayer):
    """h + mamba(n) * ssm_out + attn(n * attn_in) * attn_out with n = input_layernorm(h); then
    h + mlp(pre_ff_layernorm(h))."""

    def __init__(self, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        hf, hidden, eps = args.hf_config, args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(hidden, eps, dtype)
        self.mamba = falcon_h1_mixer(hf, hidden, eps, tp, dtype)
        self.ssm_in = float(hf.ssm_in_multiplier)
        self.self_attn = FalconH1Attention(args, i, tp, dtype, None, RMSNorm)
        self.self_attn.key_multiplier = float(hf.key_multiplier)
        self.feed_forward = FalconH1MLP(hidden, args.intermediate_size, args.mlp_bias, args.hidden_act, tp, dtype)
        self.feed_forward.gate_multiplier, self.feed_forward.down_multiplier = (float(m) for m in hf.mlp_multipliers)
        self.attn_in, self.attn_out = float(hf.attention_in_multiplier), float(hf.attention_out_multiplier)
        self.ssm_out = float(hf.ssm_out_multiplier)

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None,
                state_idx: int | None) -> torch.Tensor:
        assert attn_idx is not None and state_idx is not None and self.self_attn is not None
        x = self.input_layernorm(h)
        m = self.mamba(x * self.ssm_in, ctx.state_caches[state_idx], ctx.recurrent) * self.ssm_out
        attn = self.self_attn
        q, k, v = attn.qkv(x * self.attn_in, rope[0], rope[1])
        a = attn.out(ctx.attention(attn_idx, q, k, v, attn.scale, **attn.features)) * self.attn_out
        h = h + (m + a)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class FalconH1ForCausalLM(HybridForCausalLM):
    state_kind = "mamba2"

    @classmethod
    def make_layer(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> HybridLayer:
        return FalconH1Layer(args, i, tp, dtype)

    @classmethod
    def make_rotary(cls, args: ModelArgs) -> nn.Module:
        return RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings,
                               args.max_model_len, rotary_dim=int(args.head_dim * args.partial_rotary_factor))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.model.embed_tokens is not None
        return self.model.embed_tokens(input_ids) * float(self.config.hf_config.embedding_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return (self.lm_head(hidden) * float(self.config.hf_config.lm_head_multiplier)).float()
