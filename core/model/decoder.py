"""The decoder-only transformer every architecture is built from, as plain modules, tensor-parallel
ready. An architecture file subclasses `DecoderForCausalLM` and sets what differs as class
attributes (its norm, q/k norms, sandwich norms, embedding scale, checkpoint names); what
differs between checkpoints of one architecture is data in `ModelArgs` (biases, windows,
soft-caps, experts, rope). The checkpoint names are Hugging Face's: `load_weights` maps them
(q/k/v -> fused qkv_proj, gate/up -> fused gate_up_proj, experts -> stacked tensors).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from portside.contract import Communicator, ForwardContext, KVCacheSpec, ModelOps, SingleRankCommunicator
from portside.model.args import ModelArgs
from portside.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from portside.model.moe import SparseMoEBlock
from portside.model.pipeline import PipelineStage, pipeline_stages
from portside.model.rotary import MRotaryEmbedding, RotaryEmbedding, apply_rotary

logger = logging.getLogger(__name__)

__all__ = ["TP", "DecoderForCausalLM", "GatedMLP", "DecoderAttention", "DecoderLayer", "PipelineStage", "activation",
           "pipeline_stages"]

# checkpoint name fragment -> (fused module fragment, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)$")  # .weight, or a quantized format's
_FUSED_EXPERTS = {".experts.gate_up_proj": ".experts.w13", ".experts.down_proj": ".experts.w2"}  # transformers 5
_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# KV-cache scales as checkpoints name them (vLLM's maybe_remap_kv_scale_name): self_attn.k_scale /
# v_scale (compressed-tensors), the older self_attn.kv_scale (both), self_attn.k_proj.k_scale /
# v_proj.v_scale (ModelOpt); q_scale is skipped.
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(kv|k|v|q)_scale$")


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"activation {name!r} is not supported; portside supports silu, gelu and gelu_pytorch_tanh")


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds (keeps the others' global names and indices)."""


