"""One image of a request as the engine carries it.

An image occupies a contiguous run of placeholder tokens in the prompt (the model's image token,
repeated as often as the image has embedding rows): `PlaceholderRange`. The model's
`embed_image(feature.data, attention)` returns exactly `placeholder.length` rows, which replace
the placeholder tokens' embeddings. `identifier` is a content hash of the processed pixels: the
same image processed the same way has the same identifier in every request, which keys the
encoder cache and enters the prefix cache's block hashes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

__all__ = ["PlaceholderRange", "MultiModalFeature", "content_hash"]


@dataclass(frozen=True)
class PlaceholderRange:
    offset: int  # prompt position of the image's first placeholder token
    length: int  # placeholder tokens = embedding rows

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(eq=False)
class MultiModalFeature:
    modality: str  # "image"
    identifier: str  # `content_hash` of `data`
    placeholder: PlaceholderRange
    # what the Hugging Face processor returned for this one image, batch dimension kept
    # (pixel_values, and image_sizes / image_grid_thw where the architecture has them)
    data: dict[str, torch.Tensor] = field(repr=False)

    def encoder_cost(self) -> int:
        """What encoding it costs against the per-step encoder budget: its embedding rows."""
        return self.placeholder.length



def content_hash(data: dict[str, torch.Tensor]) -> str:
    """A hex digest of the tensors' names, dtypes, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(data):
        t = data[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
