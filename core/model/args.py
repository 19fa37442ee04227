"""`ModelArgs`: the architecture hyper-parameters a portside model is built from.

Read from a Hugging Face ``config.json`` through `transformers.AutoConfig`, accepting both the
transformers 5.x (``rope_parameters``) and 4.x (``rope_theta`` + ``rope_scaling``) spellings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RopeScaling", "ModelArgs"]

# Architectures whose q/k/v projections always carry a bias (whatever attention_bias says).
_QKV_BIAS_ARCHS = frozenset({"Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"})
# Vision-language architectures: a language model (text_config) plus a vision tower
MULTIMODAL_ARCHS = frozenset({"LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                              "Qwen2_5_VLForConditionalGeneration"})


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for longer contexts: transformers' rope parameters,
    computed by `portside.model.rotary`."""

    TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")  # not a field (no annotation)

    rope_type: str  # one of TYPES
    factor: float = 1.0  # yarn, longrope: max_position_embeddings / original where the config has none
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn, longrope (None: max_position_embeddings)
    attention_factor: float | None = None  # yarn, longrope: cos/sin multiplier (None: derived from factor, mscale)
    beta_fast: float = 32.0  # yarn: the ramp between kept and interpolated dims, in rotations
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn: with mscale_all_dim, attention factor mscale(mscale) / mscale(mscale_all_dim)
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: ramp bounds rounded to whole dims
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors, context within the original
    long_factor: tuple[float, ...] = ()  # longrope: context beyond the original


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a decoder-only model (every architecture of `registry`). What only
    some architectures use has a neutral default (no window, no soft-cap, no experts)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    max_model_len: int | None = None  # the engine's context length (sizes dynamic rope scaling)
    hidden_act: str = "silu"
    # per layer: "sliding_attention" (window `sliding_window`) or "full_attention"; () = all full
    layer_types: tuple[str, ...] = ()
    attn_logit_softcap: float | None = None  # Gemma 2
    final_logit_softcap: float | None = None  # Gemma 2
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power, not head_dim's
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' rope base (no scaling)
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor dims only
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip]
    # mixture of experts (num_experts 0: a dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert (0: none)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP; () = every layer
    # vision-language models: the language model's args above come from the config's text_config;
    # `hf_config` is the whole transformers config (vision tower, projector, image token ids; the
    # fields only one architecture reads, such as a state-space layer's sizes)
    mrope_section: tuple[int, ...] = ()  # Qwen2.5-VL: rotary frequencies per (t, h, w) position
    hf_config: Any = field(default=None, compare=False, repr=False)
    # hybrid models: the engine's --mamba-ssm-cache-dtype ("auto", "float32", ...; `ssm_state_dtype`)
    mamba_ssm_cache_dtype: str = "auto"

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window, or None for full attention."""
        if self.sliding_window is None:
            return None
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer has the same one (Mistral v0.1, Phi-3-mini-4k, Qwen2 with
        all layers windowed), else None (no window, or mixed layers like Gemma's)."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    def ssm_state_dtype(self, model_dtype: Any) -> Any:
        """The torch dtype of a recurrent layer's SSM or delta-rule state: the engine's
        --mamba-ssm-cache-dtype, else (auto) the checkpoint config's `mamba_ssm_cache_dtype`,
        else the model's dtype (vLLM's rule)."""
        import torch

        name = self.mamba_ssm_cache_dtype
        if name == "auto":
            name = str(getattr(self.hf_config, "mamba_ssm_cache_dtype", None) or "auto")
        if name == "auto":
            return model_dtype
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"mamba_ssm_cache_dtype {name!r}: expected auto, float32, bfloat16 or float16")
        return dtype

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[i])

    @property
    def num_hidden_layers(self) -> int:  # HF spelling
        return self.num_layers

    @classmethod
    def from_hf(cls, hf: Any, folder: str | Path | None = None, max_model_len: int | None = None) -> ModelArgs:
        """From a `transformers.PretrainedConfig`; `folder` adds eos ids from generation_config.json.
        A vision-language config (`MULTIMODAL_ARCHS`) describes its language model in text_config."""
        arch = (getattr(hf, "architectures", None) or ["LlamaForCausalLM"])[0]
        whole = hf
        if arch in MULTIMODAL_ARCHS:
            hf = hf.get_text_config()
            if getattr(whole, "eos_token_id", None) is not None and getattr(hf, "eos_token_id", None) is None:
                hf.eos_token_id = whole.eos_token_id
        num_heads = getattr(hf, "num_attention_heads", None) or getattr(hf, "num_heads", None) or 1  # Mamba2: no attention
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        theta, scaling, local_theta = _read_rope(hf)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        num_experts = int(getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0)
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=int(getattr(hf, "intermediate_size", None) or 0),
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=bool(getattr(hf, "qkv_bias", False)) or attention_bias or _qwen2_attention(arch, hf),
            o_bias=attention_bias and not _qwen2_attention(arch, hf),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            # a vision-language model ties by its top-level flag (transformers copies text_config's into it)
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False) or getattr(whole, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(hf),
            eos_token_ids=_eos_ids(hf, folder),
            bos_token_id=getattr(hf, "bos_token_id", None),
            max_model_len=max_model_len,
            hidden_act=getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None) or "silu",
            layer_types=_layer_types(hf),
            attn_logit_softcap=_positive(getattr(hf, "attn_logit_softcapping", None)),
            final_logit_softcap=_positive(getattr(hf, "final_logit_softcapping", None)),
            query_pre_attn_scalar=_positive(getattr(hf, "query_pre_attn_scalar", None)),
            rope_local_theta=local_theta,
            partial_rotary_factor=_partial_rotary_factor(hf),
            clip_qkv=_positive(getattr(hf, "clip_qkv", None)),
            num_experts=num_experts,
            num_experts_per_tok=int(getattr(hf, "num_experts_per_tok", 0) or 0) if num_experts else 0,
            moe_intermediate_size=int(getattr(hf, "moe_intermediate_size", None) or getattr(hf, "intermediate_size", None) or 0)
            if num_experts
            else 0,
            shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
            norm_topk_prob=_norm_topk_prob(hf, arch),
            moe_layers=_moe_layers(hf, num_experts),
            mrope_section=_mrope_section(hf),
            hf_config=whole,
        )


def _qwen2_attention(arch: str, hf: Any) -> bool:
    """Qwen2's q/k/v projections always carry a bias, its o projection none (whatever attention_bias says)."""
    return arch in _QKV_BIAS_ARCHS or getattr(hf, "model_type", "") == "qwen2"  # e.g. a LLaVA's Qwen2 text model


