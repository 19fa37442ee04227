"""What every encoder-only model (`portside.model.bert`, `modernbert`, `nomic_bert`) shares: the
runner-facing interface of a pooling model with bidirectional attention, and loading its
Hugging Face checkpoint by the tensors' own names.

An encoder-only model (`is_encoder_only`) is run by the engine as a pooling model: each
request's whole prompt in one step (bidirectional attention cannot be split over steps), never a
KV cache (`kv_cache_spec` has no layers: the scheduler's blocks hold no memory and are freed when
the request ends with its step), no prefix caching, eagerly. `forward(input_ids [T], positions
[T], ctx) -> hidden [T, H]`: the final hidden states of the step's tokens (after the final norm
where the architecture has one), requests back to back as the step's attention metadata says;
``ctx.token_type_ids`` are the tokens' segment ids (None: all 0). Attention is
`ForwardContext.encoder_attention`.

Pooling (the pooler calls these): `default_pooling_type` ("cls" or "mean", sentence-transformers'
default for the architecture); a `*ForSequenceClassification` model also has `num_labels` and
`classify(pooled [B, H]) -> logits [B, num_labels]` (before any activation).

A dense layer and its residual add (`dense_add`) is a plain function whose body is the
reference, dispatched through torch's function overrides first, so a `TorchFunctionMode` that a
backend's runner enters around the step (the cpu eager runner's `EagerLinears`) may run it as
one kernel; outside such a mode it runs as written. Backends import only the contract, so the
function names what it computes in its ``fusion`` attribute ("linear+add": ``F.linear(x,
weight, bias) + residual``) and carries its reference (``reference``) for a mode that cannot fuse
the call at hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

from portside.contract import AttentionMetadata, Communicator, KVCacheSpec, ModelOps
from portside.model.args import ModelArgs

__all__ = ["EncoderModel", "check_whole_prompts", "dense_add", "hf_activation"]


def hf_activation(name: str) -> nn.Module:
    """transformers' activation of that name (``gelu`` exact, ``gelu_new`` tanh, ``silu``...)."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def dense_add_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        residual: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias) + residual


def dense_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T + bias + residual``."""
    if has_torch_function((x, weight, bias, residual)):
        return handle_torch_function(dense_add, (x, weight, bias, residual), x, weight, bias, residual)  # type: ignore[no-any-return]
    return dense_add_reference(x, weight, bias, residual)


dense_add.fusion = "linear+add"  # type: ignore[attr-defined]
dense_add.reference = dense_add_reference  # type: ignore[attr-defined]


def check_whole_prompts(md: AttentionMetadata) -> None:
    """Refuse a step in which some request's tokens continue ones computed earlier: bidirectional
    attention needs every token of the sequence in the same step."""
    qsl = md.query_start_loc_cpu
    if qsl and any(qsl[i + 1] - qsl[i] != n for i, n in enumerate(md.seq_lens_cpu)):
        raise ValueError("an encoder-only model needs each prompt whole in one step (bidirectional attention); "
                         "the step continues a prompt computed earlier (chunked prefill or a prefix-cache hit)")


class EncoderModel(nn.Module):
    """Base of the encoder-only models: construction checks, the empty KV-cache spec, loading."""

    is_encoder_only: ClassVar[bool] = True
    is_pooling_model: ClassVar[bool] = True  # it cannot generate (`portside.pooling.resolve`)
    default_pooling_type: ClassVar[str] = "cls"
    # checkpoint name prefixes dropped when the rest names one of our parameters (a base model saved
    # inside a task model: "bert.", "roberta.", "model.")
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()
    # checkpoint tensors a pooling model does not use (masked-LM heads, position-id buffers)
    ignored: ClassVar[tuple[str, ...]] = ()
    # checkpoint module names (e.g. "attention.self.query") loaded into one share of a fused
    # parameter's rows: -> (our module's name, share index); the fused parameter has as many
    # equal shares as the largest index + 1
    stacked: ClassVar[dict[str, tuple[str, int]]] = {}

    def __init__(self, args: ModelArgs, comm: Communicator | None = None, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, ops: ModelOps | None = None) -> None:
        super().__init__()
        if tp_size > 1:
            raise ValueError(f"{args.architecture} (an encoder-only model) runs at tensor_parallel_size 1; "
                             f"got {tp_size}")
        self.config = args
        self.hf: Any = args.hf_config
        self.dtype = dtype

    def kv_cache_spec(self) -> KVCacheSpec:
        """No layer keeps a cache: bidirectional attention over the step's tokens only."""
        return KVCacheSpec(num_layers=0, num_kv_heads=self.config.num_heads, head_size=self.config.head_dim,
                           dtype=self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{self.config.architecture} is an encoder-only model: it pools (embed, classify, "
                         "score), it does not generate")

    # ---- loading ----------------------------------------------------------------------------

    def _target(self, name: str, params: dict[str, nn.Parameter]) -> str | None:
        if name.endswith((".gamma", ".beta")) and "LayerNorm" in name:  # TensorFlow-era names (bert-base-uncased)
            name = name.removesuffix(".gamma") + ".weight" if name.endswith(".gamma") else name.removesuffix(".beta") + ".bias"
        if name in params:
            return name
        for prefix in self.checkpoint_prefixes:
            if name.startswith(prefix) and name[len(prefix) :] in params:
                return name[len(prefix) :]
        if name.endswith("position_ids") or any(name.startswith(p) for p in self.ignored):
            return None
        raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")

    def _stacked_target(self, name: str, params: dict[str, nn.Parameter]) -> tuple[str | None, int | None]:
        """(parameter, part index) for a tensor of one of `stacked`'s parts, (parameter, None) for any other."""
        for part, (fused, index) in self.stacked.items():
            if f".{part}." in name or name.startswith(f"{part}."):
                return self._target(name.replace(part, fused), params), index
        return self._target(name, params), None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint's tensors (HF names) into the parameters of the same names (the
        `stacked` parts into their share of the fused parameter's rows)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        parts: dict[str, set[int]] = {}
        count = 1 + max((index for _, index in self.stacked.values()), default=0)
        for name, tensor in weights:
            target, index = self._stacked_target(name, params)
            if target is None:
                continue
            param = params[target]
            if index is not None:
                rows = param.shape[0] // count
                param = param.narrow(0, index * rows, rows)  # type: ignore[assignment]
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)}: expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            if index is None or len(parts.setdefault(target, set()) | {index}) == count:
                loaded.add(target)
            if index is not None:
                parts[target].add(index)
        return loaded

    def check_loaded(self, loaded: set[str]) -> None:
        missing = sorted(set(dict(self.named_parameters())) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
