"""`PoolingParams`: a pooling request's options, as vLLM's (`LLM.embed(..., pooling_params=...)`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """`dimensions`: an embedding's first n values, L2-normalised again (Matryoshka);
    `normalize`: False returns embeddings as the model's Dense layers leave them;
    `use_activation`: False returns a classifier's logits (no softmax / sigmoid)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
