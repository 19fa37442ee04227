"""Qwen3-Next's multi-token-prediction (MTP) layer, read from the target's own checkpoint
(``mtp.*``, set aside by `portside.model.qwen3_next` into the target's `mtp_weights`) and run by
the EAGLE proposer (`spec_decode.eagle`) like an EAGLE-1 head:

    x = fc(cat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)))  # 2 x hidden -> hidden
    h = one full-attention decoder layer of the target's kind (gated attention, its MLP or experts)
    out = norm(h)                         # the logits' input, and the next chained row's hidden

`hidden` is the target's final (normed) hidden state of the position before; every norm is the
target's zero-centred RMSNorm; the embedding and LM head are the target's (Qwen3-Next ships no
copies). The layer is the target's `Qwen3NextDecoderLayer` built as an attention layer at index 0
(its MLP is dense or experts as layer 0's is, as vLLM builds ``mtp.layers.0``). Only the first
MTP layer is used (chain drafting). The layer attends over its own one-layer KV cache, so the
proposer keeps no recurrent state: only the target's verify rows need rolling back
(`portside.runner.recurrent`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import nn

from portside.contract import ForwardContext, KVCacheSpec
from portside.model.layers import GemmaRMSNorm, ReplicatedLinear
from portside.model.qwen3_next import Qwen3NextDecoderLayer
from portside.spec_decode.mtp import check_complete, load_parts

__all__ = ["Qwen3NextMTPHead"]

_PREFIX = "mtp."
_LAYER = "mtp.layers.0."
_OWN = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


class Qwen3NextMTPHead(nn.Module):
    """The target's first MTP layer (see the module doc), with `EagleHead`'s surface."""

    def __init__(self, target: Any) -> None:
        super().__init__()
        weights: dict[str, torch.Tensor] = getattr(target, "mtp_weights", None) or {}
        if not any(n.startswith(_LAYER) for n in weights):
            raise ValueError(f"speculative_config: method 'mtp' needs the multi-token-prediction layer in the "
                             f"checkpoint; {target.config.architecture} has no {_LAYER}* tensors here; use 'ngram' "
                             "or 'draft_model'")
        args, dtype = target.config, target.dtype
        self.dtype, self._target = dtype, [target]  # (a list: not registered as a submodule)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps, dtype), GemmaRMSNorm(h, eps, dtype)
        self.fc = ReplicatedLinear(2 * h, h, False, dtype)
        types = ("full_attention", *args.layer_types[1:])  # index 0, as an attention layer
        self.layer = Qwen3NextDecoderLayer(type(target), dataclasses.replace(args, layer_types=types), 0, target.tp,
                                           dtype)
        self.norm = GemmaRMSNorm(h, eps, dtype)
        self._load(target, weights)

    def _load(self, target: Any, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        loaded: set[tuple[str, object]] = set()
        for name, tensor in weights.items():
            rest = name.removeprefix(_PREFIX)
            if rest in _OWN:
                parts = [(rest, None, tensor)]
            elif name.startswith(_LAYER):  # named and fused as the target's own layers are
                parts = [(t.replace("model.layers.0.", "layer.", 1), s, p)
                         for t, s, p in target.checkpoint_tensors("model.layers.0." + name.removeprefix(_LAYER), tensor)]
            elif name.startswith("mtp.layers."):
                continue  # a later MTP layer (chain drafting reuses the first)
            else:
                raise ValueError(f"MTP tensor {name!r} has no place in {target.config.architecture}'s MTP layer")
            load_parts(params, name, tensor, parts, target, loaded)
        check_complete(self, loaded, _PREFIX)

    def kv_cache_spec(self) -> KVCacheSpec:
        return dataclasses.replace(self._target[0].kv_cache_spec(), num_layers=1)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:  # (EAGLE-3's; an MTP head reads the final hidden state)
        return aux

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        target = self._target[0]
        emb, rope = target.embed(ids, positions)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        out = self.norm(self.layer(x, rope[0], rope[1], ctx, 0))
        return out, out

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self._target[0].compute_logits(hidden).argmax(dim=-1))
