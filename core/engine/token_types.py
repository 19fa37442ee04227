"""A prompt's ``token_type_ids`` (BERT's segment ids: 0 for the first text of a pair, 1 for the
second), validated against the prompt and the model: only an encoder-only model with token-type
embeddings takes them, one per prompt token, each below the checkpoint's ``type_vocab_size``."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from portside.model.registry import architecture_needs

__all__ = ["token_type_ids"]


@functools.cache
def _type_vocab_size(model_path: str) -> int:
    """The model's number of token types; 0 where it takes none (a decoder, ModernBERT)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return 0
    arch = (cfg.get("architectures") or [""])[0]
    if "bidirectional" not in architecture_needs(arch):
        return 0
    return int(cfg.get("type_vocab_size") or 0)


def token_type_ids(prompt: Any, prompt_ids: list[int], model_path: str) -> list[int] | None:
    """The prompt dict's "token_type_ids" checked (None where it has none); ValueError naming
    the field for a value the model cannot take."""
    if not isinstance(prompt, dict) or prompt.get("token_type_ids") is None:
        return None
    value = prompt["token_type_ids"]
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"token_type_ids must be a list of integers, got {type(value).__name__}")
    if len(value) != len(prompt_ids):
        raise ValueError(f"token_type_ids has {len(value)} entries for a prompt of {len(prompt_ids)} tokens; "
                         "give one per prompt token")
    limit = _type_vocab_size(os.fspath(model_path))
    if limit == 0:
        raise ValueError("token_type_ids: this model takes no token types (only encoder models with segment "
                         "embeddings, such as BERT, do); drop the field")
    bad = [t for t in value if not 0 <= t < limit]
    if bad:
        raise ValueError(f"token_type_ids: {bad[0]} is out of range; this model has {limit} token types (0 to {limit - 1})")
    return list(value)
