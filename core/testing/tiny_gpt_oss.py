"""Tiny random-weight gpt-oss models for tests: transformers' own `GptOssConfig` and
`GptOssForCausalLM` (weights drawn by transformers, then re-drawn wider with `widen_init`, the
attention sinks spread so that they matter), saved as a Hugging Face folder.

`make_tiny_gpt_oss(path)`: hidden 64, 4 layers alternating a sliding window (8 tokens) and full
attention, 4 query / 2 KV heads of 16, 8 experts of 32 (top-2), YaRN rotary as the released
checkpoints have it (truncate False), the tiny tokenizer's vocabulary; any `GptOssConfig` field
can be overridden. With `tokenizer_dir` (a folder holding a tokenizer, e.g. one with the real
o200k_harmony vocabulary) that tokenizer is copied in and the vocabulary is 201088, the
released models'.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from portside.testing.tiny import widen_init
from portside.testing.tiny_tokenizer import CHATML_TEMPLATE, make_tiny_tokenizer

__all__ = ["GPT_OSS_VOCAB", "make_tiny_gpt_oss"]

GPT_OSS_VOCAB = 201088  # the released checkpoints' vocabulary (o200k_harmony, padded)
# the released generation_config's eos ids, by name: <|return|> 200002, <|endoftext|> 199999, <|call|> 200012
_HARMONY_EOS = ("<|return|>", "<|endoftext|>", "<|call|>")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


def _tiny_config(vocab_size: int, eos_id: int | list[int] | None, pad_id: int | None, overrides: dict[str, Any]) -> Any:
    from transformers import GptOssConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=1024,
        # the released models' YaRN, over a shorter original context so that tiny prompts reach its ramp
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
        swiglu_limit=7.0,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    kwargs.update(overrides)
    config = GptOssConfig(**kwargs)
    config.architectures = ["GptOssForCausalLM"]
    return config


def make_tiny_gpt_oss(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    init_std: float = 0.25,
    sink_std: float = 1.0,
    tokenizer_dir: str | os.PathLike | None = None,
    **config_overrides: Any,
) -> Path:
    """Write the folder at `path` and return it. `config_overrides` go to `GptOssConfig` (e.g.
    ``num_local_experts=16``, ``num_experts_per_tok=4``, ``sliding_window=4``,
    ``layer_types=[...]``). The sinks are drawn N(0, `sink_std`) (transformers' 0.02 would make
    them ~0, where a sink still takes a share of every softmax but never varies by head).
    `tokenizer_dir`: copy that folder's tokenizer in, vocabulary `GPT_OSS_VOCAB` unless overridden,
    eos ids those of the released models (<|return|>, <|endoftext|>, <|call|>, where the
    tokenizer has them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tok = make_tiny_tokenizer(path, chat_template=CHATML_TEMPLATE)
        vocab: int = len(tok)
        eos_id: int | list[int] | None = tok.convert_tokens_to_ids("<|im_end|>")
        pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    else:
        src = Path(tokenizer_dir)
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, path / name)
        tok = AutoTokenizer.from_pretrained(str(src))
        if len(tok) > GPT_OSS_VOCAB:
            raise ValueError(f"{src}: the tokenizer has {len(tok)} tokens, more than gpt-oss's {GPT_OSS_VOCAB}")
        vocab = GPT_OSS_VOCAB
        known = tok.get_vocab()
        eos_id = [known[name] for name in _HARMONY_EOS if name in known] or tok.eos_token_id
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else known.get("<|endoftext|>")
    config = _tiny_config(vocab, eos_id, pad_id, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen_init(model, init_std, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(sink_std * torch.randn(sinks.shape, generator=gen))
    model.save_pretrained(str(path), safe_serialization=True)
    return path
