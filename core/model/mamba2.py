"""Mamba-2 (state-spaces' mamba2 models, Codestral Mamba): pre-norm Mamba-2 mixers only, no
attention (the KV cache spec has no layers; every layer keeps a recurrent state). With
`residual_in_fp32` (the default) the residual stream is kept in fp32 between layers, as
transformers does. `Mamba2FamilyForCausalLM` is what the family's models (Bamba, Granite 4.0-H,
Nemotron-H) share.

Checkpoint names (Hugging Face's): backbone.embeddings (older: backbone.embedding),
backbone.layers.i.{norm, mixer.*}, backbone.norm_f, lm_head.
"""

from __future__ import annotations

import dataclasses

import torch

from portside.contract import Communicator, ForwardContext, ModelOps, StateSpec
from portside.model.args import ModelArgs
from portside.model.decoder import TP
from portside.model.hybrid_decoder import HybridForCausalLM, HybridLayer, Rope
from portside.model.layers import RMSNorm
from portside.model.mamba2_mixer import Mamba2Mixer
from portside.model.pipeline import PipelineStage

__all__ = ["Mamba2FamilyForCausalLM", "Mamba2ForCausalLM"]


class Mamba2FamilyForCausalLM(HybridForCausalLM):
    """A hybrid model whose recurrent layers are `Mamba2Mixer`s: state kind "mamba2", the conv
    state in the model's dtype, the SSM state in `ModelArgs.ssm_state_dtype` (the engine's
    --mamba-ssm-cache-dtype, else the checkpoint config's mamba_ssm_cache_dtype, else the model's
    dtype, as vLLM keeps it)."""

    state_kind = "mamba2"

    def state_spec(self) -> StateSpec:
        spec = super().state_spec()
        if not spec.num_layers:
            return spec
        return dataclasses.replace(spec, dtypes=(self.dtype, self.config.ssm_state_dtype(self.dtype)))


class Mamba2Layer(HybridLayer):
    """h + mixer(norm(h)), the residual in fp32 where the config keeps it so."""

    def __init__(self, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        hf = args.hf_config
        self.dtype = dtype
        self.residual_in_fp32 = bool(getattr(hf, "residual_in_fp32", True))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.mixer = Mamba2Mixer(
            hf.hidden_size, hf.num_heads, hf.head_dim, hf.state_size, hf.n_groups, hf.conv_kernel, tp, dtype,
            use_bias=bool(hf.use_bias), use_conv_bias=bool(hf.use_conv_bias), norm_eps=hf.layer_norm_epsilon,
            time_step_limit=hf.time_step_limit, activation=hf.hidden_act,
        )

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None,
                state_idx: int | None) -> torch.Tensor:
        assert state_idx is not None
        out = self.mixer(self.norm(h.to(self.dtype)), ctx.state_caches[state_idx], ctx.recurrent)
        return (h.float() if self.residual_in_fp32 else h) + out


class Mamba2ForCausalLM(Mamba2FamilyForCausalLM):
    mixer_name = "mixer"
    renames = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.embedding.", "model.embed_tokens."),
               ("backbone.norm_f.", "model.norm."), ("backbone.", "model."))

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None,
                 stage: PipelineStage | None = None) -> None:
        # the norms' epsilon is layer_norm_epsilon (ModelArgs reads rms_norm_eps)
        args = dataclasses.replace(args, rms_norm_eps=float(args.hf_config.layer_norm_epsilon))
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops, stage)

    @classmethod
    def make_layer(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> HybridLayer:
        return Mamba2Layer(args, i, tp, dtype)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return super().final_norm(h).to(self.dtype)  # an fp32 residual stream back in the model's dtype
