"""Pooling inputs: sentence-transformers prompts (instructions) put before a text, the (query,
document) pairs of scoring and reranking, each pair tokenized together as the tokenizer encodes a
text pair (with its `token_type_ids` for a model that takes them: BERT-style cross-encoders), and
`truncate_prompt_tokens`."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from portside.config import PoolerConfig


def as_prompt_list(prompts: Any) -> list[Any]:
    """`LLM`'s prompts argument as a list: one text, token-id list or prompt dict, or a list of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one tokenized prompt
    return items


def resolve_prompt(pooler: PoolerConfig, prompt: str | None = None, prompt_name: str | None = None) -> str:
    """The text put before every input: `prompt`, else the folder's prompt `prompt_name`, else its
    `default_prompt_name`'s, else none (as sentence-transformers' encode)."""
    prompts = dict(pooler.prompts)
    if prompt is None and prompt_name is not None:
        if prompt_name not in prompts:
            raise ValueError(f"prompt_name: {prompt_name!r} is not one of this model's prompts "
                             f"({', '.join(sorted(prompts)) or 'it has none'}; config_sentence_transformers.json)")
        prompt = prompts[prompt_name]
    elif prompt is None and pooler.default_prompt_name:
        prompt = prompts.get(pooler.default_prompt_name)
    if prompt and not pooler.include_prompt:
        raise ValueError("this model's Pooling excludes the prompt's tokens (include_prompt false), which portside "
                         "does not do; leave the prompt out")
    return prompt or ""


def with_prompt(prompt: str, item: Any) -> Any:
    """`item` (text, token ids, or a prompt dict) with `prompt` before its text; token ids as they are."""
    if not prompt:
        return item
    if isinstance(item, str):
        return prompt + item
    if isinstance(item, dict) and isinstance(item.get("prompt"), str) and "prompt_token_ids" not in item:
        return {**item, "prompt": prompt + item["prompt"]}
    return item


def score_pairs(text_1: Any, text_2: Any, names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of a list, or two lists of the same length, zipped."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, items in zip(names, (first, second)):
        if not items:
            raise ValueError(f"{name}: is empty; give at least one text")
        for i, t in enumerate(items):
            if not isinstance(t, str):
                raise ValueError(f"{name}[{i}]: must be a string, got {type(t).__name__}")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one {names[0]}, or "
                         "as many as there are in the other")
    return list(zip(first, second))


@functools.cache
def takes_token_types(model_path: str) -> bool:
    """Whether the model has token-type (segment) embeddings: an encoder with type_vocab_size > 0."""
    from portside.model.registry import architecture_needs

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    arch = (cfg.get("architectures") or [""])[0]
    return "bidirectional" in architecture_needs(arch) and int(cfg.get("type_vocab_size") or 0) > 0


def pair_prompt(tokenizer: Any, model_path: str, first: str, second: str, truncate: int | None,
                max_model_len: int) -> dict[str, Any]:
    """A text pair as one engine prompt: {"prompt_token_ids", "token_type_ids" where the model
    takes them}; `truncate` (truncate_prompt_tokens): at most that many tokens, the longer text
    cut first (the tokenizer's longest_first)."""
    kwargs: dict[str, Any] = {"truncation": True, "max_length": truncate} if truncate else {}
    enc = tokenizer(first, second, **kwargs)
    out: dict[str, Any] = {"prompt_token_ids": list(enc["input_ids"])}
    types = enc.get("token_type_ids")
    if types is not None and takes_token_types(os.fspath(model_path)):
        out["token_type_ids"] = list(types)
    if len(out["prompt_token_ids"]) > max_model_len:
        raise ValueError(f"the pair is {len(out['prompt_token_ids'])} tokens, more than max_model_len {max_model_len}; "
                         "shorten it or set truncate_prompt_tokens")
    return out


def truncate_ids(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """A prompt's last `k` tokens (-1: the last max_model_len; None: all)."""
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k < 1:
        raise ValueError(f"truncate_prompt_tokens: must be -1 or at least 1, got {k}")
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: {k} is more than max_model_len {max_model_len}")
    return ids[-k:]
