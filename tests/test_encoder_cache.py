"""EncoderCache: image embeddings by content hash, least recently used first out, bounded by rows;
content_hash: equal for equal processed tensors only."""

from __future__ import annotations

import pytest
import torch

from portside.multimodal.encoder_cache import EncoderCache
from portside.multimodal.inputs import MultiModalFeature, PlaceholderRange, content_hash


def feature(ident: str, rows: int) -> MultiModalFeature:
    return MultiModalFeature("image", ident, PlaceholderRange(0, rows), {"pixel_values": torch.zeros(1)})


def test_lru_within_capacity_and_encoding_once():
    cache, encoded = EncoderCache(capacity=10), []

    def encode(f: MultiModalFeature) -> torch.Tensor:
        encoded.append(f.identifier)
        return torch.full((f.placeholder.length, 2), float(len(encoded)))

    a, b, c = feature("a", 4), feature("b", 4), feature("c", 4)
    cache.get(a, encode)
    cache.get(b, encode)
    assert cache.get(a, encode)[0, 0] == 1  # a hit: not encoded again
    cache.get(c, encode)  # 12 rows > 10: b, the least recently used, goes
    assert "b" not in cache and "a" in cache and "c" in cache
    cache.get(b, encode)
    assert encoded == ["a", "b", "c", "b"] and (cache.hits, cache.misses) == (1, 4)
    big = feature("big", 30)  # larger than the whole cache: kept until the next one comes
    cache.get(big, encode)
    assert len(cache) == 1 and "big" in cache


def test_an_encoder_giving_the_wrong_row_count_is_an_error():
    with pytest.raises(ValueError, match="3 embedding rows for an image with 4 placeholder tokens"):
        EncoderCache(8).get(feature("a", 4), lambda f: torch.zeros(3, 2))


def test_content_hash_sees_values_shapes_and_names():
    x = torch.arange(12.0).reshape(3, 4)
    assert content_hash({"pixel_values": x}) == content_hash({"pixel_values": x.clone()})
    assert content_hash({"pixel_values": x}) != content_hash({"pixel_values": x.reshape(4, 3)})
    assert content_hash({"pixel_values": x}) != content_hash({"pixel_values": x + 1e-6})
    assert content_hash({"pixel_values": x}) != content_hash({"other": x})