def _mrope_section(hf: Any) -> tuple[int, ...]:
    for params in (getattr(hf, "rope_parameters", None), getattr(hf, "rope_scaling", None)):
        if isinstance(params, dict) and params.get("mrope_section"):
            return tuple(int(x) for x in params["mrope_section"])
    return ()


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _layer_types(hf: Any) -> tuple[str, ...]:
    types = getattr(hf, "layer_types", None)
    if types:
        return tuple(types)
    pattern = getattr(hf, "sliding_window_pattern", None) or getattr(hf, "_sliding_window_pattern", None)
    if pattern and getattr(hf, "sliding_window", None):  # Gemma 3 on transformers 4.x: every pattern-th is global
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(hf.num_hidden_layers))
    return ()


def _partial_rotary_factor(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(getattr(hf, "partial_rotary_factor", None) or 1.0)


# Architectures whose router always renormalises its top-k weights (no norm_topk_prob field).
_RENORMALISING_ROUTERS = frozenset({"MixtralForCausalLM"})


def _norm_topk_prob(hf: Any, arch: str) -> bool:
    return arch in _RENORMALISING_ROUTERS or bool(getattr(hf, "norm_topk_prob", False))


def _moe_layers(hf: Any, num_experts: int) -> tuple[bool, ...]:
    """Which layers have experts: Qwen-MoE's `mlp_only_layers` and `decoder_sparse_step`."""
    if not num_experts:
        return ()
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = int(getattr(hf, "decoder_sparse_step", None) or 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(hf.num_hidden_layers))


def _read_rope(hf: Any) -> tuple[float, RopeScaling | None, float | None]:
    """(rope theta, its scaling, the sliding layers' own theta where they have one: Gemma 3)."""
    params: dict[str, Any] = {}
    old = getattr(hf, "rope_scaling", None)  # transformers 4.x (5.x may alias it)
    if isinstance(old, dict):
        params.update(old)
    new = getattr(hf, "rope_parameters", None)  # transformers 5.x
    local_theta = getattr(hf, "rope_local_base_freq", None)  # Gemma 3 on transformers 4.x
    if isinstance(new, dict) and isinstance(new.get("full_attention"), dict):  # per layer type (Gemma 3)
        local = new.get("sliding_attention") or {}
        local_theta = local.get("rope_theta", local_theta)
        new = new["full_attention"]
    if isinstance(new, dict):
        params.update(new)
    theta, scaling = _rope_scaling(hf, params)
    return theta, scaling, float(local_theta) if local_theta else None


def _rope_scaling(hf: Any, params: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default" or (rope_type == "mrope" and params.get("mrope_section")):
        # mrope: default frequencies over 3-D positions (`ModelArgs.mrope_section`)
        return theta, None
    rope_type = "longrope" if rope_type == "su" else rope_type  # older Phi-3 configs
    if rope_type not in RopeScaling.TYPES:
        supported = ", ".join(RopeScaling.TYPES)
        raise ValueError(f"rope type {rope_type!r} is not supported (portside: default, {supported}; su = longrope)")
    # transformers prefers a top-level original_max_position_embeddings (Phi-3) to the rope dict's
    original = getattr(hf, "original_max_position_embeddings", None) or params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and original and rope_type in ("yarn", "longrope"):  # the extended / the original context
        factor = getattr(hf, "max_position_embeddings", 2048) / original

    def optional(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original else None,
        attention_factor=optional("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
    )


def _sliding_window(hf: Any) -> int | None:
    if getattr(hf, "use_sliding_window", True) is False:
        return None
    window = getattr(hf, "sliding_window", None)
    return int(window) if window else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_ids(hf: Any, folder: str | Path | None) -> tuple[int, ...]:
    ids = _as_ids(getattr(hf, "eos_token_id", None))
    if folder is not None:
        gen = Path(folder) / "generation_config.json"
        if gen.is_file():
            ids += _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))
