"""What pooling requests return, in vLLM's shapes (`.outputs.embedding`, `.outputs.probs`,
`.outputs.score`, `.outputs.data`), and the front end's post-processing of a runner vector, shared
by `LLM` and the HTTP endpoints: classifier activations, Matryoshka `dimensions` (truncate, then
L2-normalise again) and cosine scores."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

from portside.config import PoolerConfig
from portside.outputs import EmbeddingOutput, EmbeddingRequestOutput

__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "PoolingOutput", "PoolingRequestOutput", "ScoringOutput", "ScoringRequestOutput", "activate", "cosine",
           "truncate_dimensions"]

T = TypeVar("T")


@dataclass
class ClassificationOutput:
    probs: list[float]  # the activation's output (softmax / sigmoid), one per class

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    data: list[float]  # the model's vector as the runner computed it (no activation, no truncation)


@dataclass
class PoolingRequestOutput(Generic[T]):
    """One prompt's (or text pair's) result: `request_id`, `outputs`, `prompt_token_ids`, `finished`."""

    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]


def activate(pooler: PoolerConfig, logits: list[float], use_activation: bool | None = None) -> list[float]:
    """A classifier's logits through its activation (`PoolerConfig.activation`; `use_activation`
    False: none, True: the model's, or softmax / sigmoid by the label count where it has none)."""
    kind = pooler.activation
    if use_activation is False:
        return list(logits)
    if use_activation and kind == "none":
        kind = "sigmoid" if len(logits) == 1 else "softmax"
    if kind == "sigmoid":
        return [_sigmoid(x) for x in logits]
    if kind == "softmax":
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return [e / total for e in exps]
    return list(logits)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def check_dimensions(pooler: PoolerConfig, dimensions: int | None) -> None:
    """ValueError naming `dimensions` when the model cannot return that many (or that size)."""
    if dimensions is None:
        return
    if pooler.task != "embed":
        raise ValueError(f"dimensions: applies to embedding models; this model's task is {pooler.task}")
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise ValueError(f"dimensions: must be a positive integer, got {dimensions!r}")
    if pooler.output_size and dimensions > pooler.output_size:
        raise ValueError(f"dimensions: {dimensions} is more than this model's embedding size {pooler.output_size}")
    if pooler.matryoshka_dimensions and dimensions not in pooler.matryoshka_dimensions:
        raise ValueError(f"dimensions: this model was trained for {list(pooler.matryoshka_dimensions)} "
                         f"(matryoshka_dimensions), not {dimensions}")


def truncate_dimensions(vector: list[float], dimensions: int | None, normalize: bool = True) -> list[float]:
    """The first `dimensions` values, L2-normalised again (when the model normalises)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    if not normalize:
        return head
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0
