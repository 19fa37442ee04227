"""Nemotron-H (NVIDIA; Nemotron 3 Nano's MoE form too): a stack of pre-norm residual blocks, each
one mixer by `layers_block_type` (older configs: the `hybrid_override_pattern` string, which
transformers turns into it): "linear_attention" (M, Mamba-2), "full_attention" (*, attention
without positional encoding, no biases), "mlp" (-, up/down with relu^2) or "moe" (E, DeepSeek-V3
style routing: sigmoid scores plus a correction bias choose the top-k within the best groups,
weights renormalised and scaled; non-gated relu^2 experts, optionally in a latent space, plus a
shared expert). Norms multiply their weight in fp32.

Checkpoint names (Hugging Face's): backbone.embeddings, backbone.layers.i.{norm, mixer.*},
backbone.norm_f, lm_head; experts as mixer.experts.e.{up,down}_proj; multi-token-prediction
tensors (mtp.*) are not used, as in transformers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from portside.contract import Communicator, ForwardContext, ModelOps
from portside.model.args import ModelArgs
from portside.model.bamba import attend
from portside.model.decoder import TP, DecoderAttention, activation
from portside.model.hybrid_decoder import HybridLayer, Rope
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
from portside.model.mamba2 import Mamba2FamilyForCausalLM
from portside.model.mamba2_mixer import Mamba2Mixer
from portside.model.pipeline import PipelineStage

__all__ = ["NemotronHForCausalLM"]

# layer type -> the attribute its mixer has here (checkpoints name every one "mixer")
_MIXERS = {"linear_attention": "mixer", "full_attention": "self_attn", "mlp": "mlp", "moe": "moe"}


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda x: F.relu(x).square()) if name == "relu2" else activation(name)


class NemotronHRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in fp32 (the result cast back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class NemotronHMLP(nn.Module):
    """down(act(up(x))): column-parallel up, row-parallel down."""

    def __init__(self, hidden: int, inter: int, bias: bool, act: str, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, inter, bias, tp.rank, tp.size, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp.rank, tp.size, dtype, tp.comm)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHExperts(nn.Module):
    """w1 [E, I / tp, in] (up), w2 [E, in, I / tp] (down): each rank a slice of every expert."""

    def __init__(self, num_experts: int, dim: int, inter: int, act: str, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.local, self.rank = _divide(inter, tp.size, "expert intermediate size"), tp.rank
        self.w1 = _param(num_experts, self.local, dim, dtype=dtype, loader=self._loader(1, "up"))
        self.w2 = _param(num_experts, dim, self.local, dtype=dtype, loader=self._loader(2, "down"))
        self.w1.shard_ids = [(e, "up") for e in range(num_experts)]  # type: ignore[attr-defined]
        self.w2.shard_ids = [(e, "down") for e in range(num_experts)]  # type: ignore[attr-defined]
        self.act = _act(act)

    def _loader(self, which: int, part: str) -> Callable[..., None]:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
            dim = 1 if which == 1 else 2  # the intermediate dimension of the stacked [E, ...] tensor
            if shard_id is None:  # stacked (transformers 5's in-memory form)
                _copy(param.data, loaded.narrow(dim, self.rank * self.local, self.local), f"experts.{part}_proj")
                return
            e = cast(tuple[int, str], shard_id)[0]
            _copy(param.data[e], loaded.narrow(dim - 1, self.rank * self.local, self.local), f"expert {e} {part}_proj")

        return load

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * down(act(up(x[t]))) of expert ids[t, k]; fp32 [T, in]."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y = F.linear(self.act(F.linear(x[rows], self.w1[e])), self.w2[e])
            out.index_add_(0, rows, y.float() * weights[rows, slot].unsqueeze(1))
        return out


class _Router(nn.Module):
    """The router's parameters: weight [E, hidden] and e_score_correction_bias [E], fp32."""

    weight: nn.Parameter
    e_score_correction_bias: nn.Parameter


class NemotronHMoE(nn.Module):
    """Router (fp32 weight and correction bias), experts, latent projections, shared expert."""

    def __init__(self, hf: Any, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, E = hf.hidden_size, hf.n_routed_experts
        self.top_k, self.n_group, self.topk_group = hf.num_experts_per_tok, hf.n_group, hf.topk_group
        if E % self.n_group:
            raise ValueError(f"Nemotron-H: {E} experts do not split into n_group={self.n_group} groups")
        self.norm_topk_prob, self.scaling = bool(hf.norm_topk_prob), float(hf.routed_scaling_factor)
        self.comm, self.tp_size, self.ops = tp.comm, tp.size, tp.ops
        self.gate = _Router()
        self.gate.weight = _param(E, hidden, dtype=torch.float32, loader=_fp32_loader)
        bias = _param(E, dtype=torch.float32, loader=_fp32_loader)
        bias.data.zero_()
        bias.optional = True  # type: ignore[attr-defined]  # checkpoints without it route without a correction
        self.gate.e_score_correction_bias = bias
        latent = hf.moe_latent_size
        self.fc1_latent_proj = ReplicatedLinear(hidden, latent, hf.mlp_bias, dtype) if latent else None
        self.fc2_latent_proj = ReplicatedLinear(latent, hidden, hf.mlp_bias, dtype) if latent else None
        self.experts = NemotronHExperts(E, latent or hidden, hf.moe_intermediate_size, hf.mlp_hidden_act, tp, dtype)
        self.shared_experts = NemotronHMLP(hidden, hf.moe_shared_expert_intermediate_size, hf.mlp_bias,
                                           hf.mlp_hidden_act, tp, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]): DeepSeek-V3's noaux_tc routing (sigmoid scores,
        chosen with the correction bias within the topk_group best groups, each scored by its two
        best), through the platform's `select_experts`."""
        logits = F.linear(x.float(), self.gate.weight.float())
        return self.ops.select_experts(
            logits, self.top_k, self.norm_topk_prob, "sigmoid", num_groups=self.n_group, topk_groups=self.topk_group,
            group_scoring="top2_sum", correction_bias=self.gate.e_score_correction_bias, scaling_factor=self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        inner = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        y = self.experts(inner, weights, ids)
        if self.tp_size > 1:  # each rank summed its slice of every expert
            y = self.comm.all_reduce(y)
        y = y.to(x.dtype)
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x)


