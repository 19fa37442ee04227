"""Vision encoders of the vision-language models: CLIP / SigLIP (`clip`, for `portside.model.llava`)
and Qwen2.5-VL's (`qwen2_5_vit`)."""

from portside.model.vision.clip import VisionTransformer, hidden_state_indices, vision_activation

__all__ = ["VisionTransformer", "hidden_state_indices", "vision_activation"]
