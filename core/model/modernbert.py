"""ModernBERT (`ModernBertModel`, `ModernBertForSequenceClassification`) from Hugging Face
folders.

Pre-norm layers without biases (by default: ``attention_bias``, ``mlp_bias``, ``norm_bias``):
LayerNorm (none before the first layer's attention: the embeddings' norm stands in), fused Wqkv,
rotary q/k, bidirectional attention (`ForwardContext.encoder_attention`), Wo; LayerNorm, GeGLU
MLP (Wi gives input and gate, ``act(input) * gate``, Wo); a final LayerNorm. Layers alternate
global attention (every ``global_attn_every_n_layers``-th, from the first; rotary base
``global_rope_theta``) and local attention (``local_attention`` wide: a query sees the keys at
most ``local_attention // 2`` positions away, the encoder feature ``sliding_window``; rotary base
``local_rope_theta``), as transformers' ``layer_types`` and ``rope_parameters`` give them.

The classifier: pooled state (``classifier_pooling`` cls: the first token's, mean: the mean of
the prompt's) -> head (dense, activation, LayerNorm) -> classifier.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from portside.contract import Communicator, ForwardContext, ModelOps
from portside.model.args import ModelArgs
from portside.model.bert_base import EncoderModel, check_whole_prompts, hf_activation
from portside.model.rotary import RotaryEmbedding, apply_rotary

__all__ = ["ModernBertModel", "ModernBertForSequenceClassification"]


def _norm(hf: Any, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.LayerNorm(hf.hidden_size, eps=hf.norm_eps, bias=hf.norm_bias, dtype=dtype)


def _rope_theta(hf: Any, layer_type: str) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):
        return float(params[layer_type]["rope_theta"])
    # transformers 4.x spelling
    return float(hf.local_rope_theta if layer_type == "sliding_attention" else hf.global_rope_theta)


def _layer_types(hf: Any) -> list[str]:
    types = getattr(hf, "layer_types", None)
    if types:
        return list(types)
    every = hf.global_attn_every_n_layers
    return ["full_attention" if i % every == 0 else "sliding_attention" for i in range(hf.num_hidden_layers)]


class _Embeddings(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(hf.vocab_size, hf.hidden_size, dtype=dtype)
        self.norm = _norm(hf, dtype)


class _Attention(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype, window: int | None) -> None:
        super().__init__()
        self.num_heads = hf.num_attention_heads
        self.head_dim = hf.hidden_size // hf.num_attention_heads
        self.Wqkv = nn.Linear(hf.hidden_size, 3 * hf.hidden_size, bias=hf.attention_bias, dtype=dtype)
        self.Wo = nn.Linear(hf.hidden_size, hf.hidden_size, bias=hf.attention_bias, dtype=dtype)
        self.window = window

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.Wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = ctx.encoder_attention(q, k, v.contiguous(), self.head_dim**-0.5, sliding_window=self.window)
        return self.Wo(o.reshape(x.shape[0], -1))


class _MLP(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.Wi = nn.Linear(hf.hidden_size, 2 * hf.intermediate_size, bias=hf.mlp_bias, dtype=dtype)
        self.Wo = nn.Linear(hf.intermediate_size, hf.hidden_size, bias=hf.mlp_bias, dtype=dtype)
        self.act = hf_activation(hf.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inp) * gate)


class _Layer(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype, i: int, layer_type: str) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if i == 0 else _norm(hf, dtype)
        window = int(getattr(hf, "sliding_window", None) or hf.local_attention // 2)
        self.attn = _Attention(hf, dtype, window if layer_type == "sliding_attention" else None)
        self.mlp_norm = _norm(hf, dtype)
        self.mlp = _MLP(hf, dtype)
        self.layer_type = layer_type

    def forward(self, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]], ctx: ForwardContext) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), *rope[self.layer_type], ctx)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertBody(nn.Module):
    """transformers' `ModernBertModel` modules (same names): embeddings, layers, final_norm."""

    def __init__(self, hf: Any, dtype: torch.dtype, max_len: int) -> None:
        super().__init__()
        types = _layer_types(hf)
        self.embeddings = _Embeddings(hf, dtype)
        self.layers = nn.ModuleList(_Layer(hf, dtype, i, t) for i, t in enumerate(types))
        self.final_norm = _norm(hf, dtype)
        head_dim = hf.hidden_size // hf.num_attention_heads
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(head_dim, _rope_theta(hf, t), None, max_len)
                                     for t in sorted(set(types))})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        check_whole_prompts(ctx.metadata)
        h = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        rope = {t: r(positions, h.dtype) for t, r in self.rotary.items()}
        for layer in self.layers:
            h = layer(h, rope, ctx)
        return self.final_norm(h)


class ModernBertModel(EncoderModel):
    """`ModernBertModel`: final hidden states after the final norm."""

    checkpoint_prefixes = ("model.",)
    ignored = ("head.", "decoder.")  # ModernBertForMaskedLM's head

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None) -> None:
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops)
        body = ModernBertBody(self.hf, dtype, args.max_model_len or args.max_position_embeddings)
        self.embeddings, self.layers, self.final_norm, self.rotary = body.embeddings, body.layers, body.final_norm, body.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return ModernBertBody.forward(self, input_ids, positions, ctx)  # type: ignore[arg-type]


class _Head(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(hf.hidden_size, hf.hidden_size, bias=hf.classifier_bias, dtype=dtype)
        self.act = hf_activation(hf.classifier_activation)
        self.norm = _norm(hf, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(EncoderModel):
    """ModernBERT cross-encoder / classifier: pooled state -> head -> classifier."""

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None) -> None:
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops)
        pooling = getattr(self.hf, "classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"ModernBERT classifier_pooling {pooling!r}: expected cls or mean")
        # per checkpoint, not per class
        self.default_pooling_type = pooling  # type: ignore[misc]
        self.num_labels = int(self.hf.num_labels)
        self.model = ModernBertBody(self.hf, dtype, args.max_model_len or args.max_position_embeddings)
        self.head = _Head(self.hf, dtype)
        self.classifier = nn.Linear(self.hf.hidden_size, self.num_labels, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, H] pooled states (`default_pooling_type`) -> [B, num_labels] logits."""
        return self.classifier(self.head(pooled.to(self.dtype)))
