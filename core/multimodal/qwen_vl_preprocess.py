"""Qwen2-VL / Qwen2.5-VL image preprocessing with PIL and torch only (no torchvision).

transformers' `AutoProcessor` for a Qwen2.5-VL folder builds a video processor that needs
torchvision; this is the image half, equal pixel for pixel to transformers'
`Qwen2VLImageProcessorPil`: the image is converted to RGB (transparency composited onto white),
resized with PIL (bicubic by default) to the nearest size whose sides are multiples of
patch_size * merge_size and whose area lies in [min_pixels, max_pixels] (`smart_resize`),
rescaled (in float64, then float32) and normalised (float32), and cut into patches: one row
per patch of C * temporal_patch_size * patch_size^2 values (the still image repeated over the
temporal patch), the rows ordered by merge group (merge_size x merge_size neighbouring patches
consecutive), as the vision tower's patch merger expects.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["smart_resize", "preprocess_qwen2_5_vl_image", "num_image_tokens"]

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled (aspect kept as far as the rounding
    allows) so that the area lies within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image's aspect ratio must be below 200, got {max(height, width) / min(height, width)}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return h, w


def _to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _pixel_limits(config: dict[str, Any]) -> tuple[int, int]:
    size = config.get("size") or {}
    min_pixels = config.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
    max_pixels = config.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
    return int(min_pixels), int(max_pixels)


def preprocess_qwen2_5_vl_image(image: Image.Image, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One image -> {"pixel_values": [num_patches, C * temporal_patch * patch^2] fp32,
    "image_grid_thw": [1, 3] int64 (1, grid_h, grid_w) in patches}. `config` is the folder's
    preprocessor_config.json (defaults: Qwen2-VL's)."""
    patch = int(config.get("patch_size", 14))
    temporal = int(config.get("temporal_patch_size", 2))
    merge = int(config.get("merge_size", 2))
    if config.get("do_convert_rgb", True):
        image = _to_rgb(image)
    if config.get("do_resize", True):
        min_pixels, max_pixels = _pixel_limits(config)
        h, w = smart_resize(image.height, image.width, patch * merge, min_pixels, max_pixels)
        resample = Image.Resampling(int(config.get("resample", Image.Resampling.BICUBIC)))
        image = image.resize((w, h), resample=resample)
    pixels = torch.from_numpy(np.array(image))  # [H, W, C] (or [H, W] without RGB conversion)
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    x = pixels.permute(2, 0, 1)  # [C, H, W]
    if config.get("do_rescale", True):
        x = (x.double() * float(config.get("rescale_factor", 1 / 255))).float()
    else:
        x = x.float()
    if config.get("do_normalize", True):
        C = x.shape[0]
        mean = torch.tensor(_per_channel(config.get("image_mean", _CLIP_MEAN), C), dtype=torch.float32)[:, None, None]
        std = torch.tensor(_per_channel(config.get("image_std", _CLIP_STD), C), dtype=torch.float32)[:, None, None]
        x = (x - mean) / std
    C, H, W = x.shape
    if H % (patch * merge) or W % (patch * merge):
        raise ValueError(f"image of {H}x{W} pixels is not a multiple of patch_size * merge_size = {patch * merge}")
    gh, gw = H // patch, W // patch
    # [C, gh/m, m, p, gw/m, m, p] -> [gh/m, gw/m, m, m, C, p, p]: merge groups, then patches in a group
    x = x.reshape(C, gh // merge, merge, patch, gw // merge, merge, patch).permute(1, 4, 2, 5, 0, 3, 6)
    x = x.unsqueeze(5).expand(*x.shape[:5], temporal, patch, patch)  # the still image repeated over time
    pixel_values = x.reshape(gh * gw, C * temporal * patch * patch).contiguous()
    return {"pixel_values": pixel_values, "image_grid_thw": torch.tensor([[1, gh, gw]], dtype=torch.int64)}


def _per_channel(value: Any, channels: int) -> list[float]:
    values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)] * channels
    if len(values) != channels:
        raise ValueError(f"{len(values)} normalisation values for an image of {channels} channels")
    return values


def num_image_tokens(grid_thw: torch.Tensor | list[int] | tuple[int, ...], merge_size: int) -> int:
    """The image's placeholder tokens (= the vision tower's output rows): t * h * w / merge^2."""
    t, h, w = (int(v) for v in torch.as_tensor(grid_thw).reshape(-1)[:3].tolist())
    return t * h * w // (merge_size * merge_size)
