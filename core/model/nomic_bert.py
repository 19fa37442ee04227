"""NomicBERT (`NomicBertModel`: nomic-embed-text v1 / v1.5) from Hugging Face folders.

transformers has no class for it (the checkpoints carry custom code, which portside never runs):
the config is read from config.json as nomic's own code does (GPT-2 spellings: ``n_embd``,
``n_head``, ``n_layer``, ``n_inner``, ``n_positions``; `read_nomic_config`), and the tensors by
the names nomic's checkpoints use: ``embeddings.word_embeddings``,
``embeddings.token_type_embeddings``, ``emb_ln``, ``encoder.layers.N.{attn.Wqkv, attn.out_proj,
mlp.fc11, mlp.fc12, mlp.fc2, norm1, norm2}``.

Post-norm BERT layers with rotary positions instead of position embeddings: embeddings are word +
token type, then LayerNorm (``emb_ln``); a layer is ``norm1(x + out_proj(attn(rotary(Wqkv x))))``
then ``norm2(x + fc2(fc11(x) * act(fc12(x))))`` (SwiGLU: act = silu; GeGLU: gelu), attention
bidirectional (`ForwardContext.encoder_attention`). Rotary: non-interleaved halves on the first
``rotary_emb_fraction`` of each head, base ``rotary_emb_base``. sentence-transformers pools it
by the mean (`default_pooling_type`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from portside.contract import Communicator, ForwardContext, ModelOps
from portside.model.args import ModelArgs
from portside.model.bert_base import EncoderModel, check_whole_prompts
from portside.model.rotary import RotaryEmbedding, apply_rotary

__all__ = ["NomicBertModel", "read_nomic_config"]

_ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
            "intermediate_size": "n_inner", "max_position_embeddings": "n_positions"}
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"swiglu": F.silu, "geglu": F.gelu}


def read_nomic_config(folder: str | Path) -> Any | None:
    """A `transformers.PretrainedConfig` for a NomicBERT folder (its config.json with the BERT
    spellings added); None for any other folder."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if raw.get("model_type") != "nomic_bert":
        return None
    from transformers import PretrainedConfig

    fields = {k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}
    for name, nomic in _ALIASES.items():
        if nomic in raw:
            fields[name] = raw[nomic]
    if not fields.get("intermediate_size"):
        fields["intermediate_size"] = 4 * fields["hidden_size"]
    config = PretrainedConfig(**fields)
    config.model_type = "nomic_bert"
    return config


def _check(hf: Any) -> None:
    refused = {"prenorm": bool(getattr(hf, "prenorm", False)), "rotary_emb_interleaved":
               bool(getattr(hf, "rotary_emb_interleaved", False)), "rotary_scaling_factor":
               getattr(hf, "rotary_scaling_factor", None) is not None}
    for name, on in refused.items():
        if on:
            raise ValueError(f"NomicBertModel with {name}={getattr(hf, name)!r} is not supported")
    act = getattr(hf, "activation_function", "swiglu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"NomicBertModel activation_function {act!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")


class _Embeddings(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(hf.vocab_size, hf.hidden_size, dtype=dtype)
        types = int(getattr(hf, "type_vocab_size", 0) or 0)
        self.token_type_embeddings = nn.Embedding(types, hf.hidden_size, dtype=dtype) if types else None


class _Attention(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(getattr(hf, "qkv_proj_bias", True))
        self.num_heads, self.head_dim = hf.num_attention_heads, hf.hidden_size // hf.num_attention_heads
        self.Wqkv = nn.Linear(hf.hidden_size, 3 * hf.hidden_size, bias=bias, dtype=dtype)
        self.out_proj = nn.Linear(hf.hidden_size, hf.hidden_size, bias=bias, dtype=dtype)


class _MLP(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        b1, b2 = bool(getattr(hf, "mlp_fc1_bias", True)), bool(getattr(hf, "mlp_fc2_bias", True))
        self.fc11 = nn.Linear(hf.hidden_size, hf.intermediate_size, bias=b1, dtype=dtype)
        self.fc12 = nn.Linear(hf.hidden_size, hf.intermediate_size, bias=b1, dtype=dtype)
        self.fc2 = nn.Linear(hf.intermediate_size, hf.hidden_size, bias=b2, dtype=dtype)


class _Layer(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        eps = float(getattr(hf, "layer_norm_epsilon", 1e-12))
        self.attn, self.mlp = _Attention(hf, dtype), _MLP(hf, dtype)
        self.norm1 = nn.LayerNorm(hf.hidden_size, eps=eps, dtype=dtype)
        self.norm2 = nn.LayerNorm(hf.hidden_size, eps=eps, dtype=dtype)
        self.act = _ACTIVATIONS[getattr(hf, "activation_function", "swiglu")]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        a = self.attn
        q, k, v = a.Wqkv(x).view(x.shape[0], 3, a.num_heads, a.head_dim).unbind(1)
        o = ctx.encoder_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.contiguous(), a.head_dim**-0.5)
        x = self.norm1(x + a.out_proj(o.reshape(x.shape[0], -1)))
        m = self.mlp
        return self.norm2(x + m.fc2(m.fc11(x) * self.act(m.fc12(x))))


class _Encoder(nn.Module):
    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(hf, dtype) for _ in range(hf.num_hidden_layers))


class NomicBertModel(EncoderModel):
    """`NomicBertModel`: final hidden states (post-norm: the last layer's norm2 is the last op)."""

    default_pooling_type = "mean"
    ignored = ("cls.", "lm_head.")

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None) -> None:
        super().__init__(args, comm, tp_rank, tp_size, dtype, ops)
        hf = self.hf
        _check(hf)
        self.embeddings = _Embeddings(hf, dtype)
        self.emb_ln = nn.LayerNorm(hf.hidden_size, eps=float(getattr(hf, "layer_norm_epsilon", 1e-12)), dtype=dtype)
        self.encoder = _Encoder(hf, dtype)
        head_dim = hf.hidden_size // hf.num_attention_heads
        rotary_dim = int(head_dim * float(getattr(hf, "rotary_emb_fraction", 1.0) or 1.0))
        self.rotary = RotaryEmbedding(head_dim, float(getattr(hf, "rotary_emb_base", 10000.0)), None,
                                      args.max_position_embeddings, args.max_model_len, rotary_dim=rotary_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        check_whole_prompts(ctx.metadata)
        e = self.embeddings
        h = e.word_embeddings(input_ids)
        if e.token_type_embeddings is not None:
            types = ctx.token_type_ids
            h = h + (e.token_type_embeddings.weight[0] if types is None else e.token_type_embeddings(types))
        h = self.emb_ln(h)
        cos, sin = self.rotary(positions, h.dtype)
        for layer in self.encoder.layers:
            h = layer(h, cos, sin, ctx)
        return h
