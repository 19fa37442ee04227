"""Tiny random-weight LLaVA and LLaVA-Next folders, for tests.

`make_tiny_llava(path, vision="clip" | "siglip", next=False)` writes a complete Hugging Face
folder: config.json and model.safetensors (transformers' own Llava / LlavaNext classes, weights
re-drawn wider as `portside.testing.tiny` does), the tiny tokenizer with an ``<image>`` token and
a LLaVA-style chat template, and the processor files (preprocessor_config.json,
processor_config.json) so that `transformers.AutoProcessor.from_pretrained(path)` expands each
``<image>`` into the image's placeholder tokens. The image processors are the PIL ones
(no torchvision needed).

The variants differ in more than the vision tower, so that the model code sees several shapes:

- "clip": Llama text model (4 heads, 2 KV heads); CLIP tower (2 heads, quick_gelu, 28 px
  images, patch 14); feature layer -2, "default" strategy (CLS dropped).
- "siglip": Qwen2 text model (8 heads of 8, 2 KV heads, q/k/v bias); SigLIP tower (4 heads,
  gelu_pytorch_tanh, 42 px, no class token); feature layers [-1, -2] concatenated, "full"
  strategy, projector without bias.
- next=True (with "clip" or "siglip"): LLaVA-Next over a Mistral-style text model (explicit head_dim,
  1 KV head); 28 px tiles, grid pinpoints up to 56 x 56, a learnt image_newline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from portside.testing.tiny import make_tiny_tokenizer, widen_init

__all__ = ["LLAVA_TEMPLATE", "IMAGE_TOKEN", "make_tiny_llava"]

IMAGE_TOKEN = "<image>"

# USER: / ASSISTANT: turns; list content renders {"type": "image"} parts as <image> and text parts as is
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{{ 'USER: ' if message['role'] == 'user' else ('ASSISTANT: ' if message['role'] == 'assistant' else 'SYSTEM: ') }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' if message['role'] == 'assistant' else '' }}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def _text_config(kind: str, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    import transformers

    common: dict[str, Any] = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                  eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    if kind == "llama":
        return transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(num_attention_heads=8, num_key_value_heads=2, use_sliding_window=False, **common)
    return transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=24, sliding_window=None,
                                      **common)


def _vision_config(vision: str, image_size: int) -> Any:
    import transformers

    common: dict[str, Any] = dict(hidden_size=32, num_hidden_layers=2, image_size=image_size, patch_size=14)
    if vision == "clip":
        return transformers.CLIPVisionConfig(intermediate_size=64, num_attention_heads=2, hidden_act="quick_gelu",
                                             projection_dim=32, **common)
    if vision == "siglip":
        return transformers.SiglipVisionConfig(intermediate_size=48, num_attention_heads=4,
                                               hidden_act="gelu_pytorch_tanh", **common)
    raise ValueError(f"unknown vision tower {vision!r}; use 'clip' or 'siglip'")


def _image_processor(vision: str, next: bool, image_size: int, pinpoints: list[list[int]]) -> Any:
    import transformers

    if next:
        mean, std = (_CLIP_MEAN, _CLIP_STD) if vision == "clip" else ([0.5] * 3, [0.5] * 3)
        return transformers.LlavaNextImageProcessorPil(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
            image_grid_pinpoints=pinpoints, image_mean=mean, image_std=std, do_pad=True,
        )
    if vision == "clip":
        return transformers.CLIPImageProcessorPil(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
            image_mean=_CLIP_MEAN, image_std=_CLIP_STD,
        )
    return transformers.SiglipImageProcessorPil(size={"height": image_size, "width": image_size})


def make_tiny_llava(
    path: str | os.PathLike, vision: str = "clip", next: bool = False, seed: int = 0, init_std: float = 0.25,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight LLaVA (or, with `next`, LLaVA-Next) folder at `path`; return it.

    `overrides` go to the Llava / LlavaNext config (e.g. ``vision_feature_layer=[-2, -1]``,
    ``vision_feature_select_strategy="full"``, ``projector_hidden_act="gelu"``).
    """
    import transformers

    path = Path(path)
    tok = make_tiny_tokenizer(path, added_tokens=(IMAGE_TOKEN,), chat_template=LLAVA_TEMPLATE)
    eos_id, pad_id = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text_kind = "mistral" if next else ("llama" if vision == "clip" else "qwen2")
    image_size = 28 if (next or vision == "clip") else 42
    pinpoints = [[28, 56], [56, 28], [56, 56]]
    text, vis = _text_config(text_kind, len(tok), eos_id, pad_id), _vision_config(vision, image_size)
    kwargs: dict[str, Any] = dict(text_config=text, vision_config=vis, image_token_index=image_token_id)
    if vision == "siglip":
        kwargs.update(vision_feature_layer=[-1, -2], vision_feature_select_strategy="full",
                      multimodal_projector_bias=False)
    else:
        kwargs.update(vision_feature_layer=-2, vision_feature_select_strategy="default")
    if next:
        kwargs.update(image_grid_pinpoints=pinpoints)
    kwargs.update(overrides)
    config: Any
    if next:
        config = transformers.LlavaNextConfig(**kwargs)
        config.architectures = ["LlavaNextForConditionalGeneration"]
        model_cls: Any = transformers.LlavaNextForConditionalGeneration
    else:
        config = transformers.LlavaConfig(**kwargs)
        config.architectures = ["LlavaForConditionalGeneration"]
        model_cls = transformers.LlavaForConditionalGeneration
    config.eos_token_id = eos_id
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    widen_init(model, init_std, seed)
    model.save_pretrained(str(path), safe_serialization=True)

    strategy = config.vision_feature_select_strategy
    processor_cls = transformers.LlavaNextProcessor if next else transformers.LlavaProcessor
    processor = processor_cls(
        image_processor=_image_processor(vision, next, image_size, pinpoints), tokenizer=tok,
        patch_size=vis.patch_size, vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1 if vision == "clip" else 0, chat_template=LLAVA_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(str(path))
    return path
