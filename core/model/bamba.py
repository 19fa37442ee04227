"""Bamba (IBM): Mamba-2 layers with attention layers at `attn_layer_indices`, each layer followed
by a gated MLP. Attention rotates half of each head (partial rotary 0.5, as transformers fixes
it for Bamba). The layer (`Mamba2HybridLayer`) and the Mamba-2 mixer built from the ``mamba_*``
fields (`mamba2_from_mamba_fields`) are Granite 4.0-H's too (`portside.model.granite_h`).

Checkpoint names (Hugging Face's): model.embed_tokens, model.layers.i.{input_layernorm,
pre_ff_layernorm, mamba.* | self_attn.*, feed_forward.{gate,up,down}_proj}, model.final_layernorm,
lm_head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from portside.contract import ForwardContext
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderAttention, GatedMLP
from portside.model.hybrid_decoder import HybridLayer, Rope
from portside.model.hybrid_layers import check_layer_types
from portside.model.layers import RMSNorm
from portside.model.mamba2 import Mamba2FamilyForCausalLM
from portside.model.mamba2_mixer import Mamba2Mixer
from portside.model.rotary import RotaryEmbedding

__all__ = ["BambaForCausalLM", "Mamba2HybridLayer", "attend", "check_mamba2_hybrid_layers", "hybrid_rotary",
           "mamba2_from_mamba_fields"]

_ATTENTION = ("full_attention", "attention")  # transformers 5's name, and 4.x's
LAYER_TYPES = ("linear_attention", "mamba", *_ATTENTION)


def check_mamba2_hybrid_layers(args: ModelArgs) -> None:
    """Refuse a config naming a layer type other than Mamba-2 or attention (naming it)."""
    check_layer_types(args.architecture, args.hf_config.layers_block_type, LAYER_TYPES)


def mamba2_from_mamba_fields(hf: Any, tp: TP, dtype: torch.dtype) -> Mamba2Mixer:
    """The Mamba-2 mixer of a config with Bamba's field names (mamba_n_heads, mamba_d_head, ...)."""
    return Mamba2Mixer(
        hf.hidden_size, hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups, hf.mamba_d_conv, tp,
        dtype, use_bias=bool(hf.mamba_proj_bias), use_conv_bias=bool(hf.mamba_conv_bias), norm_eps=hf.rms_norm_eps,
        time_step_limit=getattr(hf, "time_step_limit", None), activation=hf.hidden_act,
    )


def attend(attn: DecoderAttention, x: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None) -> torch.Tensor:
    """Attention layer `attn_idx` (its ordinal among the attention layers) over normed x [T, hidden]."""
    assert attn_idx is not None
    q, k, v = attn.qkv(x, rope[0], rope[1])
    return attn.out(ctx.attention(attn_idx, q, k, v, attn.scale, **attn.features))


def hybrid_rotary(args: ModelArgs) -> nn.Module:
    """The attention layers' rotary table (partial where the config rotates part of each head)."""
    return RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings,
                           args.max_model_len, rotary_dim=int(args.head_dim * args.partial_rotary_factor))


class Mamba2HybridLayer(HybridLayer):
    """input_layernorm, then Mamba-2 (``mamba``) or attention (``self_attn``); the block after it
    is the architecture's (`forward`)."""

    def __init__(self, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        if args.hf_config.layers_block_type[i] in _ATTENTION:
            self.self_attn = DecoderAttention(args, i, tp, dtype, None, RMSNorm)
        else:
            self.mamba = mamba2_from_mamba_fields(args.hf_config, tp, dtype)

    def mix(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None,
            state_idx: int | None) -> torch.Tensor:
        """The layer's token mixing of input_layernorm(h): attention or the Mamba-2 mixer."""
        x = self.input_layernorm(h)
        if self.self_attn is not None:
            return attend(self.self_attn, x, rope, ctx, attn_idx)
        assert state_idx is not None
        return self.mamba(x, ctx.state_caches[state_idx], ctx.recurrent)


class BambaLayer(Mamba2HybridLayer):
    """Mamba-2 or attention, residual; pre_ff_layernorm, gated MLP (feed_forward), residual."""

    def __init__(self, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> None:
        super().__init__(args, i, tp, dtype)
        self.pre_ff_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.feed_forward = GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, args.hidden_act, tp, dtype)

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None,
                state_idx: int | None) -> torch.Tensor:
        h = h + self.mix(h, rope, ctx, attn_idx, state_idx)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class BambaForCausalLM(Mamba2FamilyForCausalLM):
    mixer_name = "mamba"

    def __init__(self, args: ModelArgs, *rest: Any, **kwargs: Any) -> None:  # HybridForCausalLM's arguments
        check_mamba2_hybrid_layers(args)
        super().__init__(args, *rest, **kwargs)

    @classmethod
    def make_layer(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> HybridLayer:
        return BambaLayer(args, i, tp, dtype)

    @classmethod
    def make_rotary(cls, args: ModelArgs) -> nn.Module:
        return hybrid_rotary(args)
