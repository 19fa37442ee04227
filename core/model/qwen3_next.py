"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrids of Gated DeltaNet linear-attention layers
(`portside.model.gated_deltanet`) and gated full attention, as the config's ``layer_types``
lists them ("linear_attention" / "full_attention"; by default every fourth layer attends).

Full attention: q/k RMSNorm per head, rotary on the first ``partial_rotary_factor`` of each head
(neox halves), and an output gate: ``q_proj`` gives each head's query and then its gate, the
attention output is multiplied by sigmoid(gate) before ``o_proj``. Every RMSNorm but the linear
layers' gated one is zero-centred (scales by 1 + weight, in fp32). MLP: dense, or routed experts
with a sigmoid-gated shared expert where the config has experts (Qwen3-Next: `mlp_only_layers`
and `decoder_sparse_step` as Qwen2-MoE; Qwen3.5-MoE: every layer, top-k weights renormalised).

Qwen3.5's text model rotates with 3-D positions ("mrope") whose three components are equal for
text, i.e. plain rotary: these causal LMs take 1-D positions.

Attention layer a (counted among this stage's attention layers) uses KV cache a; linear layer r
(among its linear layers) the state tensors ``ctx.state_caches[r]`` (`state_spec`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from portside.contract import Communicator, ForwardContext, KVCacheSpec, ModelOps, StateSpec
from portside.model.args import ModelArgs
from portside.model.decoder import TP, DecoderAttention, DecoderForCausalLM, GatedMLP, MissingLayer, PipelineStage
from portside.model.gated_deltanet import GatedDeltaNet
from portside.model.layers import (
    GemmaRMSNorm,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from portside.model.moe import SparseMoEBlock
from portside.model.rotary import RotaryEmbedding, apply_rotary

__all__ = ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]

_LAYER_TYPES = ("linear_attention", "full_attention")


class GatedAttention(nn.Module):
    """Full attention with an output gate. ``q_proj``'s rows are, per head, its query then its
    gate (D each): loaded into the fused `QKVParallelLinear` as 2H "heads" of D, so that a rank
    keeps whole (query, gate) pairs."""

    k_scale: torch.Tensor  # an fp8 KV cache's scales, as `DecoderAttention`'s
    v_scale: torch.Tensor
    load_kv_scale = DecoderAttention.load_kv_scale

    def __init__(self, args: ModelArgs, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        D, H = args.head_dim, args.num_heads
        if H % tp.size:
            raise ValueError(f"attention heads ({H}) are not divisible by the tensor-parallel size ({tp.size})")
        self.head_dim = D
        self.qkv_proj = QKVParallelLinear(args.hidden_size, D, 2 * H, args.num_kv_heads, args.qkv_bias,
                                          tp.rank, tp.size, dtype)
        self.num_heads = H // tp.size  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.o_proj = RowParallelLinear(H * D, args.hidden_size, args.o_bias, tp.rank, tp.size, dtype, tp.comm)
        self.q_norm = GemmaRMSNorm(D, args.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(D, args.rms_norm_eps, dtype)
        self.scale = D ** -0.5
        self.register_buffer("k_scale", torch.ones(self.num_kv_heads), persistent=False)
        self.register_buffer("v_scale", torch.ones(self.num_kv_heads), persistent=False)
        self.kv_scaled = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext,
                a: int) -> torch.Tensor:  # x [T, hidden] -> [T, hidden]; `a`: its KV cache
        T, D, H, KVH = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qg, k, v = self.qkv_proj(x).split([2 * H * D, KVH * D, KVH * D], dim=-1)
        qg = qg.view(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        q, k = self.q_norm(q), self.k_norm(k.view(T, KVH, D))
        q, k, v = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.reshape(T, KVH, D)
        if self.kv_scaled:  # the cache holds k / k_scale and v / v_scale (`DecoderAttention.qkv`)
            ks = self.k_scale.to(q.dtype)[:, None]
            q, k, v = q * ks.repeat_interleave(H // KVH, dim=0), k / ks, v / self.v_scale.to(v.dtype)[:, None]
        o = ctx.attention(a, q, k, v, self.scale)  # [T, H, D]
        if self.kv_scaled:
            o = o * self.v_scale.to(o.dtype).repeat_interleave(H // KVH)[:, None]
        return self.o_proj((o * torch.sigmoid(gate)).reshape(T, H * D))


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm token mixer (`linear_attn` or `self_attn`) and MLP, each with a residual."""

    def __init__(self, model_cls: type[Qwen3NextForCausalLM], args: ModelArgs, i: int, tp: TP,
                 dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.is_attention = args.layer_types[i] == "full_attention"
        if self.is_attention:
            self.self_attn = GatedAttention(args, tp, dtype)
        else:
            self.linear_attn = GatedDeltaNet(args.hf_config, hidden, eps, tp, dtype, model_cls.gdn_layout,
                                            args.ssm_state_dtype(dtype))
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = model_cls.make_mlp(args, i, tp, dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext,
                ordinal: int) -> torch.Tensor:  # `ordinal`: its KV cache, or its state
        x = self.input_layernorm(h)
        if self.is_attention:
            x = self.self_attn(x, cos, sin, ctx, ordinal)
        else:
            x = self.linear_attn(x, ctx.state_caches[ordinal], ctx.recurrent)
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(nn.Module):
    """The parameters under ``model.*`` (`DecoderModel`'s names and pieces)."""

    def __init__(self, model_cls: type[Qwen3NextForCausalLM], args: ModelArgs, tp: TP, dtype: torch.dtype,
                 stage: PipelineStage) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            args.vocab_size, args.hidden_size, tp.rank, tp.size, dtype, tp.comm) if stage.is_first else None
        self.rotary = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings,
                                      args.max_model_len, rotary_dim=int(args.head_dim * args.partial_rotary_factor))
        self.rotary_local = None
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(model_cls, args, i, tp, dtype) if stage.start <= i < stage.end
                                    else MissingLayer() for i in range(args.num_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype) if stage.is_last else None


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """Serves Qwen3NextForCausalLM; `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM` differ in
    the linear layers' checkpoint names and the router. The decoder's loading, embedding, logits
    and pipeline-stage bookkeeping are `DecoderForCausalLM`'s; its layers are these."""

    has_recurrent_state: ClassVar[bool] = True
    norm = GemmaRMSNorm
    gdn_layout: ClassVar[str] = "qkvz"  # `GatedDeltaNet`
    always_renormalize: ClassVar[bool] = False  # the router renormalises its top-k whatever the config says
    skipped_prefixes: ClassVar[tuple[str, ...]] = ()  # checkpoint tensors not read
    model_module = Qwen3NextModel

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
        if args.hf_config is None:
            raise ValueError(f"{type(self).__name__} needs the whole transformers config (args.hf_config)")
        types = args.layer_types
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if len(types) != args.num_layers or unknown:
            raise ValueError(f"{args.architecture}: layer_types must list {args.num_layers} layers of "
                             f"{' / '.join(_LAYER_TYPES)}; got {list(types) if not unknown else unknown}")
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops, stage)
        # each layer of this stage: its ordinal among the stage's attention or linear layers
        self.ordinals: list[int] = []
        counts = [0, 0]
        for i in range(self.num_layers):
            kind = int(self._layer(i).is_attention)
            self.ordinals.append(counts[kind])
            counts[kind] += 1
        self.num_linear_layers, self.num_attention_layers = counts
        # the multi-token-prediction layer's tensors (``mtp.*``), for method "mtp" (`spec_decode.qwen3_next_mtp`)
        self.mtp_weights: dict[str, torch.Tensor] = {}

    @classmethod
    def make_mlp(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> nn.Module:
        if not args.is_moe_layer(i):
            return GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, args.hidden_act, tp, dtype)
        shared = None
        if args.shared_expert_intermediate_size:
            shared = GatedMLP(args.hidden_size, args.shared_expert_intermediate_size, False, args.hidden_act, tp, dtype)
        return SparseMoEBlock(
            args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
            args.norm_topk_prob or cls.always_renormalize, tp.ops, tp.comm, tp.rank, tp.size, dtype, shared,
        )

    def _layer(self, i: int) -> Qwen3NextDecoderLayer:  # type: ignore[override]
        return cast(Qwen3NextDecoderLayer, self.model.layers[self.stage.start + i])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h, rope = self.embed(input_ids, positions, ctx.inputs_embeds)
        cos, sin = rope[:2]
        for i in range(self.num_layers):
            h = self._layer(i)(h, cos, sin, ctx, self.ordinals[i])
        return self.final_norm(h)

    def kv_cache_spec(self) -> KVCacheSpec:
        """The attention layers' cache (0 layers: a stage of linear layers only)."""
        kv_heads = max(1, self.config.num_kv_heads // self.tp.size)  # as `QKVParallelLinear` splits them
        return KVCacheSpec(num_layers=self.num_attention_layers, num_kv_heads=kv_heads, head_size=self.config.head_dim,
                           dtype=self.dtype)

    def state_spec(self) -> StateSpec:
        """The linear layers' state per sequence (this rank's heads): conv inputs, delta-rule state."""
        layer = next((self._layer(i).linear_attn for i in range(self.num_layers) if not self._layer(i).is_attention),
                     None)
        shapes, dtypes = layer.state_shapes() if layer is not None else ((), ())
        return StateSpec(num_layers=self.num_linear_layers, shapes=shapes, dtypes=dtypes, kind="gated_deltanet")

    def use_kv_scales(self, enabled: bool) -> None:
        for i in range(self.num_layers):
            layer = self._layer(i)
            if layer.is_attention:
                attn = layer.self_attn
                attn.kv_scaled = enabled and bool(torch.any((attn.k_scale != 1) | (attn.v_scale != 1)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        """The decoder's, with the MTP layer's tensors set aside (`mtp_weights`, last stage only)."""
        def kept() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name.startswith("mtp."):
                    if self.stage.is_last:
                        self.mtp_weights[name] = t
                elif not (self.skipped_prefixes and name.startswith(self.skipped_prefixes)):
                    yield name, t
        return super().load_weights(kept())

    # the model cut at its attention calls (`PiecewiseModel`) does not describe a hybrid: the
    # runner runs models with recurrent state eagerly
    def pre_attention(self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError(f"{type(self).__name__} has recurrent layers: it runs whole, not cut at attention")

    def post_attention(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has recurrent layers: it runs whole, not cut at attention")

    def attention_scale(self, i: int) -> float:
        raise NotImplementedError(f"{type(self).__name__} has recurrent layers: it runs whole, not cut at attention")

    def attention_features(self, i: int) -> dict[str, Any]:
        """None of `ATTENTION_FEATURES` (full causal attention, no soft-cap; the runner's feature check)."""
        return {}


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's text model (dense): the linear layers' projections kept apart in the checkpoint."""

    gdn_layout = "split"
    skipped_prefixes = ("model.visual.",)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE's text model: experts and a shared expert in every layer, top-k renormalised."""

    always_renormalize = True
