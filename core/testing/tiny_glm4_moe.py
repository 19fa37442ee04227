"""Tiny random-weight GLM-4.5 models for tests: transformers' own `Glm4MoeConfig` and
`Glm4MoeForCausalLM` (weights drawn by transformers, re-drawn wider with `widen_init`; the
routers' e_score_correction_bias drawn too, so that it changes some choices), saved as a Hugging
Face folder, with the multi-token-prediction layers' tensors a GLM-4.5 checkpoint carries
(``model.layers.{num_hidden_layers + i}.*``, which transformers does not build) appended.

`make_tiny_glm4_moe(path)`: hidden 64, 3 layers (the first dense), 4 query / 2 KV heads of 16,
rotary on half of each head, q/k/v biases, q/k norms, 8 routed experts of 32 in 2 groups (top-2
within the best group) and one shared expert, norm_topk_prob, routed_scaling_factor 1.5, one MTP
layer, the tiny tokenizer's vocabulary; any `Glm4MoeConfig` field can be overridden.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from portside.testing.tiny import widen_init
from portside.testing.tiny_tokenizer import CHATML_TEMPLATE, make_tiny_tokenizer

__all__ = ["make_tiny_glm4_moe"]


def _tiny_config(vocab_size: int, eos_id: int, pad_id: int, overrides: dict[str, Any]) -> Any:
    from transformers import Glm4MoeConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        num_nextn_predict_layers=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    kwargs.update(overrides)
    config = Glm4MoeConfig(**kwargs)
    config.architectures = ["Glm4MoeForCausalLM"]
    return config


def _mtp_tensors(cfg: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GLM-4.5's MTP layer j: a decoder layer (the last one's tensors, perturbed) under
    ``model.layers.{L + j}``, with ``eh_proj`` [hidden, 2 hidden], ``enorm``, ``hnorm`` and
    ``shared_head.norm`` / ``shared_head.head``."""
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    gen = torch.Generator().manual_seed(n * 7 + h)
    out: dict[str, torch.Tensor] = {}
    last = f"model.layers.{n - 1}."
    for j in range(int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)):
        prefix = f"model.layers.{n + j}."
        for name, t in state.items():
            if name.startswith(last):
                out[prefix + name.removeprefix(last)] = t + 0.01 * torch.randn(t.shape, generator=gen)
        out[prefix + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            out[prefix + f"{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
        out[prefix + "shared_head.head.weight"] = 0.1 * torch.randn(cfg.vocab_size, h, generator=gen)
    return out


def make_tiny_glm4_moe(path: str | os.PathLike, *, seed: int = 0, init_std: float = 0.25, bias_std: float = 0.1,
                       **config_overrides: Any) -> Path:  # fmt: skip
    """Write the folder at `path` and return it. `config_overrides` go to `Glm4MoeConfig` (e.g.
    ``n_routed_experts=16``, ``n_group=4``, ``use_qk_norm=False``, ``num_nextn_predict_layers=0``).
    The routers' correction biases are drawn N(0, `bias_std`)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tok = make_tiny_tokenizer(path, chat_template=CHATML_TEMPLATE)
    eos_id, pad_id = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    config = _tiny_config(len(tok), eos_id, pad_id, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen_init(model, init_std, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(bias_std * torch.randn(buf.shape, generator=gen))
    model.save_pretrained(str(path), safe_serialization=True)
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise RuntimeError(f"{path}: expected one safetensors file, found {len(files)}")
    state = load_file(files[0])
    state.update(_mtp_tensors(config, state))
    save_file(state, files[0], metadata={"format": "pt"})
    return path
