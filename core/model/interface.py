"""`CausalLM`: what the runner may call on a model that `load_model` returns."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import nn

from portside.contract import EncoderAttention, ForwardContext, KVCacheSpec
from portside.model.args import ModelArgs
from portside.multimodal.inputs import MultiModalFeature

__all__ = ["CausalLM", "SupportsMultiModal", "is_multimodal"]

_M = TypeVar("_M", bound="CausalLM")


class CausalLM(Protocol):
    """A causal language model as `load_model` returns it: an `nn.Module` (the nn.Module
    members the callers use are listed here) with its `ModelArgs` as `config`.

    `model(input_ids [T], positions [T], ctx) -> hidden [T, hidden]` (after the final norm;
    on a pipeline stage that is not the last, the residual stream for the next);
    `compute_logits(hidden [N, hidden]) -> fp32 logits [N, vocab]` on every rank;
    `kv_cache_spec()` describes this rank's share of the KV cache.

    Everything a step gives the model is an argument: where `ctx.inputs_embeds`
    (`ForwardContext.inputs_embeds`) is set, it is the step's input [T, hidden] in place of the
    token embeddings (a later pipeline stage's: the previous stage's output; a vision-language
    model's first stage: its token embeddings with the images merged in). The model keeps no
    per-step state of its own.
    """

    config: ModelArgs

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def kv_cache_spec(self) -> KVCacheSpec: ...

    # nn.Module
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def eval(self: _M) -> _M: ...


class SupportsMultiModal(Protocol):
    """A vision-language model: a `CausalLM` whose prompt embeddings may come partly from images.

    The runner embeds a step's tokens with `embed_input_ids`, overwrites the rows of image
    placeholder tokens with the image's `embed_image` rows, and hands the result to the forward
    pass as `ForwardContext.inputs_embeds` (what `DecoderForCausalLM.embed` then uses instead of
    embedding the ids).
    `embed_image(data, attention)`: `data` is one image's processor output
    (`portside.multimodal.inputs.MultiModalFeature.data`), `attention` the platform's
    non-causal `AttentionBackend.encoder_attention`; returns [placeholder length, hidden] in the
    model's dtype. With `uses_mrope` (Qwen2.5-VL) positions are [3, T] (temporal, height,
    width): `mrope_positions` gives the prompt's and the offset later tokens add to their index.
    """

    supports_multimodal: bool  # class attribute, True
    uses_mrope: bool  # class attribute
    image_token_id: int  # the placeholder token of one image row

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def embed_image(self, data: dict[str, torch.Tensor], attention: EncoderAttention) -> torch.Tensor: ...

    def embed_images(self, datas: list[dict[str, torch.Tensor]], attention: EncoderAttention) -> list[torch.Tensor]:
        """`embed_image` of each, in as few vision-tower calls as the model can (optional: the
        runner calls `embed_image` per image for a model without it)."""
        ...

    def mrope_positions(self, prompt_token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        """-> (positions [3, len(prompt)] int64, delta): a later token at index i has position i + delta in all 3."""
        ...


def is_multimodal(model: object) -> bool:
    return bool(getattr(model, "supports_multimodal", False))


if TYPE_CHECKING:  # the models load_model builds conform (checked by mypy only)
    from portside.model.llama import LlamaForCausalLM

    _llama: type[CausalLM] = LlamaForCausalLM
