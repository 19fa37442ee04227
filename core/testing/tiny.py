"""Tiny random-weight models for tests, built in a second or two, deterministically, without a
network; the names most tests import.

- `make_tiny_model(path, arch=...)`: a Hugging Face folder (config.json, safetensors, tokenizer)
  whose weights `transformers` itself initialises (then re-drawn wider so that greedy decoding
  does not collapse onto one token);
- `make_tiny_lora(model_dir, out_dir)`: a random LoRA adapter for such a model, made and saved
  by `peft` itself; `make_draft_model`: a perturbed (and optionally shallower) copy;
- re-exported from the modules that hold them: the tokenizer (`make_tiny_tokenizer` and its
  templates and tokens, `portside.testing.tiny_tokenizer`), the oracle (`hf_greedy`,
  `hf_logits`, `hf_model`: transformers' fp32 results, `portside.testing.hf_oracle`) and GGUF
  files written as llama.cpp's converter writes them (`make_tiny_gguf`,
  `portside.testing.tiny_gguf`).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from portside.testing.hf_oracle import hf_greedy, hf_logits, hf_model
from portside.testing.tiny_gguf import make_tiny_gguf
from portside.testing.tiny_tokenizer import (
    CHATML_TEMPLATE,
    HERMES_TOOLS_TEMPLATE,
    QWEN_MARKERS,
    SPECIAL_TOKENS,
    make_tiny_tokenizer,
)

__all__ = [
    "CHATML_TEMPLATE",
    "HERMES_TOOLS_TEMPLATE",
    "LLAMA_LORA_TARGETS",
    "PHI3_LORA_TARGETS",
    "QWEN_MARKERS",
    "SPECIAL_TOKENS",
    "TINY_ARCHS",
    "hf_greedy",
    "hf_logits",
    "hf_model",
    "make_draft_model",
    "make_tiny_gguf",
    "make_tiny_lora",
    "make_tiny_model",
    "make_tiny_tokenizer",
    "read_config",
    "widen_init",
]

TINY_ARCHS: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# Per tiny arch: the transformers config class and what its tiny shape sets beyond the common
# ones (experts: 4 of them, top-2, each half the dense MLP's width).
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
_TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, norm_topk_prob=True, **_MOE)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(shared_expert_intermediate_size=96, use_sliding_window=False, **_MOE)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, clip_qkv=8.0)),
    "gemma2": ("Gemma2Config", dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=8,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=4.0,
                                    hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        num_hidden_layers=3,
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "default", "rope_theta": 100000.0}})),
    "phi3": ("Phi3Config", dict(sliding_window=None)),
}


def _hf_config(arch: str, vocab_size: int, eos_id: int, pad_id: int, overrides: dict[str, Any]) -> Any:
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    if arch not in _TINY_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; use one of {sorted(TINY_ARCHS)}")
    cls_name, arch_kwargs = _TINY_CONFIGS[arch]
    kwargs.update(arch_kwargs)
    kwargs.update(overrides)
    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [TINY_ARCHS[arch]]
    return config


@torch.no_grad()
def widen_init(model: torch.nn.Module, std: float, seed: int) -> None:
    """Re-draw every weight wider than HF's default init (std 0.02 makes every logit ~equal, so
    greedy decoding repeats one token). Norm weights are ~1 (but not exactly, so loading them
    is tested); biases are small."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(std * noise)


