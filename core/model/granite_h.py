"""Granite 4.0-H (IBM's GraniteMoeHybrid): Bamba's Mamba-2 / attention layers, each followed by
a shared gated MLP plus, where the config has experts, a top-k mixture of experts (softmax over
the chosen logits, i.e. renormalised). muP multipliers: embeddings times `embedding_multiplier`,
each block's output times `residual_multiplier`, attention scores scaled by
`attention_multiplier` (not head_dim^-1/2), logits divided by `logits_scaling`. Attention rotates
only with ``position_embedding_type: "rope"`` (Granite 4.0-H has no positional encoding).

Checkpoint names (Hugging Face's): model.layers.i.{input_layernorm, post_attention_layernorm,
mamba.* | self_attn.*, shared_mlp.input_linear (gate then up rows) / output_linear,
block_sparse_moe.router.layer, block_sparse_moe.input_linear [E, 2I, hidden] /
output_linear [E, hidden, I]}, model.norm, lm_head (transformers 5's in-memory names load too).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from portside.contract import ForwardContext
from portside.model.args import ModelArgs
from portside.model.bamba import Mamba2HybridLayer, check_mamba2_hybrid_layers, hybrid_rotary
from portside.model.decoder import TP, GatedMLP
from portside.model.hybrid_decoder import HybridForCausalLM, HybridLayer, NoRope, Rope
from portside.model.layers import RMSNorm
from portside.model.mamba2 import Mamba2FamilyForCausalLM
from portside.model.moe import SparseMoEBlock

__all__ = ["GraniteMoeHybridForCausalLM"]


class GraniteHybridLayer(Mamba2HybridLayer):
    """Mamba-2 or attention; post_attention_layernorm; shared MLP (+ experts); both blocks'
    outputs scaled by the residual multiplier."""

    def __init__(self, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> None:
        super().__init__(args, i, tp, dtype)
        hf = args.hf_config
        self.residual_multiplier = float(hf.residual_multiplier)
        if self.self_attn is not None:
            self.self_attn.scale = float(hf.attention_multiplier)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.shared_mlp = GatedMLP(args.hidden_size, hf.shared_intermediate_size, False, args.hidden_act, tp, dtype)
        self.block_sparse_moe: nn.Module | None = None
        if args.num_experts > 0:
            self.block_sparse_moe = SparseMoEBlock(
                args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size, True,
                tp.ops, tp.comm, tp.rank, tp.size, dtype,
            )

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None,
                state_idx: int | None) -> torch.Tensor:
        h = h + self.mix(h, rope, ctx, attn_idx, state_idx) * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        y = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            y = self.block_sparse_moe(x) + y
        return h + y * self.residual_multiplier


class GraniteMoeHybridForCausalLM(Mamba2FamilyForCausalLM):
    mixer_name = "mamba"
    renames = (
        *HybridForCausalLM.renames,
        (".block_sparse_moe.router.layer.", ".block_sparse_moe.gate."),
        (".block_sparse_moe.router.", ".block_sparse_moe.gate."),  # transformers 5's in-memory name
        # the experts' stacked tensors under transformers 5's names, which the decoder loads
        (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
        (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
    )

    def __init__(self, args: ModelArgs, *rest: Any, **kwargs: Any) -> None:  # HybridForCausalLM's arguments
        check_mamba2_hybrid_layers(args)
        super().__init__(args, *rest, **kwargs)
        multiplier = float(getattr(args.hf_config, "embedding_multiplier", 1.0) or 1.0)
        self.embed_scale = multiplier if multiplier != 1.0 else None
        self.logits_scaling = float(getattr(args.hf_config, "logits_scaling", 1.0) or 1.0)

    @classmethod
    def make_layer(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> HybridLayer:
        return GraniteHybridLayer(args, i, tp, dtype)

    @classmethod
    def make_rotary(cls, args: ModelArgs) -> nn.Module:
        return hybrid_rotary(args) if args.hf_config.position_embedding_type == "rope" else NoRope()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, object, torch.Tensor]]:
        if name.endswith(".shared_mlp.input_linear.weight"):  # gate rows, then up rows
            if tensor.shape[0] % 2:
                raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)}: expected gate and up rows")
            target = name.replace(".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj.")
            return [(target, sid, part) for sid, part in enumerate(tensor.chunk(2, dim=0))]
        return super().checkpoint_tensors(name, tensor)
