"""The correctness oracle: transformers' own fp32 greedy continuation and logits of a local
checkpoint (a tiny model's folder), with the model and the continuations remembered per
checkpoint for the process."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["hf_greedy", "hf_logits", "hf_model"]


@functools.lru_cache(maxsize=8)
def _load_hf(path: str, mtime: float) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def hf_model(path: str | os.PathLike) -> Any:
    """transformers' fp32 model of the checkpoint at `path`, in eval mode; loaded once per
    checkpoint (and its files' mtime) and shared: do not modify it."""
    p = Path(path)
    stamp = max(f.stat().st_mtime for f in p.iterdir())
    return _load_hf(str(p), stamp)


def hf_greedy(
    path: str | os.PathLike, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
    **generate_kwargs: Any,
) -> list[int]:
    """transformers' greedy continuation of `prompt_ids` (new tokens only), in fp32.

    EOS is ignored unless `eos_token_id` is given (then generation stops after emitting it).
    `generate_kwargs` go to `generate` (e.g. ``repetition_penalty``). Results are remembered per
    checkpoint (and its files' mtime) for the process: the parity tests ask for the same prompts'
    continuations many times (each block size, budget and cache setting), and transformers'
    generate is most of their time.
    """
    p = Path(path)
    stamp = max(f.stat().st_mtime for f in p.iterdir())
    try:
        key = (str(p), stamp, tuple(prompt_ids), max_new_tokens, eos_token_id, tuple(sorted(generate_kwargs.items())))
        hash(key)
    except TypeError:  # an unhashable generate kwarg: not remembered
        return _hf_greedy(p, prompt_ids, max_new_tokens, eos_token_id, **generate_kwargs)
    if key not in _HF_GREEDY:
        if len(_HF_GREEDY) >= 4096:
            _HF_GREEDY.clear()
        _HF_GREEDY[key] = tuple(_hf_greedy(p, prompt_ids, max_new_tokens, eos_token_id, **generate_kwargs))
    return list(_HF_GREEDY[key])


_HF_GREEDY: dict[tuple[Any, ...], tuple[int, ...]] = {}


@torch.no_grad()
def _hf_greedy(
    path: Path, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None, **generate_kwargs: Any
) -> list[int]:
    model = hf_model(path)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
        temperature=None,
        top_p=None,
        top_k=None,
        **generate_kwargs,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def hf_logits(path: str | os.PathLike, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [len(prompt_ids), vocab] for a single prompt."""
    model = hf_model(path)
    return model(torch.tensor([prompt_ids], dtype=torch.long)).logits[0].float()
