"""Decoder LMs as pooling models.

- `as_pooling_model(cls, pooler)`: the class `load_model` builds for a decoder served by the
  pooling runner: checkpoint names without the `model.` prefix are accepted (a
  sentence-transformers folder stores the bare `Qwen3Model` / `LlamaModel`, as Qwen3-Embedding
  does), and the LM head is dropped unless the pooler reads its logits (`from_token_ids`, the
  Qwen3-Reranker conversion; the tied embedding matrix stands in for it otherwise).
- `Qwen3Model`, `Qwen2Model`, `LlamaModel` (architectures of such folders): the decoder without
  an LM head, pooling the last token by default.
- `{Llama,Qwen2,Qwen3}ForSequenceClassification`: the decoder and transformers' `score` linear
  (no bias) over the last token's state: `classify(pooled [B, hidden]) -> logits [B, num_labels]`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from portside.config import PoolerConfig
from portside.model.decoder import DecoderForCausalLM
from portside.model.llama import LlamaForCausalLM
from portside.model.qwen3 import Qwen3ForCausalLM

__all__ = ["LlamaForSequenceClassification", "LlamaModel", "Qwen2ForSequenceClassification", "Qwen2Model",
           "Qwen3ForSequenceClassification", "Qwen3Model", "as_pooling_model"]

_OWN_PREFIXES = ("model.", "lm_head.", "score.")


class _PoolingDecoder(DecoderForCausalLM):
    """A decoder whose hidden states are pooled; `keep_lm_head` False drops the LM head."""

    default_pooling_type: ClassVar[str] = "last"
    keep_lm_head: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads_lm_head = self.keep_lm_head
        if not self.keep_lm_head and self.lm_head is not None and self.model.embed_tokens is not None:
            # no head of its own: the embedding matrix stands in (tied, no memory), so that graph
            # runners may warm `compute_logits` as for any decoder; the pooler never reads it
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, object, torch.Tensor]]:
        if name.startswith("lm_head.") and not self.reads_lm_head:
            return  # a pooling model that never reads the LM head
        if not name.startswith(_OWN_PREFIXES):
            name = "model." + name  # a bare decoder's names (AutoModel, sentence-transformers folders)
        yield from super().checkpoint_tensors(name, tensor)


_VARIANTS: dict[tuple[type[nn.Module], bool], type[nn.Module]] = {}


def _variant(cls: type[nn.Module], keep_lm_head: bool) -> type[nn.Module]:
    """`cls` as a pooling decoder (one class per (cls, keep_lm_head), made once)."""
    key = (cls, keep_lm_head)
    if key not in _VARIANTS:
        _VARIANTS[key] = type(cls.__name__, (_PoolingDecoder, cls), {"keep_lm_head": keep_lm_head, "__module__": cls.__module__})
    return _VARIANTS[key]


def as_pooling_model(cls: type[nn.Module], pooler: PoolerConfig | None) -> type[nn.Module]:
    """The class to build for `cls` under `pooler` (None: generating, `cls` itself)."""
    if pooler is None or not issubclass(cls, DecoderForCausalLM) or issubclass(cls, _PoolingDecoder):
        return cls
    return _variant(cls, bool(pooler.from_token_ids))


class Qwen3Model(_PoolingDecoder, Qwen3ForCausalLM):
    is_pooling_model: ClassVar[bool] = True


class Qwen2Model(_PoolingDecoder, LlamaForCausalLM):
    is_pooling_model: ClassVar[bool] = True


class LlamaModel(_PoolingDecoder, LlamaForCausalLM):
    is_pooling_model: ClassVar[bool] = True


class _SequenceClassifier(_PoolingDecoder):
    """transformers' *ForSequenceClassification: `score` [num_labels, hidden], no bias."""

    is_pooling_model: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        hf = self.config.hf_config
        self.num_labels = int(getattr(hf, "num_labels", 0) or len(getattr(hf, "id2label", None) or {}) or 1)
        self.score = nn.Linear(self.config.hidden_size, self.num_labels, bias=False, dtype=self.dtype)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.score(pooled)


class LlamaForSequenceClassification(_SequenceClassifier, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(_SequenceClassifier, LlamaForCausalLM):
    pass


class Qwen3ForSequenceClassification(_SequenceClassifier, Qwen3ForCausalLM):
    pass
