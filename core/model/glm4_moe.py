"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): the decoder with q/k/v biases (``attention_bias``; the
output projection never has one), optional per-head q/k RMSNorm before rotary (``use_qk_norm``),
rotary on the first ``partial_rotary_factor`` of each head's dims (halves paired, as
transformers' rotate_half), a dense gated MLP in the first ``first_k_dense_replace`` layers and
the DeepSeek-V3-style mixture of experts elsewhere (`portside.model.deepseek_moe.DeepseekMoE`:
sigmoid scores, choice by score + ``e_score_correction_bias`` within the best ``topk_group`` of
``n_group`` groups, ``norm_topk_prob``, ``routed_scaling_factor``, shared experts).

Multi-token prediction (``num_nextn_predict_layers``): the checkpoint's extra layers
``model.layers.{num_hidden_layers + i}.*`` (eh_proj, enorm, hnorm, shared_head and a decoder
layer) are read and kept, unchanged, in `mtp_weights` (for a speculative-decoding proposer), not
used by the forward pass (as in transformers, which drops them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from portside.contract import Communicator, ModelOps
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderForCausalLM, DecoderModel, GatedMLP
from portside.model.deepseek_moe import DeepseekMoE
from portside.model.mtp import without_mtp
from portside.model.pipeline import PipelineStage

__all__ = ["Glm4MoeForCausalLM"]


def _glm4_model(model_cls: type[DecoderForCausalLM], args: ModelArgs, tp: TP, dtype: torch.dtype,
                stage: PipelineStage) -> nn.Module:  # fmt: skip
    """`DecoderModel`, its attention with per-head q/k norms where the config has ``use_qk_norm``."""
    if getattr(args.hf_config, "use_qk_norm", False):
        model_cls = _Glm4MoeWithQKNorm
    return DecoderModel(model_cls, args, tp, dtype, stage)


class Glm4MoeForCausalLM(DecoderForCausalLM):
    model_module: ClassVar[Any] = staticmethod(_glm4_model)

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None,
                 stage: PipelineStage | None = None) -> None:  # fmt: skip
        args = dataclasses.replace(args, o_bias=False)  # attention_bias: q, k and v only
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops, stage)
        hf = args.hf_config
        self.num_mtp_layers = int(getattr(hf, "num_nextn_predict_layers", None) or 0)
        self.mtp_weights: dict[str, torch.Tensor] = {}
        """The multi-token-prediction layers' checkpoint tensors, by name (last pipeline stage)."""

    @property
    def layer_class(self) -> type[DecoderForCausalLM]:
        """The class this model's decoder layers (and so its MTP layer's) are built from: with
        ``use_qk_norm``, the one whose attention has per-head q/k norms."""
        return _Glm4MoeWithQKNorm if getattr(self.config.hf_config, "use_qk_norm", False) else type(self)

    @classmethod
    def make_mlp(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> nn.Module:
        """Experts from layer ``first_k_dense_replace`` on, else a dense gated MLP."""
        hf = args.hf_config
        if int(getattr(hf, "n_routed_experts", None) or 0) and i >= int(getattr(hf, "first_k_dense_replace", 0) or 0):
            return DeepseekMoE(hf, tp.ops, tp.comm, tp.rank, tp.size, dtype)
        return GatedMLP(args.hidden_size, args.intermediate_size, False, args.hidden_act, tp, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        """The decoder's, with the multi-token-prediction layers' tensors set aside (`mtp_weights`)."""
        keep = self.mtp_weights if self.stage.is_last else None
        return super().load_weights(without_mtp(weights, self.config.num_layers, self.num_mtp_layers, keep,
                                                type(self).__name__))  # fmt: skip


class _Glm4MoeWithQKNorm(Glm4MoeForCausalLM):
    """What `DecoderModel` builds the layers of a ``use_qk_norm`` checkpoint from."""

    qk_norm = "head"
