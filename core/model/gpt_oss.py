"""gpt-oss (OpenAI): the decoder with biased q/k/v/o projections, a learned attention sink per
query head (`ATTENTION_FEATURES` "sinks"), layers alternating a sliding window (128 tokens in the
released checkpoints) and full attention, YaRN rotary, and a mixture of experts in every layer:
a biased router whose top-k logits are softmaxed, and experts with biases and a clamped SwiGLU
(`ModelOps.fused_moe` activation "swiglu_oai": alpha `swiglu_alpha`, clamp `swiglu_limit`).

Checkpoint names (transformers' ``GptOssForCausalLM``): ``self_attn.sinks`` [H];
``mlp.router.weight`` [E, hidden] / ``.bias`` [E]; ``mlp.experts.gate_up_proj`` [E, hidden, 2I]
with gate and up INTERLEAVED along the last axis (gate = [..., ::2], up = [..., 1::2]) and its
``gate_up_proj_bias`` [E, 2I] likewise; ``mlp.experts.down_proj`` [E, I, hidden] and
``down_proj_bias`` [E, hidden]. They are loaded into `MoEExperts`' layout (w13 [E, 2I/tp, hidden],
this rank's gate rows then up rows; w2 [E, hidden, I/tp]).

Tensor parallelism: query heads and their sinks, KV heads and every expert's intermediate
dimension are split across ranks; the router is replicated; the experts' output bias is held by
rank 0 only (the ranks' partial outputs are summed). A quantized format (MXFP4 experts) replaces
``w13`` / ``w2`` by `QuantWeight`s in `GptOssExperts.quant13` / ``quant2``; the biases stay.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from portside.contract import Communicator, ModelOps
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderForCausalLM
from portside.model.layers import ReplicatedLinear, RMSNorm, _copy, _param
from portside.model.moe import MoEExperts
from portside.model.pipeline import PipelineStage

__all__ = ["GptOssForCausalLM", "GptOssExperts", "GptOssMoE", "GptOssRMSNorm"]

SWIGLU_ALPHA = 1.702  # transformers' default where a config has no `swiglu_alpha`
SWIGLU_LIMIT = 7.0


class GptOssRMSNorm(RMSNorm):
    """RMSNorm with an fp32 weight, scaled in fp32, then cast (transformers keeps gpt-oss's norms
    in fp32 whatever the model's dtype)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(dim, eps, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class GptOssExperts(MoEExperts):
    """`MoEExperts` with biases (w13_bias [E, 2I/tp]: gate then up, as w13's rows; w2_bias [E,
    hidden], zero on ranks but 0) and loaders for gpt-oss's interleaved, transposed tensors."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp_rank: int, tp_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, tp_rank, tp_size, dtype)
        self.w13.weight_loader = self.gate_up_loader  # type: ignore[attr-defined]
        self.w2.weight_loader = self.down_loader  # type: ignore[attr-defined]
        self.w13.shard_ids = self.w2.shard_ids = None  # type: ignore[attr-defined]  # each loaded whole
        self.w13_bias = _param(num_experts, 2 * self.local, dtype=dtype, loader=self.gate_up_bias_loader)
        self.w2_bias = _param(num_experts, hidden_size, dtype=dtype, loader=self.down_bias_loader)

    def _split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., 2I] interleaved -> this rank's (gate, up) [..., I/tp] each."""
        return self._rows(t[..., ::2], t.dim() - 1), self._rows(t[..., 1::2], t.dim() - 1)

    def gate_up_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """experts.gate_up_proj [E, hidden, 2I] -> w13 [E, 2I/tp, hidden]."""
        if loaded.dim() != 3 or loaded.shape[1] != self.hidden_size:
            raise ValueError(f"experts.gate_up_proj {tuple(loaded.shape)}: expected [E, hidden, 2I]")
        gate, up = self._split(loaded)  # [E, hidden, I/tp]
        n = self.local
        _copy(param.data[:, :n], gate.transpose(1, 2), "experts.gate_up_proj (gate)")
        _copy(param.data[:, n:], up.transpose(1, 2), "experts.gate_up_proj (up)")

    def gate_up_bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """experts.gate_up_proj_bias [E, 2I] -> w13_bias [E, 2I/tp]."""
        gate, up = self._split(loaded)
        _copy(param.data, torch.cat([gate, up], dim=-1), "experts.gate_up_proj_bias")

    def down_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """experts.down_proj [E, I, hidden] -> w2 [E, hidden, I/tp]."""
        if loaded.dim() != 3 or loaded.shape[2] != self.hidden_size:
            raise ValueError(f"experts.down_proj {tuple(loaded.shape)}: expected [E, I, hidden]")
        _copy(param.data, self._rows(loaded, 1).transpose(1, 2), "experts.down_proj")

    def down_bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """experts.down_proj_bias [E, hidden]: rank 0's; zeros elsewhere (added once to the sum)."""
        _copy(param.data, loaded if self.tp_rank == 0 else torch.zeros_like(loaded), "experts.down_proj_bias")


class GptOssMoE(nn.Module):
    """x [T, hidden] -> the top-k experts' outputs weighted by the softmax of their router logits
    (all-reduced under tensor parallelism)."""

    def __init__(self, args: ModelArgs, ops: ModelOps, comm: Communicator, tp_rank: int, tp_size: int,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        hf = args.hf_config
        self.top_k, self.ops, self.comm, self.tp_size = args.num_experts_per_tok, ops, comm, tp_size
        self.alpha = float(getattr(hf, "swiglu_alpha", None) or SWIGLU_ALPHA)
        self.limit = float(getattr(hf, "swiglu_limit", None) or SWIGLU_LIMIT)
        self.router = ReplicatedLinear(args.hidden_size, args.num_experts, True, dtype)
        self.router.quantizable = False  # routers stay in full precision
        self.experts = GptOssExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size, tp_rank, tp_size,
                                     dtype)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        logits = self.router(x)  # [T, E]
        ex = self.experts
        # top-k of the logits, softmaxed among themselves == softmax over all, top-k, renormalised
        options: dict[str, Any] = dict(w13_bias=ex.w13_bias, w2_bias=ex.w2_bias, swiglu_alpha=self.alpha,
                                       swiglu_limit=self.limit)  # fmt: skip
        if ex.quant13 is not None:
            weights, ids = self.ops.select_experts(logits, self.top_k, True)
            y = self.ops.quantized_moe_experts(x, ex.quant13, ex.quant2, weights, ids, "swiglu_oai",  # type: ignore[arg-type]
                                               **options)  # fmt: skip
        else:
            y = self.ops.fused_moe(x, logits, ex.w13, ex.w2, self.top_k, True, activation="swiglu_oai", **options)
        return self.comm.all_reduce(y) if self.tp_size > 1 else y


class GptOssForCausalLM(DecoderForCausalLM):
    norm: ClassVar[type[RMSNorm]] = GptOssRMSNorm
    renames = ((".mlp.experts.gate_up_proj_bias", ".mlp.experts.w13_bias"),
               (".mlp.experts.down_proj_bias", ".mlp.experts.w2_bias"))  # fmt: skip

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None,
                 stage: PipelineStage | None = None) -> None:  # fmt: skip
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops, stage)
        for layer in self.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None:  # another pipeline stage's layer
                continue
            first = attn.num_heads * tp_rank
            # fp32 logits, one per query head of this rank (`ATTENTION_FEATURES` "sinks")
            loader = _head_slice_loader(first, attn.num_heads, args.num_heads)
            attn.sinks = _param(attn.num_heads, dtype=torch.float32, loader=loader)
            attn.features["sinks"] = attn.sinks

    @classmethod
    def make_mlp(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> nn.Module:
        return GptOssMoE(args, tp.ops, tp.comm, tp.rank, tp.size, dtype)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, object, torch.Tensor]]:
        for old, new in self.renames:
            name = name.replace(old, new)
        if name.endswith(".mlp.experts.gate_up_proj"):  # not `MoEExperts`' fused layout: its own loader
            yield name.removesuffix("gate_up_proj") + "w13", None, tensor
        elif name.endswith(".mlp.experts.down_proj"):
            yield name.removesuffix("down_proj") + "w2", None, tensor
        else:
            yield from super().checkpoint_tensors(name, tensor)


def _head_slice_loader(first: int, count: int, total: int):  # noqa: ANN202
    """self_attn.sinks [total heads] -> this rank's `count` from head `first`, as fp32."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if tuple(loaded.shape) != (total,):
            raise ValueError(f"self_attn.sinks {tuple(loaded.shape)}: expected one value per query head ({total})")
        _copy(param.data, loaded.narrow(0, first, count), "self_attn.sinks")

    return load
