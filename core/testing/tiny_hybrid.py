"""Tiny random-weight hybrid models (attention beside linear-attention, state-space or short
convolution layers) for tests: any transformers config class, the tiny tokenizer, weights drawn
by transformers then re-drawn wider (`widen_init`), saved as a Hugging Face folder.

`make_tiny_hybrid(path, "Qwen3NextConfig", "Qwen3NextForCausalLM", hidden_size=64, ...)`: the
config's keyword arguments are the test's (each test varies heads, state sizes and where the
attention layers sit); vocabulary, ids and fp32 are filled in here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from portside.testing.tiny import widen_init
from portside.testing.tiny_tokenizer import CHATML_TEMPLATE, make_tiny_tokenizer

__all__ = ["REAL_SHAPED", "make_tiny_hybrid", "write_real_shaped_config"]

# 24-layer configs with real checkpoints' layer shapes (no weights: for the KV budget report), each
# as a hybrid (18 recurrent layers, attention every 4th) or with attention in every layer.
REAL_SHAPED: dict[str, tuple[str, str, dict[str, Any], tuple[str, str]]] = {
    # Qwen3-Next-80B-A3B's layer shapes (dense MLP: the experts do not change the cache)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=0, intermediate_size=5120), ("linear_attention", "full_attention")),
    # Granite 4.0-H-Tiny's
    "granite_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=100352, hidden_size=1536, num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4,
        mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        num_local_experts=0, shared_intermediate_size=4096, position_embedding_type="nope"), ("mamba", "attention")),
}


def make_tiny_hybrid(
    path: str | os.PathLike,
    config_class: str,
    architecture: str,
    *,
    seed: int = 0,
    init_std: float = 0.25,
    post_init: Callable[[torch.nn.Module], None] | None = None,
    **config_kwargs: Any,
) -> Path:
    """Write the folder and return it. `post_init(model)` may adjust the re-drawn weights
    (a state-space layer's A_log, dt_bias and D want their own ranges)."""
    import transformers
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tok = make_tiny_tokenizer(path, chat_template=CHATML_TEMPLATE)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    kwargs: dict[str, Any] = dict(vocab_size=len(tok), eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
                                  tie_word_embeddings=False)
    kwargs.update(config_kwargs)
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen_init(model, init_std, seed)
    if post_init is not None:
        with torch.no_grad():
            post_init(model)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def write_real_shaped_config(path: str | os.PathLike, family: str, hybrid: bool) -> Path:
    """config.json of `REAL_SHAPED[family]`: 18 recurrent layers and 6 attention layers (`hybrid`),
    else 24 attention layers."""
    import transformers

    config_class, architecture, kwargs, (recurrent, attention) = REAL_SHAPED[family]
    types = ([recurrent] * 3 + [attention]) * 6 if hybrid else [attention] * 24
    config = getattr(transformers, config_class)(layer_types=types, **kwargs)
    config.architectures = [architecture]
    config.save_pretrained(str(path))
    return Path(path)