class TP:
    """Where this module sits in the tensor-parallel group, and the layer kernels it calls."""

    def __init__(self, comm: Communicator, rank: int, size: int, ops: ModelOps) -> None:
        self.comm, self.rank, self.size, self.ops = comm, rank, size, ops


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused in one column-parallel matmul."""

    def __init__(self, hidden: int, inter: int, bias: bool, act: str, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, tp.rank, tp.size, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp.rank, tp.size, dtype, tp.comm)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, inter / tp] each
        return self.down_proj(self.act(gate) * up)


class DecoderAttention(nn.Module):
    """q/k/v projections (fused), optional q/k RMSNorm, clipping and rotary; the output projection.

    `qk_norm`: "head" normalises each head over head_dim (Qwen3, Gemma 3), "full" each token's
    whole q and k projection (OLMoE: under tensor parallelism the ranks' slices are gathered).
    """

    k_scale: torch.Tensor  # registered buffers [KVH] fp32: an fp8 KV cache's scales (see __init__)
    v_scale: torch.Tensor

    def __init__(
        self, args: ModelArgs, layer_idx: int, tp: TP, dtype: torch.dtype, qk_norm: str | None, norm: type[RMSNorm]
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = D = args.head_dim
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size, D, args.num_heads, args.num_kv_heads, args.qkv_bias, tp.rank, tp.size, dtype
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.o_proj = RowParallelLinear(args.num_heads * D, args.hidden_size, args.o_bias, tp.rank, tp.size, dtype, tp.comm)
        self.scale = (args.query_pre_attn_scalar or D) ** -0.5
        self.clip = args.clip_qkv
        self.qk_norm, self.tp = qk_norm, tp
        if qk_norm == "head":
            self.q_norm, self.k_norm = norm(D, args.rms_norm_eps, dtype), norm(D, args.rms_norm_eps, dtype)
        elif qk_norm == "full":
            if args.num_kv_heads < tp.size:
                raise ValueError("a full-width k norm needs at least as many KV heads as tensor-parallel ranks")
            self.q_norm = norm(args.num_heads * D, args.rms_norm_eps, dtype)
            self.k_norm = norm(args.num_kv_heads * D, args.rms_norm_eps, dtype)
        self.features: dict[str, Any] = {
            "sliding_window": args.layer_window(layer_idx),
            "logit_softcap": args.attn_logit_softcap,
        }
        # An fp8 KV cache's per-layer scales (a checkpoint's k_scale / v_scale: one, or one per
        # KV head; this rank's heads here), as vLLM reads them: the cache holds k / k_scale and
        # v / v_scale. With `kv_scaled` (`DecoderForCausalLM.use_kv_scales`) `qkv` divides k and v,
        # multiplies q by its KV head's k_scale (q . k unchanged) and `out` the output by v_scale,
        # so attention backends store and read scale-free fp8.
        self.register_buffer("k_scale", torch.ones(self.num_kv_heads), persistent=False)
        self.register_buffer("v_scale", torch.ones(self.num_kv_heads), persistent=False)
        self.kv_scaled = False

    def _full_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:  # [T, n / tp] -> [T, n / tp]
        if self.tp.size == 1:
            return norm(x)
        whole = self.tp.comm.all_gather(x.contiguous(), dim=-1)
        return norm(whole).narrow(-1, self.tp.rank * x.shape[-1], x.shape[-1])

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D], rotary applied."""
        T, D = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * D, self.num_kv_heads * D
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self._full_norm(q, self.q_norm), self._full_norm(k, self.k_norm)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = q.view(T, self.num_heads, D), k.view(T, self.num_kv_heads, D), v.reshape(T, self.num_kv_heads, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_scaled:
            group = self.num_heads // self.num_kv_heads
            ks, vs = self.k_scale.to(q.dtype)[:, None], self.v_scale.to(v.dtype)[:, None]  # [KVH, 1]
            q, k, v = q * ks.repeat_interleave(group, dim=0), k / ks, v / vs
        return q, k, v

    def load_kv_scale(self, which: str, tensor: torch.Tensor) -> None:
        """A checkpoint's k_scale / v_scale ("k", "v"; "kv": both), one value or one per KV head."""
        values = tensor.detach().float().reshape(-1)
        total = self.qkv_proj.total_kv_heads
        if values.numel() not in (1, total):
            raise ValueError(f"a KV-cache scale of {values.numel()} values; expected 1 or one per KV head ({total})")
        if values.numel() > 1:
            start = self.qkv_proj.kv_head_start
            values = values[start : start + self.num_kv_heads]
        for name in ("k", "v") if which == "kv" else (which,):
            getattr(self, f"{name}_scale").copy_(values.expand(self.num_kv_heads))

    def out(self, o: torch.Tensor) -> torch.Tensor:  # o [T, H, D] -> [T, hidden]
        if self.kv_scaled:
            o = o * self.v_scale.to(o.dtype).repeat_interleave(self.num_heads // self.num_kv_heads)[:, None]
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals; with `sandwich` (Gemma 2/3) each
    block's output is normalised too (post_attention_layernorm, post_feedforward_layernorm)
    and the MLP's input norm is pre_feedforward_layernorm."""

    def __init__(self, model_cls: type[DecoderForCausalLM], args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        norm, eps, hidden = model_cls.norm, args.rms_norm_eps, args.hidden_size
        self.sandwich = model_cls.sandwich_norms
        self.input_layernorm = norm(hidden, eps, dtype)
        # a latent-attention layer (portside.model.mla) offers the same surface: qkv, out, scale, features
        self.self_attn = cast(DecoderAttention, model_cls.make_attention(args, i, tp, dtype))
        self.post_attention_layernorm = norm(hidden, eps, dtype)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(hidden, eps, dtype)
            self.post_feedforward_layernorm = norm(hidden, eps, dtype)
        self.mlp = model_cls.make_mlp(args, i, tp, dtype)

    def pre_attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.self_attn.qkv(self.input_layernorm(h), cos, sin)

    def post_attention(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:  # h [T, hidden], o [T, H, D]
        a = self.self_attn.out(o)
        if not self.sandwich:
            h = h + a
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class DecoderModel(nn.Module):
    """The decoder's parameters (HF names `model.*`). The forward pass is on DecoderForCausalLM,
    which also exposes it piece by piece (`PiecewiseModel`)."""

    def __init__(self, model_cls: type[DecoderForCausalLM], args: ModelArgs, tp: TP, dtype: torch.dtype,
                 stage: PipelineStage) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp.rank, tp.size, dtype, tp.comm) \
            if stage.is_first else None
        rotary_dim = int(args.head_dim * args.partial_rotary_factor)
        self.rotary = RotaryEmbedding(
            args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings, args.max_model_len,
            rotary_dim=rotary_dim,
        ) if not args.mrope_section else MRotaryEmbedding(  # Qwen2.5-VL: positions [3, T]
            args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings, args.max_model_len,
            rotary_dim=rotary_dim, mrope_section=args.mrope_section,
        )
        # Gemma 3: the sliding layers rotate with a base of their own, unscaled
        self.rotary_local = (
            RotaryEmbedding(args.head_dim, args.rope_local_theta, None, args.max_position_embeddings,
                            args.max_model_len, rotary_dim=rotary_dim)
            if args.rope_local_theta is not None
            else None
        )
        self.layers = nn.ModuleList(DecoderLayer(model_cls, args, i, tp, dtype) if stage.start <= i < stage.end
                                    else MissingLayer() for i in range(args.num_layers))
        self.norm = model_cls.norm(args.hidden_size, args.rms_norm_eps, dtype) if stage.is_last else None


class DecoderForCausalLM(nn.Module):
    """Decoder + LM head.

    `forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]` (after the final norm);
    `compute_logits(hidden [N, hidden]) -> fp32 logits [N, vocab]` on every rank.
    """

    norm: ClassVar[type[RMSNorm]] = RMSNorm
    qk_norm: ClassVar[str | None] = None  # None, "head" or "full" (`DecoderAttention`)
    sandwich_norms: ClassVar[bool] = False  # `DecoderLayer`
    scale_embeddings: ClassVar[bool] = False  # Gemma: embeddings times sqrt(hidden), in the model's dtype
    # checkpoint name fragment -> portside's, applied before the q/k/v and gate/up fusing
    renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # the parameters under `model.*`, built as (model class, args, tp, dtype, stage): a family with
    # layers of its own (hybrid models) passes its module, with `DecoderModel`'s attribute names
    model_module: ClassVar[Callable[..., nn.Module]] = DecoderModel

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
        super().__init__()
        self.config = args
        self.dtype = dtype
        self.stage = stage or PipelineStage(0, 1, 0, args.num_layers)
        self.tp = tp = TP(comm or SingleRankCommunicator(), tp_rank, tp_size, ops or ModelOps())
        self.model = cast(DecoderModel, self.model_module(type(self), args, tp, dtype, self.stage))
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp.rank, tp.size, dtype, tp.comm) \
            if self.stage.is_last else None
        if args.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embed_scale = math.sqrt(args.hidden_size) if self.scale_embeddings else None

    @classmethod
    def make_attention(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> nn.Module:
        """Layer i's attention: `DecoderAttention` (latent attention: `portside.model.mla`)."""
        return DecoderAttention(args, i, tp, dtype, cls.qk_norm, cls.norm)

    @classmethod
    def make_mlp(cls, args: ModelArgs, i: int, tp: TP, dtype: torch.dtype) -> nn.Module:
        """Layer i's MLP: the experts where the config has them there, else a dense gated MLP."""
        if not args.is_moe_layer(i):
            return GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, args.hidden_act, tp, dtype)
        shared = None
        if args.shared_expert_intermediate_size:
            shared = GatedMLP(args.hidden_size, args.shared_expert_intermediate_size, False, args.hidden_act, tp, dtype)
        return SparseMoEBlock(
            args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
            args.norm_topk_prob, tp.ops, tp.comm, tp.rank, tp.size, dtype, shared,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h, rope = self.embed(input_ids, positions, ctx.inputs_embeds)
        for i in range(self.num_layers):
            q, k, v = self.pre_attention(i, h, rope)
            o = ctx.attention(i, q, k, v, self.attention_scale(i), **self.attention_features(i))  # [T, H, D]
            h = self.post_attention(i, h, o)
        return self.final_norm(h)

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                         layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, plus the residual stream entering each layer of `layers` (an EAGLE-3 head's
        auxiliary hidden states), concatenated in that order: [T, len(layers) * hidden]."""
        h, rope = self.embed(input_ids, positions, ctx.inputs_embeds)
        aux: dict[int, torch.Tensor] = {}
        for i in range(self.num_layers):
            if i in layers:
                aux[i] = h
            q, k, v = self.pre_attention(i, h, rope)
            o = ctx.attention(i, q, k, v, self.attention_scale(i), **self.attention_features(i))
            h = self.post_attention(i, h, o)
        return self.final_norm(h), torch.cat([aux[i] for i in layers], dim=-1)

    # ---- portside.contract.PiecewiseModel: the model cut at its attention calls ----------

    @property
    def num_layers(self) -> int:
        """Layers this model (this pipeline stage) runs; `i` below counts from its first."""
        return self.stage.end - self.stage.start

    def _layer(self, i: int) -> DecoderLayer:
        return cast(DecoderLayer, self.model.layers[self.stage.start + i])  # nn.ModuleList items are typed as Module

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """-> (h [T, hidden], rope: cos, sin [T, rotary_dim/2] shared by every layer, then the
        sliding layers' own cos, sin where they have their own base). h is `inputs_embeds` where
        given (`ForwardContext.inputs_embeds`): on a later pipeline stage the previous stage's
        output, on a vision-language model's first stage the tokens' embeddings with images merged in."""
        if inputs_embeds is not None:  # a later pipeline stage, or a prompt's rows merged with images
            h = inputs_embeds
        elif self.model.embed_tokens is None:  # a later pipeline stage: zeros in a warm-up on dummy inputs
            h = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.dtype, device=input_ids.device)
        else:
            h = self.embed_input_ids(input_ids)
        rope = self.model.rotary(positions, h.dtype)
        if self.model.rotary_local is not None:
            rope = rope + self.model.rotary_local(positions, h.dtype)
        return h, rope

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] (scaled where the architecture scales them); first stage only."""
        assert self.model.embed_tokens is not None
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def pre_attention(self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        layer = self._layer(i)
        local = len(rope) == 4 and layer.self_attn.features["sliding_window"] is not None
        cos, sin = rope[2:] if local else rope[:2]
        return layer.pre_attention(h, cos, sin)

    def post_attention(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return self._layer(i).post_attention(h, o)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.model.norm is None else self.model.norm(h)  # a non-last stage passes its residual stream on

    def attention_scale(self, i: int) -> float:
        return self._layer(i).self_attn.scale

    def attention_features(self, i: int) -> dict[str, Any]:
        return self._layer(i).self_attn.features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def use_kv_scales(self, enabled: bool) -> None:
        """Apply the checkpoint's KV-cache scales (`DecoderAttention.k_scale`), i.e. the cache is
        fp8; a layer whose scales are all 1 (the default) is left as it is."""
        scaled = []
        for i in range(self.num_layers):
            attn = self._layer(i).self_attn
            attn.kv_scaled = enabled and bool(torch.any((attn.k_scale != 1) | (attn.v_scale != 1)))
            if attn.kv_scaled:
                scaled.append(i)
        if scaled:
            logger.info("fp8 KV cache: the checkpoint's k/v scales applied in %d of %d layers", len(scaled), self.num_layers)

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self._layer(0).self_attn
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=attn.num_kv_heads,
            head_size=self.config.head_dim,
            dtype=self.dtype,
        )

    # ---- loading ----------------------------------------------------------------------------

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, object, torch.Tensor]]:
        """(parameter name, shard id, tensor) for one HF checkpoint tensor; an architecture whose
        checkpoint fuses what portside keeps apart (or the reverse) splits it here."""
        for old, new in self.renames:
            name = name.replace(old, new)
        m = _EXPERT.search(name)
        if m:
            stacked = ".experts.w2" if m[2] == "down" else ".experts.w13"
            suffix = "" if m[3] == "weight" else f"_{m[3]}"  # a quantized format's tensors: w13_qweight, ...
            yield name[: m.start()] + stacked + suffix, (int(m[1]), m[2]), tensor
            return
        for frag, fused in _FUSED_EXPERTS.items():
            if name.endswith(frag):
                yield name.removesuffix(frag) + fused, None, tensor
                return
        for frag, fused, sid in _STACKED:
            if frag in name:
                yield name.replace(frag, fused), sid, tensor
                return
        yield name, None, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        """Copy HF-named checkpoint tensors into this rank's shards; return the (parameter name,
        shard id) pairs filled (shard id None: a whole parameter). Raises on an unknown name or
        a wrong shape, naming the tensor; `check_loaded` reports missing ones."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[tuple[str, object]] = set()
        for name, tensor in weights:
            if any(s in name for s in _SKIPPED):
                continue
            scale = _KV_SCALE.search(name)
            if scale:  # an fp8 KV cache's scales: kept whatever the cache (`use_kv_scales`)
                layer = self.model.layers[int(scale[1])] if int(scale[1]) < len(self.model.layers) else None
                if scale[2] != "q" and not isinstance(layer, MissingLayer):  # q_scale: fp8 attention math (not done)
                    try:
                        cast(DecoderLayer, layer).self_attn.load_kv_scale(scale[2], tensor)
                    except (ValueError, IndexError) as e:
                        raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)}: {e}") from None
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store the copy anyway
            for target, shard_id, part in self.checkpoint_tensors(name, tensor):
                if target == "model.embed_tokens.weight" and self.model.embed_tokens is None and self.lm_head is not None \
                        and self.config.tie_word_embeddings:
                    target = "lm_head.weight"  # a last pipeline stage's tied head
                if target not in params:
                    if self._other_stage(target):
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    with torch.no_grad():
                        loader(param, part, shard_id)
                except (ValueError, RuntimeError, IndexError) as e:
                    raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)}: {e}") from None
                # a fused parameter loaded whole (transformers 5's stacked experts) has every part
                loaded |= {(target, s) for s in _parts(param)} if shard_id is None else {(target, shard_id)}
        return loaded

    def _other_stage(self, target: str) -> bool:
        """Whether parameter `target` belongs to another pipeline stage."""
        m = re.match(r"model\.layers\.(\d+)\.", target)
        if m:
            return isinstance(self.model.layers[int(m[1])], MissingLayer) if int(m[1]) < len(self.model.layers) else False
        if target.startswith("model.embed_tokens."):
            return self.model.embed_tokens is None
        return target.startswith(("model.norm.", "lm_head.")) and not self.stage.is_last

    def check_loaded(self, loaded: set[tuple[str, object]]) -> None:
        """Raise if some parameter (or fused part) was never filled by `load_weights`."""
        expected = {(name, s) for name, param in self.named_parameters() for s in _parts(param)
                    if not getattr(param, "optional", False)}  # a quantized format's optional tensors (g_idx)
        if self.config.tie_word_embeddings and self.model.embed_tokens is not None:
            expected.discard(("lm_head.weight", None))
        missing = sorted(_checkpoint_name(name, shard) for name, shard in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


def _parts(param: nn.Parameter) -> list[object]:
    """The shard ids a parameter is loaded from (`shard_ids`, set by fused layers), else [None]."""
    return list(getattr(param, "shard_ids", None) or [None])


def _checkpoint_name(name: str, shard: object) -> str:
    """The Hugging Face name of part `shard` of parameter `name`."""
    if shard is None:
        return name
    for frag, fused, sid in _STACKED:
        if fused in name and sid == shard:
            return name.replace(fused, frag)
    e, part = cast(tuple[int, str], shard)  # an expert's part of experts.w13 / experts.w2 (/ w13_qweight, ...)
    head, _, stacked = name.rpartition(".")
    return f"{head}.{e}.{part}_proj.{stacked.partition('_')[2] or 'weight'}"
