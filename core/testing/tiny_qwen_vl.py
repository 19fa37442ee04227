"""A tiny random-weight Qwen2.5-VL folder for tests, built by transformers' own classes.

`make_tiny_qwen2_5_vl(path)` writes config.json, model.safetensors (fp32, weights re-drawn wider
than HF's init as `portside.testing.tiny` does), the tiny tokenizer with the Qwen-VL marker tokens
and a Qwen2.5-VL-style chat template, and preprocessor_config.json. Shapes: language model hidden
64, 2 layers, 4 heads / 2 KV heads (head_dim 16, mrope_section [2, 3, 3]); vision tower hidden
32, 2 heads, depth 3 with block 1 full attention and the others windowed (window_size 56 px: 2x2
merged patches per window, so a 112 px image has several windows), patch 14, spatial merge 2.
Images are resized to between 56x56 and 112x112 pixels (min_pixels / max_pixels).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from portside.testing.tiny import make_tiny_tokenizer, widen_init

__all__ = ["QWEN_VL_TOKENS", "QWEN_VL_TEMPLATE", "TINY_PREPROCESSOR", "make_tiny_qwen2_5_vl"]

QWEN_VL_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>")

# ChatML whose list content renders an image as <|vision_start|><|image_pad|><|vision_end|> (the
# processor expands the one <|image_pad|> to the image's token count), as Qwen2.5-VL's does
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True,
    "resample": 3,  # bicubic
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def _config(tok: Any, overrides: dict[str, Any]) -> Any:
    from transformers import Qwen2_5_VLConfig

    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    eos_id, pad_id = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    text: dict[str, Any] = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=eos_id,
        pad_token_id=pad_id, bos_token_id=None, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision: dict[str, Any] = dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1], hidden_act="silu",
    )
    text.update(overrides.pop("text_config", {}))
    vision.update(overrides.pop("vision_config", {}))
    vision["out_hidden_size"] = text["hidden_size"]
    top: dict[str, Any] = dict(eos_token_id=eos_id, pad_token_id=pad_id, **ids, **overrides)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                              **top)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def make_tiny_qwen2_5_vl(path: str | os.PathLike, seed: int = 0, init_std: float = 0.25, **overrides: Any) -> Path:
    """Write a tiny random-weight Qwen2.5-VL folder at `path` and return it. `overrides` go to
    `Qwen2_5_VLConfig`; ``text_config={...}`` / ``vision_config={...}`` update the tiny shapes above
    (e.g. ``vision_config={"window_size": 112}``)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = Path(path)
    tok = make_tiny_tokenizer(path, added_tokens=QWEN_VL_TOKENS, chat_template=QWEN_VL_TEMPLATE)
    config = _config(tok, dict(overrides))
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)  # fp32 (torch's default dtype)
    widen_init(model, init_std, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2) + "\n")
    # the processor's own file: AutoProcessor reads the chat template and processor class from it
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2) + "\n")
    (path / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)
    return path
