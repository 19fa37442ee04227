"""Vision encoders of the vision-language models (`portside.model.llava`)."""

from portside.model.vision.clip import VisionTransformer, hidden_state_indices, vision_activation

__all__ = ["VisionTransformer", "hidden_state_indices", "vision_activation"]
