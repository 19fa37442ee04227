"""`CausalLM`: what the runner may call on a model that `load_model` returns."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import nn

from portside.backend_api import ForwardContext, KVCacheSpec
from portside.model.args import ModelArgs

__all__ = ["CausalLM"]

_M = TypeVar("_M", bound="CausalLM")


class CausalLM(Protocol):
    """A causal language model as `load_model` returns it: an `nn.Module` (the nn.Module
    members the callers use are listed here) with its `ModelArgs` as `config`.

    `model(input_ids [T], positions [T], ctx) -> hidden [T, hidden]` (after the final norm);
    `compute_logits(hidden [N, hidden]) -> fp32 logits [N, vocab]` on every rank;
    `kv_cache_spec()` describes this rank's share of the KV cache.
    """

    config: ModelArgs

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def kv_cache_spec(self) -> KVCacheSpec: ...

    # nn.Module
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def eval(self: _M) -> _M: ...


if TYPE_CHECKING:  # the models load_model builds conform (checked by mypy only)
    from portside.model.llama import LlamaForCausalLM

    _llama: type[CausalLM] = LlamaForCausalLM
