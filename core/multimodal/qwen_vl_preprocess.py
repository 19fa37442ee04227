"""Qwen2-VL / Qwen2.5-VL image preprocessing with PIL and torch only (torchvision not needed).

transformers has two image processors for these models and `AutoImageProcessor` picks one by
what is installed: `Qwen2VLImageProcessor` (torchvision backend) when torchvision is, else
`Qwen2VLImageProcessorPil`. The model's own `Qwen2_5_VLProcessor` builds a video processor that
needs torchvision, so whoever runs transformers' whole Qwen2.5-VL pipeline (and vLLM, which
depends on torchvision) gets the torchvision one. The two resize differently (torch's
antialiased interpolation of the uint8 image against PIL's `Image.resize`: up to ~0.07 apart
after normalisation, enough to change greedy tokens), so portside does what transformers would
pick here (`default_backend`), each equal pixel for pixel to its transformers counterpart:

- both: the image converted to RGB (transparency composited onto white), its size rounded to
  multiples of patch_size * merge_size with the area in [min_pixels, max_pixels]
  (`smart_resize`), resampled (bicubic by default) only when that changes it, rescaled and
  normalised, cut into patches: one row per patch of C * temporal_patch_size * patch_size^2
  values (the still image repeated over the temporal patch), rows ordered by merge group
  (merge_size x merge_size neighbouring patches consecutive), as the patch merger expects;
- ``"torchvision"``: `torch.nn.functional.interpolate` on the uint8 [1, C, H, W] image (align
  corners off, antialiased), as torchvision's `resize` does on a CPU, then 1/255 folded into
  the mean and std (x - 255 * mean) / (255 * std) in float32, as transformers' fused
  rescale-and-normalise;
- ``"pil"``: PIL's `Image.resize`, then rescaling in float64 rounded to float32 and
  normalisation in float32.
"""

from __future__ import annotations

import math
import platform
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["BACKENDS", "default_backend", "smart_resize", "preprocess_qwen2_5_vl_image", "num_image_tokens"]

BACKENDS = ("torchvision", "pil")
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# PIL resample codes the torchvision backend takes (transformers' pil_torch_interpolation_mapping):
# NEAREST -> nearest-exact, BILINEAR, BICUBIC
_TORCH_MODES = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}


def default_backend() -> str:
    """The image processor transformers' `AutoImageProcessor` picks in this environment:
    "torchvision" when torchvision is installed, else "pil"."""
    from transformers.utils import is_torchvision_available

    return "torchvision" if is_torchvision_available() else "pil"


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


def _target_size(height: int, width: int, config: dict[str, Any], factor: int) -> tuple[int, int]:
    min_pixels, max_pixels = _pixel_limits(config)
    return smart_resize(height, width, factor, min_pixels, max_pixels)


def _norm_stats(config: dict[str, Any], channels: int) -> tuple[list[float], list[float]]:
    return (_per_channel(config.get("image_mean", _CLIP_MEAN), channels),
            _per_channel(config.get("image_std", _CLIP_STD), channels))


def _pil_pixels(image: Image.Image, config: dict[str, Any], factor: int) -> torch.Tensor:
    """[C, H, W] float32 as `Qwen2VLImageProcessorPil`."""
    if config.get("do_resize", True):
        h, w = _target_size(image.height, image.width, config, factor)
        resample = Image.Resampling(int(config.get("resample", Image.Resampling.BICUBIC)))
        image = image.resize((w, h), resample=resample)
    pixels = torch.from_numpy(np.array(image))  # [H, W, C] (or [H, W] without RGB conversion)
    x = (pixels[..., None] if pixels.ndim == 2 else pixels).permute(2, 0, 1)  # [C, H, W]
    if config.get("do_rescale", True):
        x = (x.double() * float(config.get("rescale_factor", 1 / 255))).float()
    else:
        x = x.float()
    if config.get("do_normalize", True):
        mean, std = (torch.tensor(v, dtype=torch.float32)[:, None, None] for v in _norm_stats(config, x.shape[0]))
        x = (x - mean) / std
    return x


def _torch_resize(x: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """uint8 [1, C, H, W] resized as torchvision's `resize(..., antialias=True)` does on a CPU."""
    mode = _TORCH_MODES.get(resample)
    if mode is None:
        raise ValueError(f"preprocessor_config.json resample={resample}: transformers' torchvision image processor "
                         f"(which portside follows here) takes {sorted(_TORCH_MODES)} (nearest, bilinear, bicubic)")
    if mode == "nearest-exact":
        return torch.nn.functional.interpolate(x, size=list(size), mode=mode)
    # torchvision interpolates uint8 directly, except bilinear on x86 CPUs without AVX2, which go
    # through float32 and round back
    native = mode == "bicubic" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") \
        or platform.machine() in ("aarch64", "arm64")
    y = torch.nn.functional.interpolate(x if native else x.float(), size=list(size), mode=mode,
                                        align_corners=False, antialias=True)
    return y if native else y.round_().to(torch.uint8)


def _torch_pixels(image: Image.Image, config: dict[str, Any], factor: int) -> torch.Tensor:
    """[C, H, W] float32 as `Qwen2VLImageProcessor` (torchvision backend)."""
    pixels = torch.from_numpy(np.array(image))
    x = (pixels[None] if pixels.ndim == 2 else pixels.permute(2, 0, 1)).contiguous()  # uint8 [C, H, W]
    if config.get("do_resize", True):
        h, w = _target_size(x.shape[1], x.shape[2], config, factor)
        if (h, w) != (x.shape[1], x.shape[2]):
            x = _torch_resize(x[None], (h, w), int(config.get("resample", Image.Resampling.BICUBIC)))[0]
    rescale, normalize = config.get("do_rescale", True), config.get("do_normalize", True)
    scale = float(config.get("rescale_factor", 1 / 255))
    if normalize:
        mean, std = (torch.tensor(v, dtype=torch.float32) for v in _norm_stats(config, x.shape[0]))
        if rescale:  # transformers folds the rescale into the statistics
            mean, std = mean * (1.0 / scale), std * (1.0 / scale)
        return (x.float() - mean[:, None, None]) / std[:, None, None]
    return x * scale if rescale else x.float()


def preprocess_qwen2_5_vl_image(image: Image.Image, config: dict[str, Any], backend: str | None = None) -> dict[str, torch.Tensor]:
    """One image -> {"pixel_values": [num_patches, C * temporal_patch * patch^2] fp32,
    "image_grid_thw": [1, 3] int64 (1, grid_h, grid_w) in patches}. `config` is the folder's
    preprocessor_config.json (defaults: Qwen2-VL's); `backend` which of transformers' image
    processors to equal, "torchvision" or "pil" (default: `default_backend()`)."""
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"image backend {backend!r}: use one of {list(BACKENDS)}")
    patch = int(config.get("patch_size", 14))
    temporal = int(config.get("temporal_patch_size", 2))
    merge = int(config.get("merge_size", 2))
    if config.get("do_convert_rgb", True):
        image = _to_rgb(image)
    x = (_torch_pixels if backend == "torchvision" else _pil_pixels)(image, config, patch * merge)
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
