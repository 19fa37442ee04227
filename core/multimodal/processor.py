"""A vision-language model's prompt processing: text or token ids plus images -> the token ids
the model sees (each image's placeholder expanded to its embedding rows) and one
`MultiModalFeature` per image.

The prompt names each image with one placeholder, as the model's chat template writes it
(LLaVA `<image>`, Qwen2.5-VL `<|image_pad|>` between `<|vision_start|>` and `<|vision_end|>`);
the i-th placeholder is the i-th image. Each image goes through the folder's Hugging Face
processor on its own (`AutoProcessor`: the image processor transformers picks, its PIL one
where torchvision is not installed), which also says how many placeholder tokens it expands
to; the prompt's placeholders are expanded here, so text and token-id prompts are treated
alike and equal what the HF processor gives for the whole prompt. Qwen2.5-VL's images go
through portside's own preprocessing (`qwen_vl_preprocess`), as transformers' processor for it
needs torchvision; it equals the image processor transformers picks in the same environment
(torchvision's resize where torchvision is installed, PIL's otherwise).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from portside.config import MultiModalConfig
from portside.multimodal.inputs import MultiModalFeature, PlaceholderRange, content_hash

logger = logging.getLogger(__name__)

__all__ = ["MultiModalProcessor", "ProcessedPrompt", "image_list"]

# what a processor returns per image that the model's embed_image reads
_IMAGE_KEYS = ("pixel_values", "image_sizes", "image_grid_thw")
_QWEN_VL = ("qwen2_vl", "qwen2_5_vl")


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    prompt: str | None  # the text shown in outputs (None for a token-id prompt)
    mm_features: list[MultiModalFeature]


def image_list(value: Any) -> list[Any]:
    """`multi_modal_data["image"]`: one PIL image or a list of them."""
    from PIL import Image

    images = value if isinstance(value, (list, tuple)) else [value]
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise ValueError(f"multi_modal_data['image'][{i}] is a {type(im).__name__}; pass PIL.Image.Image objects")
    return list(images)


class MultiModalProcessor:
    """Built once per engine from the model folder (tokenizer and processor files)."""

    def __init__(self, folder: str | Path, hf_config: Any, tokenizer: Any, config: MultiModalConfig) -> None:
        from transformers import AutoProcessor

        self.config = config
        self.tokenizer = tokenizer
        token_id = getattr(hf_config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(hf_config, "image_token_index", None)
        if token_id is None:
            raise ValueError(f"{folder}: config.json names no image token (image_token_id / image_token_index)")
        self.image_token_id = int(token_id)
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.hf_processor: Any = None
        self.qwen_config: dict[str, Any] | None = None
        if getattr(hf_config, "model_type", "") in _QWEN_VL:
            # transformers' Qwen2.5-VL processor needs torchvision (its video half): portside's own
            # image preprocessing, equal to the image processor transformers picks here
            # (`qwen_vl_preprocess`: its torchvision one when torchvision is installed, else its PIL one)
            from portside.multimodal.qwen_vl_preprocess import default_backend

            config_file = Path(folder) / "preprocessor_config.json"
            if not config_file.is_file():
                raise ValueError(f"{folder}: a vision-language model folder needs its preprocessor_config.json")
            self.qwen_config = json.loads(config_file.read_text())
            self.qwen_backend = default_backend()
            logger.info("Qwen2.5-VL images: resized as transformers' %s image processor does", self.qwen_backend)
            return
        try:
            self.hf_processor = AutoProcessor.from_pretrained(str(folder))
        except Exception as e:  # a folder without processor files: say what is missing
            raise ValueError(f"{folder}: cannot load the model's image processor ({type(e).__name__}: {e}); a "
                             "vision-language model folder needs its preprocessor_config.json") from None
        # an image alone, as the processor expands it (special tokens around it are not counted)
        self._probe = getattr(self.hf_processor, "image_token", None) or self.image_token

    def process_image(self, image: Any) -> tuple[dict[str, torch.Tensor], int]:
        """One image -> (its processor tensors, batch dimension kept; its placeholder tokens)."""
        if self.qwen_config is not None:
            from portside.multimodal.qwen_vl_preprocess import num_image_tokens, preprocess_qwen2_5_vl_image

            data = preprocess_qwen2_5_vl_image(image, self.qwen_config, self.qwen_backend)
            return data, num_image_tokens(data["image_grid_thw"], int(self.qwen_config.get("merge_size", 2)))
        out = self.hf_processor(text=[self._probe], images=[image], return_tensors="pt")
        data = {k: out[k] for k in _IMAGE_KEYS if k in out}
        n = int((out["input_ids"] == self.image_token_id).sum())
        if n == 0 or "pixel_values" not in data:
            raise ValueError("the model's processor produced no image tokens for an image")
        return data, n

    def process(self, prompt: str | list[int], images: list[Any], add_special_tokens: bool = True) -> ProcessedPrompt:
        limit = self.config.limit("image")
        if len(images) > limit:
            raise ValueError(f"{len(images)} images in one prompt, more than the {limit} allowed "
                             "(--limit-mm-per-prompt '{\"image\": N}' raises it)")
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text, ids = None, list(prompt)
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(f"the prompt has {len(slots)} image placeholders ({self.image_token!r}) for {len(images)} "
                             "images; put one placeholder where each image goes (the chat template does)")
        expanded: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for slot, image in zip(slots, images):
            data, n = self.process_image(image)
            expanded.extend(ids[prev:slot])
            features.append(MultiModalFeature("image", content_hash(data), PlaceholderRange(len(expanded), n), data))
            expanded.extend([self.image_token_id] * n)
            prev = slot + 1
        expanded.extend(ids[prev:])
        return ProcessedPrompt(expanded, text, features)


def check_features(features: list[MultiModalFeature], prompt_ids: list[int], image_token_id: int) -> None:
    """Pre-processed features must sit on runs of the image token inside the prompt, in order."""
    end = 0
    for f in features:
        p = f.placeholder
        if p.offset < end or p.end > len(prompt_ids) or p.length < 1:
            raise ValueError(f"mm_features: placeholder {p} is out of order or outside the {len(prompt_ids)}-token prompt")
        if any(t != image_token_id for t in prompt_ids[p.offset : p.end]):
            raise ValueError(f"mm_features: placeholder {p} does not cover image tokens ({image_token_id})")
        end = p.end
