"""A GGUF file's metadata -> the Hugging Face config.json llama.cpp's converter started from.

Hyper-parameters the converter leaves out are llama.cpp's: Gemma's attention scale and
sliding-window layer pattern, the routers' top-k renormalisation (`NORM_TOPK`). Float keys come
back in their short decimal form (GGUF stores them as float32).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from portside.model.gguf_arch import ARCHS, NORM_TOPK

__all__ = ["hf_config", "metadata"]

# tokenizer keys kept (the large token tables are read by transformers, which builds the tokenizer)
_TOKENIZER_IDS = (
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.model",
)


def metadata(reader: Any) -> dict[str, Any]:
    """A `gguf.GGUFReader`'s metadata as {key: value}, without the tokenizer's token tables."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in _TOKENIZER_IDS:
            continue  # large token tables: the tokenizer is built by transformers
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - unreadable extra metadata is not needed
            continue
    return out


def _f32_to_decimal(x: Any) -> float:
    """GGUF stores these as float32 (1e-5 reads back as 9.99999974e-06): restore the short form."""
    return float(f"{float(x):.7g}")


def hf_config(
    meta: dict[str, Any], key: str, vocab_size: int, names: set[str], factors: dict[str, np.ndarray], dtype: torch.dtype
) -> dict[str, Any]:
    """config.json for a file of `ARCHS[key]` with metadata `meta`, tensors `names` (GGUF names)
    and Phi-3's longrope `factors` (tensor name -> values; empty otherwise)."""
    arch, spec = meta["general.architecture"], ARCHS[key]

    def get(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    theta = _f32_to_decimal(get("rope.freq_base", 10000.0))
    rope = _rope(get, theta)
    cfg: dict[str, Any] = {
        "architectures": [spec.hf],
        "model_type": spec.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": _f32_to_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_output.bias" in names,
        "mlp_bias": "blk.0.ffn_down.bias" in names,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if get("expert_count"):
        cfg.update(_experts_config(key, get, cfg["intermediate_size"]))
    if get("attention.clamp_kqv"):
        cfg["clip_qkv"] = _f32_to_decimal(get("attention.clamp_kqv"))
    if key == "phi3":
        rope = _phi3_config(cfg, get, rope, factors)
    cfg["rope_theta"] = theta  # transformers 4.x
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope  # transformers 4.x
    cfg["rope_parameters"] = rope  # transformers 5.x
    if key in ("gemma2", "gemma3"):
        cfg.update(_gemma_config(key, get, cfg, rope))
    return cfg


def _rope(get: Any, theta: float) -> dict[str, Any]:
    """HF rope parameters from the rope.scaling.* keys (longrope: Phi-3's factors are tensors)."""
    kind = get("rope.scaling.type") or "none"
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if kind in ("linear", "yarn"):
        rope.update(rope_type=kind, factor=_f32_to_decimal(get("rope.scaling.factor", 1.0)))
    if kind == "yarn":
        rope["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
        for gguf_key, hf_key in (("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"), ("attn_factor", "attention_factor")):
            if get(f"rope.scaling.yarn_{gguf_key}") is not None:
                rope[hf_key] = _f32_to_decimal(get(f"rope.scaling.yarn_{gguf_key}"))
    elif kind not in ("none", "linear", "longrope"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (portside: none, linear, yarn, longrope)")
    return rope


def _experts_config(key: str, get: Any, ffn: int) -> dict[str, Any]:
    experts, top_k = int(get("expert_count")), int(get("expert_used_count"))
    if key == "mixtral":  # experts as wide as intermediate_size; the router always renormalises
        return {"num_local_experts": experts, "num_experts_per_tok": top_k, "sliding_window": None}
    width = int(get("expert_feed_forward_length", ffn))
    out: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": width,
        "norm_topk_prob": bool(get("expert_weights_norm", NORM_TOPK[key])),
    }
    if key != "olmoe":  # Qwen-MoE: llama.cpp has experts in every layer (OLMoE's are intermediate_size wide)
        out.update(decoder_sparse_step=1, mlp_only_layers=[])
    if get("expert_shared_feed_forward_length"):
        out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    return out


def _gemma_config(key: str, get: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp reads (or assumes) for Gemma 2 / 3: sliding windows on all layers but every
    2nd / 6th, attention scaled by head_dim (hidden / heads for the 27B models), soft-caps."""
    layers = cfg["num_hidden_layers"]
    window = int(get("attention.sliding_window", 4096 if key == "gemma2" else 0)) or None
    pattern = get("attention.sliding_window_pattern", 2 if key == "gemma2" else 6)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    scale = get("attention.scale")
    if scale:
        scalar: float = _f32_to_decimal(scale) ** -2
    elif layers == {"gemma2": 46, "gemma3": 62}[key]:  # llama.cpp: the 27B models
        scalar = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        scalar = cfg["head_dim"]
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in sliding],
        "attn_logit_softcapping": _optional(get("attn_logit_softcapping")),
        "final_logit_softcapping": _optional(get("final_logit_softcapping")),
    }
    if key == "gemma3":  # the sliding layers rotate with a base of their own, unscaled
        local = _f32_to_decimal(get("rope.freq_base_swa", 10000.0))
        out["rope_local_base_freq"] = local  # transformers 4.x
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return out


def _phi3_config(cfg: dict[str, Any], get: Any, rope: dict[str, Any], factors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Phi-3's window (0: none), partial rotary and longrope (factors stored as tensors); returns its rope."""
    head_dim = cfg["head_dim"]
    partial = int(get("rope.dimension_count", head_dim)) / head_dim
    original = get("rope.scaling.original_context_length")
    cfg.update(sliding_window=int(get("attention.sliding_window", 0)) or None, partial_rotary_factor=partial)
    if original:
        cfg["original_max_position_embeddings"] = int(original)
    rope = dict(rope, partial_rotary_factor=partial)
    if factors:
        rope.update(
            rope_type="longrope",
            long_factor=[float(f) for f in factors["rope_factors_long.weight"]],
            short_factor=[float(f) for f in factors["rope_factors_short.weight"]],
        )
        attn = get("rope.scaling.attn_factor")
        scale = cfg["max_position_embeddings"] / int(original)
        derived = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
        if attn is not None and abs(float(attn) - derived) > 1e-6:  # transformers derives the same by default
            rope["attention_factor"] = _f32_to_decimal(attn)
    return rope


def _optional(value: Any) -> float | None:
    return _f32_to_decimal(value) if value else None

