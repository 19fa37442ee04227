"""`ModelArgs`: the architecture hyper-parameters a portside model is built from.

Read from a Hugging Face ``config.json`` through `transformers.AutoConfig`, accepting both the
transformers 5.x (``rope_parameters``) and 4.x (``rope_theta`` + ``rope_scaling``) spellings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RopeScaling", "ModelArgs"]

# Architectures whose q/k/v projections always carry a bias (whatever attention_bias says).
_QKV_BIAS_ARCHS = frozenset({"Qwen2ForCausalLM"})


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for longer contexts."""

    rope_type: str  # "linear", "dynamic" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2)."""

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

    @property
    def num_hidden_layers(self) -> int:  # HF spelling
        return self.num_layers

    @classmethod
    def from_hf(cls, hf: Any, folder: str | Path | None = None, max_model_len: int | None = None) -> ModelArgs:
        """From a `transformers.PretrainedConfig`; `folder` adds eos ids from generation_config.json."""
        arch = (getattr(hf, "architectures", None) or ["LlamaForCausalLM"])[0]
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        theta, scaling = _read_rope(hf)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=attention_bias or arch in _QKV_BIAS_ARCHS,
            o_bias=attention_bias and arch not in _QKV_BIAS_ARCHS,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(hf),
            eos_token_ids=_eos_ids(hf, folder),
            bos_token_id=getattr(hf, "bos_token_id", None),
            max_model_len=max_model_len,
        )


def _read_rope(hf: Any) -> tuple[float, RopeScaling | None]:
    params: dict[str, Any] = {}
    old = getattr(hf, "rope_scaling", None)  # transformers 4.x (5.x may alias it)
    if isinstance(old, dict):
        params.update(old)
    new = getattr(hf, "rope_parameters", None)  # transformers 5.x
    if isinstance(new, dict):
        params.update(new)
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "dynamic", "llama3"):
        raise ValueError(f"rope scaling {rope_type!r} is not supported; portside supports linear, dynamic and llama3")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
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
