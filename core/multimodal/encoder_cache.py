"""Image embeddings kept by content hash, so an image is encoded once: across the chunks of
one prompt's prefill, and across requests that send the same image."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from portside.multimodal.inputs import MultiModalFeature

__all__ = ["EncoderCache"]


class EncoderCache:
    """Least recently used first out, bounded by embedding rows (`capacity`); the entry just
    added always stays, however large, until the next one is added."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._entries

    def get(self, feature: MultiModalFeature, encode: Callable[[MultiModalFeature], torch.Tensor]) -> torch.Tensor:
        """The feature's embeddings [placeholder length, hidden], from the cache or `encode`d now."""
        emb = self._entries.get(feature.identifier)
        if emb is not None:
            self._entries.move_to_end(feature.identifier)
            self.hits += 1
            return emb
        emb = encode(feature)
        self.add(feature, emb)
        return emb

    def add(self, feature: MultiModalFeature, emb: torch.Tensor) -> None:
        """Keep `emb` [placeholder length, hidden], the feature's embeddings (encoded ahead, in a batch)."""
        if emb.shape[0] != feature.placeholder.length:
            raise ValueError(f"the image encoder gave {emb.shape[0]} embedding rows for an image with "
                             f"{feature.placeholder.length} placeholder tokens")
        if feature.identifier in self._entries:
            return
        self.misses += 1  # an image encoded
        while self._entries and self._rows + emb.shape[0] > self.capacity:
            _, old = self._entries.popitem(last=False)
            self._rows -= old.shape[0]
        self._entries[feature.identifier] = emb
        self._rows += emb.shape[0]