def _fp32_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    _copy(param.data, loaded.float(), "router")


class NemotronHLayer(HybridLayer):
    """h + mixer(norm(h)), the mixer by the layer's type (see `_MIXERS`)."""

    def __init__(self, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        hf = args.hf_config
        self.kind = kind = str(hf.layers_block_type[i])
        self.norm = NemotronHRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(
                hf.hidden_size, hf.mamba_num_heads, hf.mamba_head_dim, hf.ssm_state_size, hf.n_groups,
                hf.conv_kernel, tp, dtype, use_bias=bool(hf.use_bias), use_conv_bias=bool(hf.use_conv_bias),
                norm_eps=hf.layer_norm_epsilon, time_step_limit=hf.time_step_limit, activation=hf.mamba_hidden_act,
            )
        elif kind == "full_attention":  # no biases, no window (as transformers builds it)
            plain = dataclasses.replace(args, qkv_bias=False, o_bias=False, sliding_window=None)
            self.self_attn = DecoderAttention(plain, i, tp, dtype, None, RMSNorm)
        elif kind == "mlp":
            self.mlp = NemotronHMLP(hf.hidden_size, hf.intermediate_size, hf.mlp_bias, hf.mlp_hidden_act, tp, dtype)
        else:
            self.moe = NemotronHMoE(hf, tp, dtype)

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext, attn_idx: int | None,
                state_idx: int | None) -> torch.Tensor:
        x = self.norm(h)
        if self.kind == "linear_attention":
            assert state_idx is not None
            return h + self.mixer(x, ctx.state_caches[state_idx], ctx.recurrent)
        if self.kind == "full_attention":
            return h + attend(cast(DecoderAttention, self.self_attn), x, rope, ctx, attn_idx)
        return h + (self.mlp(x) if self.kind == "mlp" else self.moe(x))


_LAYER_MIXER = re.compile(r"model\.layers\.(\d+)\.mixer\.(.+)$")
_LAYER_ATTR = re.compile(r"model\.layers\.(\d+)\.(?:mixer|self_attn|mlp|moe)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.(up|down)_proj\.weight$")


class NemotronHForCausalLM(Mamba2FamilyForCausalLM):
    mixer_name = "mixer"
    renames = (("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm."))

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None,
                 stage: PipelineStage | None = None) -> None:
        check_layer_types(args.architecture, args.hf_config.layers_block_type, _MIXERS)
        args = dataclasses.replace(args, rms_norm_eps=float(args.hf_config.layer_norm_epsilon))
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops, stage)
        if self.model.norm is not None:
            self.model.norm = NemotronHRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    @classmethod
    def make_layer(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> HybridLayer:
        return NemotronHLayer(args, i, tp, dtype)

    def check_loaded(self, loaded: set[tuple[str, object]]) -> None:
        """Missing tensors named as checkpoints name them (backbone.layers.i.mixer.*)."""
        try:
            super().check_loaded(loaded)
        except ValueError as e:
            raise ValueError(_LAYER_ATTR.sub(r"backbone.layers.\1.mixer.", str(e)).replace("model.", "backbone.")) from None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        return super().load_weights((n, t) for n, t in weights if not n.startswith(("mtp.", "model.mtp.", "backbone.mtp.")))

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, object, torch.Tensor]]:
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        m = _LAYER_MIXER.match(name)
        if m is None or int(m[1]) >= len(self.model.layers):
            return super().checkpoint_tensors(name, tensor)
        attr = _MIXERS[self.config.hf_config.layers_block_type[int(m[1])]]
        name = f"model.layers.{m[1]}.{attr}.{m[2]}"
        if attr in ("mixer", "self_attn"):
            return super().checkpoint_tensors(name, tensor)
        e = _EXPERT.search(name)
        if e:  # one expert's up or down projection
            return [(name[: e.start()] + (".experts.w1" if e[2] == "up" else ".experts.w2"), (int(e[1]), e[2]), tensor)]
        for stacked, param in ((".experts.up_proj", ".experts.w1"), (".experts.down_proj", ".experts.w2")):
            if name.endswith(stacked):
                return [(name.removesuffix(stacked) + param, None, tensor)]
        return [(name, None, tensor)]  # up_proj / down_proj (no gate to fuse), router, latent projections
