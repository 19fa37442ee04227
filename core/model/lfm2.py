"""LFM2 and LFM2-MoE (LiquidAI): gated short-convolution layers beside GQA attention layers.

Each layer normalises its input (`operator_norm`), mixes it with attention (q/k RMS-normed per
head, rotary) or with a short convolution, adds the residual, then a SwiGLU feed-forward
(`ffn_norm`; LFM2-MoE: a sigmoid-routed mixture of experts after its first `num_dense_layers`
layers). ``layer_types`` says which layer is which ("conv" or "full_attention").

The short convolution (`ShortConv`): ``in_proj`` gives three hidden-wide projections B, C and x;
``y = C * conv(B * x)`` with a depthwise causal convolution of `conv_L_cache` taps (no
activation), then ``out_proj``. Its state per sequence is the last ``L_cache - 1`` inputs of the
convolution: ``[hidden, L_cache - 1]``.

Tensor parallelism: the convolution's channels split over ranks (each rank keeps its slice of
B, C and x: ``in_proj`` column-parallel per part, the convolution's taps and state by channel,
``out_proj`` row-parallel), attention heads as in every decoder.

LFM2's FFN width: with ``block_auto_adjust_ff_dim`` the config's intermediate_size is taken to
2/3, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of`` (as transformers'
Lfm2MLP sizes it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, cast

import torch
from torch import nn

from portside.contract import Communicator, ForwardContext, ModelOps, RecurrentMetadata, StateSpec, kernels_for
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderAttention, GatedMLP
from portside.model.hybrid_decoder import HybridForCausalLM, HybridLayer, Rope
from portside.model.hybrid_layers import check_layer_types
from portside.model.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    _copy,
    _divide,
    _param,
)
from portside.model.moe import MoEExperts
from portside.model.pipeline import PipelineStage
from portside.model.rotary import RotaryEmbedding

__all__ = ["Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "ShortConv", "lfm2_ff_dim"]

LAYER_TYPES = ("conv", "full_attention")


def lfm2_ff_dim(hf: Any) -> int:
    """The width of LFM2's feed-forward (see the module's docstring)."""
    width = int(hf.intermediate_size)
    if not getattr(hf, "block_auto_adjust_ff_dim", False):
        return width
    width = int(2 * width / 3)
    multiplier = getattr(hf, "block_ffn_dim_multiplier", None)
    if multiplier is None:
        return width
    width = int(multiplier * width)
    step = int(hf.block_multiple_of)
    return step * -(-width // step)


class ShortConvInProj(ColumnParallelLinear):
    """in_proj [3 * hidden, hidden] (B, C, x rows), each rank keeping its channels of each part:
    rank r's weight is ``[B_r; C_r; x_r]``."""

    def __init__(self, channels: int, bias: bool, tp: TP, dtype: torch.dtype) -> None:
        self.channels = channels
        self.local = _divide(channels, tp.size, "LFM2 convolution channels (hidden_size)")
        super().__init__(channels, 3 * channels, bias, tp.rank, tp.size, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != 3 * self.channels:
            raise ValueError(f"has {loaded.shape[0]} rows, expected 3 * hidden_size = {3 * self.channels}")
        for j, part in enumerate(loaded.chunk(3, dim=0)):
            _copy(param.data.narrow(0, j * self.local, self.local), part.narrow(0, self.tp_rank * self.local, self.local),
                  ("B", "C", "x")[j])


class DepthwiseConv(nn.Module):
    """A depthwise convolution's taps, weight [channels / tp, kernel] (checkpoint [channels, 1,
    kernel]), and bias [channels / tp]: this rank's channels."""

    def __init__(self, channels: int, kernel: int, bias: bool, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.channels = channels
        self.local = _divide(channels, tp.size, "LFM2 convolution channels (hidden_size)")
        self.start = tp.rank * self.local
        self.weight = _param(self.local, kernel, dtype=dtype, loader=self.loader)
        self.bias = _param(self.local, dtype=dtype, loader=self.loader) if bias else None

    def loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.channels:
            raise ValueError(f"has {loaded.shape[0]} channels, expected {self.channels}")
        _copy(param.data, loaded.reshape(self.channels, *param.shape[1:]).narrow(0, self.start, self.local), "conv")


class ShortConv(nn.Module):
    """LFM2's gated short convolution: x [T, hidden] -> [T, hidden] (see the module's docstring)."""

    def __init__(self, hidden: int, kernel: int, bias: bool, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        if kernel < 2:
            raise ValueError(f"LFM2: conv_L_cache {kernel}; expected at least 2")
        self.kernel, self.ops = kernel, tp.ops
        self.in_proj = ShortConvInProj(hidden, bias, tp, dtype)
        self.conv = DepthwiseConv(hidden, kernel, bias, tp, dtype)
        self.out_proj = RowParallelLinear(hidden, hidden, bias, tp.rank, tp.size, dtype, tp.comm)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], md: RecurrentMetadata) -> torch.Tensor:
        b, c, u = self.in_proj(x).chunk(3, dim=-1)  # this rank's channels of each
        y = kernels_for(self.ops, md).causal_conv1d(b * u, self.conv.weight, self.conv.bias, state[0], md, activation=None)
        return self.out_proj(c * y)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One sequence's state: this rank's channels' last L_cache - 1 convolution inputs."""
        return ((self.conv.local, self.kernel - 1),)


class Lfm2MoeBlock(nn.Module):
    """LFM2-MoE's experts: each token's top-k experts by sigmoid score (plus `expert_bias` for the
    choice only), weighted by their scores (renormalised where `norm_topk_prob`) times
    `routed_scaling_factor`. Experts split along their intermediate dimension over ranks."""

    def __init__(self, hf: Any, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.renormalize = int(hf.num_experts_per_tok), bool(hf.norm_topk_prob)
        self.scaling = float(hf.routed_scaling_factor)
        self.tp = tp
        self.gate = ReplicatedLinear(hf.hidden_size, hf.num_experts, False, dtype)
        self.gate.quantizable = False  # routers stay in full precision
        self.experts = MoEExperts(hf.num_experts, hf.hidden_size, hf.moe_intermediate_size, tp.rank, tp.size, dtype)
        self.expert_bias = _param(hf.num_experts, dtype=torch.float32, loader=self._load_bias) \
            if hf.use_expert_bias else None

    @staticmethod
    def _load_bias(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy(param.data, loaded.float(), "expert_bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        scores = torch.sigmoid(self.gate(x).float())  # [T, E]
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        ids = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        weights = weights * self.scaling
        ex, ops = self.experts, self.tp.ops
        if ex.quant13 is not None:
            y = ops.quantized_moe_experts(x, ex.quant13, ex.quant2, weights, ids)  # type: ignore[arg-type]
        else:
            y = ops.moe_experts(x, ex.w13, ex.w2, weights, ids)
        return self.tp.comm.all_reduce(y) if self.tp.size > 1 else y


class Lfm2Layer(HybridLayer):
    """operator_norm -> attention or short convolution -> residual; ffn_norm -> feed-forward -> residual."""

    def __init__(self, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype, feed_forward: nn.Module) -> None:
        super().__init__()
        hf, hidden, eps = args.hf_config, args.hidden_size, args.rms_norm_eps
        self.operator_norm = RMSNorm(hidden, eps, dtype)
        if hf.layer_types[i] == "full_attention":
            self.self_attn = DecoderAttention(args, i, tp, dtype, "head", RMSNorm)
        else:
            self.conv = ShortConv(hidden, int(hf.conv_L_cache), bool(hf.conv_bias), tp, dtype)
        self.ffn_norm = RMSNorm(hidden, eps, dtype)
        self.feed_forward = feed_forward

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None,
                state_idx: int | None) -> torch.Tensor:
        x = self.operator_norm(h)
        if self.self_attn is not None:
            attn = self.self_attn
            assert attn_idx is not None
            q, k, v = attn.qkv(x, rope[0], rope[1])
            mixed = attn.out(ctx.attention(attn_idx, q, k, v, attn.scale, **attn.features))
        else:
            assert state_idx is not None
            mixed = self.conv(x, ctx.state_caches[state_idx], ctx.recurrent)
        h = h + mixed
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2ForCausalLM(HybridForCausalLM):
    """Serves Lfm2ForCausalLM (see the module's docstring)."""

    mixer_name: ClassVar[str] = "conv"
    state_kind: ClassVar[str] = "short_conv"
    # checkpoint names -> portside's: attention and MLP named as every decoder's (a LoRA adapter's
    # q/k/v_proj, out_proj, w1/w3 and w2 map to the qkv_proj, o_proj, gate_up_proj and down_proj
    # layers; portside.lora.peft's checks admit LFM2's q/k/v_proj only for now)
    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.embedding_norm.", "model.norm."),
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )

    def __init__(
        self,
        args: ModelArgs,
        comm: Communicator | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        ops: ModelOps | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        hf = args.hf_config
        if hf is None:
            raise ValueError(f"{args.architecture}: the model needs its transformers config (ModelArgs.hf_config)")
        check_layer_types(args.architecture, hf.layer_types, LAYER_TYPES)
        sizes = {"hidden_size (the short convolutions' channels)": args.hidden_size,
                 "num_attention_heads": args.num_heads, **self.ffn_widths(hf)}
        for what, n in sizes.items():
            if n % tp_size:
                raise ValueError(f"{args.architecture} over {tp_size} tensor-parallel ranks: {what} {n} is not divisible "
                                 f"by {tp_size}; use a tensor-parallel size that divides it")
        # LFM2's norms read norm_eps (ModelArgs reads rms_norm_eps)
        args = dataclasses.replace(args, rms_norm_eps=float(hf.norm_eps))
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops, stage)

    def state_spec(self) -> StateSpec:
        """Each short convolution's one state tensor, in the model's dtype."""
        convs = [cast(ShortConv, self._mixer(self._layer(i))) for i in range(self.num_layers)
                 if self._state_idx[i] is not None]
        shapes = convs[0].state_shapes() if convs else ()
        return StateSpec(num_layers=len(convs), shapes=shapes, dtypes=(self.dtype,) * len(shapes), kind=self.state_kind)

    @classmethod
    def make_rotary(cls, args: ModelArgs) -> nn.Module:
        return RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings,
                               args.max_model_len)

    @classmethod
    def ffn_widths(cls, hf: Any) -> dict[str, int]:
        """The feed-forward widths tensor parallelism splits, by name."""
        return {"the feed-forward width": lfm2_ff_dim(hf)}

    @classmethod
    def make_feed_forward(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> nn.Module:
        return GatedMLP(args.hidden_size, lfm2_ff_dim(args.hf_config), False, "silu", tp, dtype)

    @classmethod
    def make_layer(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> HybridLayer:
        return Lfm2Layer(args, i, tp, dtype, cls.make_feed_forward(args, i, tp, dtype))


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """Serves Lfm2MoeForCausalLM: LFM2 whose layers after the first `num_dense_layers` hold
    experts (`Lfm2MoeBlock`); the dense ones are SwiGLU of intermediate_size."""

    @classmethod
    def ffn_widths(cls, hf: Any) -> dict[str, int]:
        dense = {"intermediate_size": int(hf.intermediate_size)} if hf.num_dense_layers else {}
        return {**dense, "moe_intermediate_size": int(hf.moe_intermediate_size)}

    @classmethod
    def make_feed_forward(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> nn.Module:
        hf = args.hf_config
        if i < int(hf.num_dense_layers):
            return GatedMLP(args.hidden_size, int(hf.intermediate_size), False, "silu", tp, dtype)
        return Lfm2MoeBlock(hf, tp, dtype)
