"""Test helpers for vision-language models: deterministic test images and transformers' greedy
continuation of a prompt with images (the oracle portside's output must equal)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = ["make_image", "hf_vlm_greedy"]


def make_image(seed: int, size: tuple[int, int], mode: str = "RGB") -> Any:
    """A PIL image of `size` (width, height) with seeded random pixels plus a gradient, so
    resizing and tiling see structure, not only noise."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    w, h = size
    noise = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.int32)
    ramp = (torch.arange(w)[None, :, None] * 255 // max(1, w - 1)).expand(h, w, 3)
    pixels = ((noise + ramp) // 2).to(torch.uint8).numpy()
    return Image.fromarray(pixels, "RGB").convert(mode)


@lru_cache(maxsize=4)
def _hf(path: str, stamp: float) -> tuple[Any, Any]:
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, config.architectures[0])
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    return model, transformers.AutoProcessor.from_pretrained(path)


def hf_model_and_processor(path: str | os.PathLike) -> tuple[Any, Any]:
    p = Path(path)
    return _hf(str(p), max(f.stat().st_mtime for f in p.iterdir()))


@torch.no_grad()
def hf_vlm_greedy(path: str | os.PathLike, text: str, images: list[Any], max_new_tokens: int) -> list[int]:
    """transformers' greedy new tokens for `text` (one image placeholder per image, as the chat
    template writes it) and `images`, through the folder's own processor; EOS ignored."""
    model, processor = hf_model_and_processor(path)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
