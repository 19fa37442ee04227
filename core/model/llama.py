"""The Llama family (Llama, Mistral, Qwen2) as plain modules, tensor-parallel ready.

Differences between the three are data in `ModelArgs` (qkv bias, tied embeddings, explicit
head_dim, rope scaling); the checkpoint names are Hugging Face's, so `load_weights` maps them
with one table (q/k/v -> fused qkv_proj, gate/up -> fused gate_up_proj).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from portside.backend_api import Communicator, ForwardContext, KVCacheSpec, ModelOps, SingleRankCommunicator
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
from portside.model.rotary import RotaryEmbedding, apply_rotary

__all__ = ["LlamaForCausalLM"]

# checkpoint name fragment -> (fused module fragment, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class _TP:
    """Where this module sits in the tensor-parallel group."""

    def __init__(self, comm: Communicator, rank: int, size: int) -> None:
        self.comm, self.rank, self.size = comm, rank, size


class LlamaAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, tp: _TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = args.head_dim
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads, args.qkv_bias, tp.rank, tp.size, dtype
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.o_proj = RowParallelLinear(
            args.num_heads * args.head_dim, args.hidden_size, args.o_bias, tp.rank, tp.size, dtype, tp.comm
        )
        self.scale = args.head_dim**-0.5

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D], rotary applied."""
        T, D = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * D, self.num_kv_heads * D
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary(q.view(T, self.num_heads, D), cos, sin)  # [T, H, D]
        k = apply_rotary(k.view(T, self.num_kv_heads, D), cos, sin)  # [T, KVH, D]
        return q, k, v.reshape(T, self.num_kv_heads, D)

    def out(self, o: torch.Tensor) -> torch.Tensor:  # o [T, H, D] -> [T, hidden]
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, args: ModelArgs, tp: _TP, dtype: torch.dtype) -> None:
        super().__init__()
        inter = args.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size, [inter, inter], args.mlp_bias, tp.rank, tp.size, dtype
        )
        self.down_proj = RowParallelLinear(inter, args.hidden_size, args.mlp_bias, tp.rank, tp.size, dtype, tp.comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, inter / tp] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, tp: _TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(args, layer_idx, tp, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(args, tp, dtype)

    def pre_attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.self_attn.qkv(self.input_layernorm(h), cos, sin)

    def post_attention(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:  # h [T, hidden], o [T, H, D]
        h = h + self.self_attn.out(o)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """The decoder's parameters (HF names `model.*`). The forward pass is on LlamaForCausalLM,
    which also exposes it piece by piece (`PiecewiseModel`)."""

    def __init__(self, args: ModelArgs, tp: _TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp.rank, tp.size, dtype, tp.comm)
        self.rotary = RotaryEmbedding(
            args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings, args.max_model_len
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i, tp, dtype) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. Serves LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM.

    `forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]` (after the final norm);
    `compute_logits(hidden [N, hidden]) -> fp32 logits [N, vocab]` on every rank.
    """

    def __init__(
        self,
        args: ModelArgs,
        comm: Communicator | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        ops: ModelOps | None = None,
    ) -> None:
        super().__init__()
        self.config = args
        self.dtype = dtype
        tp = _TP(comm or SingleRankCommunicator(), tp_rank, tp_size)
        self.model = LlamaModel(args, tp, dtype)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp.rank, tp.size, dtype, tp.comm)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h, rope = self.embed(input_ids, positions)
        for i in range(self.num_layers):
            q, k, v = self.pre_attention(i, h, rope)
            o = ctx.attention(i, q, k, v, self.attention_scale(i), **self.attention_features(i))  # [T, H, D]
            h = self.post_attention(i, h, o)
        return self.final_norm(h)

    # ---- portside.backend_api.PiecewiseModel: the model cut at its attention calls ----------

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def _layer(self, i: int) -> LlamaDecoderLayer:
        return cast(LlamaDecoderLayer, self.model.layers[i])  # nn.ModuleList items are typed as Module

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        return h, self.model.rotary(positions, h.dtype)  # rope: cos, sin [T, D/2], shared by every layer

    def pre_attention(self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return self._layer(i).pre_attention(h, *rope)

    def post_attention(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return self._layer(i).post_attention(h, o)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def attention_scale(self, i: int) -> float:
        return self._layer(i).self_attn.scale

    def attention_features(self, i: int) -> dict[str, object]:
        return {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        return self.lm_head(hidden).float()

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self._layer(0).self_attn
        return KVCacheSpec(
            num_layers=self.config.num_layers,
            num_kv_heads=attn.num_kv_heads,
            head_size=self.config.head_dim,
            dtype=self.dtype,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into this rank's shards; return the parameter names
        filled. Raises on an unknown name; `check_loaded` reports missing ones."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if any(s in name for s in _SKIPPED):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store the copy anyway
            target, shard_id = name, None
            for frag, fused, sid in _STACKED:
                if frag in name:
                    target, shard_id = name.replace(frag, fused), sid
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                loader(param, tensor, shard_id)
            loaded.add(target if shard_id is None else f"{target}#{shard_id}")
        return loaded

    def check_loaded(self, loaded: set[str]) -> None:
        """Raise if some parameter (or fused part) was never filled by `load_weights`."""
        expected: set[str] = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                expected |= {f"{name}#{s}" for s in "qkv"}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}#0", f"{name}#1"}
            else:
                expected.add(name)
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
