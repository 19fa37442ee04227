"""DeepSeek-V2 and DeepSeek-V3 (and checkpoints of their shape: DeepSeek-R1, Kimi K2): the decoder
with multi-head latent attention (`portside.model.mla`) in every layer, a dense gated MLP in the
first ``first_k_dense_replace`` layers and a mixture of experts with shared experts elsewhere
(`portside.model.deepseek_moe.DeepseekMoE`: V2's softmax greedy or group-limited routing, V3's
sigmoid scores with a correction bias and grouped top-k, scaled by ``routed_scaling_factor``).

The KV cache is latent (`LatentKVCacheSpec`): one row of kv_lora_rank + qk_rope_head_dim values per
token and layer, attended through the platform's `AttentionBackend.latent_attention` (core's
reference where the backend has no kernel of its own).

Multi-token prediction (V3: ``num_nextn_predict_layers``): the checkpoint's extra layers
``model.layers.{num_hidden_layers + i}.*`` are read and kept, unchanged, in `mtp_weights` (for a
speculative-decoding proposer), not used by the forward pass (as in transformers, which drops them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from portside.contract import Communicator, ForwardContext, LatentKVCacheSpec, ModelOps
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderForCausalLM, GatedMLP
from portside.model.mla import MLAttention
from portside.model.mtp import without_mtp
from portside.model.pipeline import PipelineStage

__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]



class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V2: rotary on interleaved pairs (transformers' complex multiply)."""

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None,
                 stage: PipelineStage | None = None) -> None:  # fmt: skip
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops, stage)
        self.num_mtp_layers = int(getattr(args.hf_config, "num_nextn_predict_layers", None) or 0)
        self.mtp_weights: dict[str, torch.Tensor] = {}
        """The multi-token-prediction layers' checkpoint tensors, by name (last pipeline stage)."""

    @classmethod
    def rope_interleaved(cls, args: ModelArgs) -> bool:
        return True

    @classmethod
    def make_attention(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> nn.Module:
        return MLAttention(args, i, tp, dtype, interleaved=cls.rope_interleaved(args))

    @classmethod
    def make_mlp(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> nn.Module:
        """Experts from layer ``first_k_dense_replace`` on (where the config has routed experts), else
        a dense gated MLP of ``intermediate_size``."""
        hf = args.hf_config
        if int(getattr(hf, "n_routed_experts", None) or 0) and i >= int(getattr(hf, "first_k_dense_replace", 0) or 0):
            from portside.model.deepseek_moe import DeepseekMoE

            return DeepseekMoE(hf, tp.ops, tp.comm, tp.rank, tp.size, dtype)
        return GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, args.hidden_act, tp, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h, rope = self.embed(input_ids, positions, ctx.inputs_embeds)
        for i in range(self.num_layers):
            query, latent = self.pre_attention(i, h, rope)
            attn: MLAttention = self._layer(i).self_attn  # type: ignore[assignment]
            o = ctx.backend.latent_attention(query, latent, ctx.kv_caches[i], ctx.metadata, attn.scale, attn.latent_dim)
            h = self.post_attention(i, h, o)
        return self.final_norm(h)

    def kv_cache_spec(self) -> LatentKVCacheSpec:
        hf = self.config.hf_config
        latent, rope = int(hf.kv_lora_rank), int(hf.qk_rope_head_dim)
        return LatentKVCacheSpec(num_layers=self.num_layers, num_kv_heads=1, head_size=latent + rope, dtype=self.dtype,
                                 latent_dim=latent)  # fmt: skip

    def use_kv_scales(self, enabled: bool) -> None:
        """No per-layer KV scales: an 8-bit latent cache is refused (`check_latent_kv_cache_dtype`)."""

    # ---- loading ----------------------------------------------------------------------------

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, object, torch.Tensor]]:
        if ".self_attn." in name:  # MLA's projections keep their names (no q/k/v fusing)
            yield name, None, tensor
        else:
            yield from super().checkpoint_tensors(name, tensor)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        """The decoder's, with the multi-token-prediction layers' tensors set aside (`mtp_weights`)."""
        keep = self.mtp_weights if self.stage.is_last else None
        return super().load_weights(without_mtp(weights, self.config.num_layers, self.num_mtp_layers, keep,
                                                type(self).__name__))  # fmt: skip


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: rotary on interleaved pairs when ``rope_interleave`` (the default), else on halves."""

    @classmethod
    def rope_interleaved(cls, args: ModelArgs) -> bool:
        value: Any = getattr(args.hf_config, "rope_interleave", True)
        return True if value is None else bool(value)
