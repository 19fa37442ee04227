"""Qwen2.5-VL: a Qwen2 language model with 3-D rotary ("mrope", `portside.model.rotary.MRotaryEmbedding`)
and Qwen2.5-VL's vision transformer (`portside.model.vision.qwen2_5_vit`).

An image becomes t * h * w / merge^2 `<|image_pad|>` tokens (grid (t, h, w) in patches), whose
embeddings are the vision tower's rows (`embed_image`). Positions are [3, T] (temporal, height,
width): a text token has its running position in all three; an image's tokens have their
(t, h, w) index in the merged grid plus the position where the image starts, and the text after
it continues from there plus the grid's larger side (`mrope_positions`, transformers'
`get_rope_index` for images).

Checkpoints name the language model `model.*` (or `model.language_model.*`, transformers 5's
own layout) and the vision tower `visual.*` (or `model.visual.*`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from portside.contract import EncoderAttention
from portside.model.args import ModelArgs
from portside.model.decoder import DecoderForCausalLM
from portside.model.vision.qwen2_5_vit import Qwen2_5_VisionTransformer
from portside.multimodal.inputs import MultiModalFeature

__all__ = ["Qwen2_5_VLForConditionalGeneration"]


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


class Qwen2_5_VLForConditionalGeneration(DecoderForCausalLM):
    supports_multimodal: ClassVar[bool] = True
    uses_mrope: ClassVar[bool] = True
    renames = (("model.language_model.", "model."), ("model.visual.", "visual."))

    def __init__(self, args: ModelArgs, *rest: Any, **kwargs: Any) -> None:  # DecoderForCausalLM's arguments
        super().__init__(args, *rest, **kwargs)
        hf = args.hf_config
        if hf is None or _get(hf, "vision_config") is None:
            raise ValueError("Qwen2_5_VLForConditionalGeneration needs the whole transformers config (args.hf_config)")
        if not args.mrope_section:
            raise ValueError("a Qwen2.5-VL config must have rope_parameters.mrope_section")
        vision = _get(hf, "vision_config")
        self.image_token_id = int(_get(hf, "image_token_id"))
        video = _get(hf, "video_token_id")
        self.video_token_id = int(video) if video is not None else None
        self.spatial_merge_size = int(_get(vision, "spatial_merge_size", 2))
        # the vision tower runs where the tokens are embedded: the first pipeline stage
        self.visual = Qwen2_5_VisionTransformer(vision, self.dtype) if self.stage.is_first else None

    # ---- images ---------------------------------------------------------------------------

    def embed_image(self, data: dict[str, torch.Tensor], attention: EncoderAttention) -> torch.Tensor:
        """One image's processor output {"pixel_values": [patches, C * t * p * p], "image_grid_thw":
        [1, 3]} -> its placeholder rows [t * h * w / merge^2, hidden] in the model's dtype."""
        assert self.visual is not None, "only the first pipeline stage embeds images"
        param = next(self.visual.parameters())
        pixels = data["pixel_values"].to(param.device)
        grid = data["image_grid_thw"].reshape(-1, 3)
        return self.visual(pixels, grid, attention).to(self.dtype)

    def embed_images(self, datas: list[dict[str, torch.Tensor]], attention: EncoderAttention) -> list[torch.Tensor]:
        """`embed_image` of several images in one vision-tower call (each image its own sequences)."""
        merged = self.embed_image({"pixel_values": torch.cat([d["pixel_values"] for d in datas]),
                                   "image_grid_thw": torch.cat([d["image_grid_thw"].reshape(-1, 3) for d in datas])}, attention)
        rows = [int(d["image_grid_thw"].prod()) // self.visual.merge**2 for d in datas]  # type: ignore[union-attr]
        return list(merged.split(rows))

    def mrope_positions(self, prompt_token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        """-> (positions [3, len(prompt)] int64, delta): a later token at index i has position
        i + delta in all three. Images are the features' placeholder ranges (each a run of image
        tokens, t * h * w / merge^2 long); video tokens are not supported."""
        P = len(prompt_token_ids)
        if self.video_token_id is not None and self.video_token_id in prompt_token_ids:
            raise ValueError("Qwen2.5-VL video inputs are not supported by portside: the prompt has video tokens")
        m = self.spatial_merge_size
        images = sorted((f for f in features if f.modality == "image"), key=lambda f: f.placeholder.offset)
        image_tokens = sum(1 for t in prompt_token_ids if t == self.image_token_id)
        if image_tokens != sum(f.placeholder.length for f in images):
            raise ValueError(f"the prompt has {image_tokens} image tokens, its images "
                             f"{sum(f.placeholder.length for f in images)} placeholder rows")
        parts: list[torch.Tensor] = []
        index = pos = 0  # prompt index, next text position
        for f in images:
            start, length = f.placeholder.offset, f.placeholder.length
            if start < index or start + length > P:
                raise ValueError(f"image placeholder {f.placeholder} overlaps another or the prompt's end ({P})")
            if any(t != self.image_token_id for t in prompt_token_ids[start : start + length]):
                raise ValueError(f"image placeholder {f.placeholder} covers tokens that are not the image token")
            if start > index:  # text before the image
                parts.append(torch.arange(pos, pos + start - index).expand(3, -1))
                pos += start - index
            t, h, w = (int(v) for v in f.data["image_grid_thw"].reshape(-1)[:3].tolist())
            gt, gh, gw = t, h // m, w // m
            if gt * gh * gw != length:
                raise ValueError(f"image grid {(t, h, w)} (merge {m}) has {gt * gh * gw} rows, "
                                 f"its placeholder {length} tokens")
            grid = torch.stack(torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij"))
            parts.append(grid.reshape(3, -1) + pos)
            pos += max(gh, gw)
            index = start + length
        if index < P:
            parts.append(torch.arange(pos, pos + P - index).expand(3, -1))
        if not parts:
            return torch.zeros(3, 0, dtype=torch.int64), 0
        positions = torch.cat(parts, dim=1).to(torch.int64).contiguous()
        return positions, int(positions.max()) + 1 - P

    # ---- loading ----------------------------------------------------------------------------

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, object, torch.Tensor]]:
        for old, new in self.renames:
            if name.startswith(old):
                name = new + name[len(old):]
        if name.startswith("visual."):  # the vision tower keeps the checkpoint's (unfused) layout
            yield name, None, tensor
            return
        yield from super().checkpoint_tensors(name, tensor)

    def _other_stage(self, target: str) -> bool:
        if target.startswith("visual."):
            return self.visual is None
        return super()._other_stage(target)