def make_tiny_model(
    path: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    init_std: float = 0.25,
    max_shard_size: int | str | None = None,
    added_tokens: tuple[str, ...] = (),
    chat_template: str = CHATML_TEMPLATE,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random-weight HF model folder at `path` and return it.

    Shape: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, intermediate 128, vocab =
    the tiny tokenizer's, max_position_embeddings 512, fp32. `arch` is "llama", "mistral"
    (explicit head_dim, no sliding window) or "qwen2" (qkv bias). `config_overrides` go to the
    transformers config class (e.g. ``tie_word_embeddings=True``, ``head_dim=32``,
    ``num_hidden_layers=4``, ``rope_parameters={...}``). `max_shard_size` (e.g. ``"100KB"``)
    writes sharded safetensors with an index. `added_tokens` / `chat_template`: as
    `make_tiny_tokenizer` (the vocabulary grows by the added tokens).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tok = make_tiny_tokenizer(path, added_tokens=added_tokens, chat_template=chat_template)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config = _hf_config(arch, len(tok), eos_id, pad_id, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen_init(model, init_std, seed)
    if config.tie_word_embeddings:  # the re-draw must not untie the shared tensor
        model.tie_weights()
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **save_kwargs)
    return path


LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's fused projections


def make_draft_model(target: str | os.PathLike, path: str | os.PathLike, noise_std: float = 0.01, seed: int = 0,
                     num_layers: int | None = None) -> Path:
    """A draft model for `target` at `path`: its folder (tokenizer included) with every weight
    perturbed by Gaussian noise of `noise_std` (0: an exact copy) and, given `num_layers`, only its
    first layers kept. On the tiny models noise 0.01 makes a draft whose proposals the target
    accepts at every depth, about a third of them."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = Path(path)
    shutil.copytree(target, path, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for f in sorted(path.glob("*.safetensors")):
        weights = load_file(f)
        if num_layers is not None:
            weights = {k: v for k, v in weights.items()
                       if not (m := re.match(r".*\.layers\.(\d+)\.", k)) or int(m.group(1)) < num_layers}
        save_file({k: v + noise_std * torch.randn(v.shape, generator=g).to(v.dtype) if noise_std else v
                   for k, v in weights.items()}, f, metadata={"format": "pt"})
    if num_layers is not None:
        config = json.loads((path / "config.json").read_text())
        config["num_hidden_layers"] = num_layers
        (path / "config.json").write_text(json.dumps(config, indent=2))
        for index in path.glob("*.safetensors.index.json"):
            data = json.loads(index.read_text())
            data["weight_map"] = {k: v for k, v in data["weight_map"].items()
                                  if not (m := re.match(r".*\.layers\.(\d+)\.", k)) or int(m.group(1)) < num_layers}
            index.write_text(json.dumps(data, indent=2))
    return path


def make_tiny_lora(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    r: int = 8,
    alpha: int = 16,
    target_modules: tuple[str, ...] = LLAMA_LORA_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    safe_serialization: bool = True,
    **extra_config: Any,
) -> Path:
    """Write a random PEFT LoRA adapter for the tiny model at `model_dir` into `out_dir`; return it.

    `peft` builds it (`LoraConfig(r=r, lora_alpha=alpha, target_modules=..., use_rslora=...,
    **extra_config)`, e.g. ``rank_pattern=``, ``alpha_pattern=``, ``modules_to_save=``) and saves
    it with `save_pretrained` (``adapter_model.bin`` when `safe_serialization` is false). A and B
    are then re-drawn from `seed`: A ~ N(0, 1/in), B ~ N(0, 0.25/r), so that the update
    scaling * B A is about half the size of the base weights at the default r and alpha (greedy
    tokens change within a few steps, logits stay finite). Every name in `target_modules` must
    name a module of the model (Phi-3 fuses its projections: use `PHI3_LORA_TARGETS`).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)  # not cached: peft edits it
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    absent = [t for t in target_modules if t.rsplit(".", 1)[-1] not in present]
    if absent:
        raise ValueError(f"{model.config.model_type} has no module named {absent}")
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                        lora_dropout=0.0, init_lora_weights=False, **extra_config)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_embedding_A." in name:  # [r, in]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif ".lora_B." in name or ".lora_embedding_B." in name:  # [out, r]
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / math.sqrt(p.shape[1]))
    out = Path(out_dir)
    peft_model.save_pretrained(str(out), safe_serialization=safe_serialization)
    return out


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The folder's config.json as a dict (for tests that inspect what was written)."""
    return json.loads((Path(path) / "config.json").read_text())
