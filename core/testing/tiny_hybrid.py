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

__all__ = ["make_tiny_hybrid"]


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
