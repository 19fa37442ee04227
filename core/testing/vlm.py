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
    try:
        return model, transformers.AutoProcessor.from_pretrained(path)
    except ImportError:  # Qwen2.5-VL's processor needs torchvision (its video half): the image half alone
        return model, _QwenImageProcessor(transformers.AutoImageProcessor.from_pretrained(path),
                                          transformers.AutoTokenizer.from_pretrained(path), config.image_token_id)


class _QwenImageProcessor:
    """What Qwen2_5_VLProcessor does for text and images: transformers' (PIL) image processor,
    and each image's one `<|image_pad|>` expanded to grid_t * grid_h * grid_w / merge^2 of them."""

    def __init__(self, image_processor: Any, tokenizer: Any, image_token_id: int) -> None:
        self.image_processor, self.tokenizer, self.image_token_id = image_processor, tokenizer, image_token_id

    def __call__(self, text: list[str], images: list[Any] | None = None, return_tensors: str = "pt", **kw: Any) -> Any:
        pad = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        out: dict[str, Any] = {}
        if images:
            out = dict(self.image_processor(images=images, return_tensors="pt"))
            counts = iter((out["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist())
            text = [t.split(pad)[0] + "".join(pad * next(counts) + rest for rest in t.split(pad)[1:]) for t in text]
        enc = dict(self.tokenizer(text, return_tensors="pt", **kw))
        enc["mm_token_type_ids"] = (enc["input_ids"] == self.image_token_id).int()  # 1: image (the model's 3-D positions)
        return {**enc, **out}


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
