"""Multi-token prediction (MTP) heads read from the target's own checkpoint: DeepSeek-V3's and
GLM-4.5's ``model.layers.{num_hidden_layers}.*`` (set aside by `portside.model.mtp` into the
target's `mtp_weights`), run by the EAGLE proposer (`spec_decode.eagle`) like an EAGLE-1 head:

    x = eh_proj(cat(enorm(embed(token)), hnorm(hidden)))   # hidden: the target's final hidden state
    h = x + attention(...) ; h = h + mlp(...)               # one decoder layer of the target's kind
    logits = lm_head(shared_head.norm(h))                    # h is also the next chained row's hidden

The layer is built by the class the target's own layers are (`DecoderLayer` with its
`make_attention` / `make_mlp`: latent attention and experts for DeepSeek-V3, q/k norms and
experts for GLM-4.5), sharded over the target's tensor-parallel group. The embedding is the
target's (the checkpoint's ``embed_tokens`` copy is not read: vLLM shares the target's too). The
logits are ``shared_head.head``'s, as vLLM computes them: the target's LM head where the
checkpoint's copy equals it (DeepSeek-V3 ships a copy), else the MTP layer's own. As vLLM does,
a row at position 0 embeds nothing. Only the first MTP layer is used (chain drafting).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import nn

from portside.contract import ForwardContext, KVCacheSpec, LatentKVCacheSpec
from portside.model.decoder import DecoderLayer
from portside.model.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, default_weight_loader

__all__ = ["MTPHead"]

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
_EMBED = "embed_tokens.weight"  # a copy of the target's
_HEAD = "shared_head.head.weight"


def load_parts(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor,
               parts: list[tuple[str, Any, torch.Tensor]], target: Any, loaded: set[tuple[str, object]]) -> None:
    """Load a checkpoint tensor's `parts` ((parameter, shard, tensor), as the target's
    `checkpoint_tensors` splits a layer's tensors) into an MTP head's `params`, recording them in
    `loaded`; a part with no place, or that does not fit, names the tensor."""
    for pname, shard, part in parts:
        if pname not in params:
            raise ValueError(f"MTP tensor {name!r} has no place in {target.config.architecture}'s MTP layer")
        param = params[pname]
        try:
            with torch.no_grad():
                getattr(param, "weight_loader", default_weight_loader)(param, part.to(param.dtype), shard)
        except (ValueError, RuntimeError, IndexError) as e:
            raise ValueError(f"the checkpoint's MTP tensor {name!r} {tuple(tensor.shape)} does not fit "
                             f"{target.config.architecture}'s MTP layer (hidden {target.config.hidden_size}): "
                             f"{e}") from None
        loaded.add((pname, shard))


def check_complete(head: nn.Module, loaded: set[tuple[str, object]], prefix: str) -> None:
    """Every required parameter (shard) of `head` was loaded (the LM head may come from the target)."""
    expected = {(n, s) for n, p in head.named_parameters() for s in (getattr(p, "shard_ids", None) or [None])
                if not getattr(p, "optional", False) and not n.startswith("lm_head.")}
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise ValueError(f"the checkpoint's MTP layer {prefix}* is missing {len(missing)} tensors, e.g. {missing[:4]}")


class MTPHead(nn.Module):
    """The target's first MTP layer (see the module doc), with `EagleHead`'s surface."""

    def __init__(self, target: Any) -> None:
        super().__init__()
        n = int(getattr(target, "num_mtp_layers", 0) or 0)
        if n < 1 or not getattr(target, "mtp_weights", None):
            raise ValueError(f"speculative_config: method 'mtp' needs multi-token-prediction layers in the checkpoint; "
                             f"{target.config.architecture} has none here (num_nextn_predict_layers {n}); use 'eagle3' "
                             "or 'draft_model'")
        args, dtype = target.config, target.dtype
        self.dtype, self._target = dtype, [target]  # (a list: not registered as a submodule)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps, dtype), RMSNorm(h, eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, False, dtype)
        self.shared_head_norm = RMSNorm(h, eps, dtype)
        self.layer = DecoderLayer(getattr(target, "layer_class", type(target)), args, args.num_layers, target.tp, dtype)
        self.lm_head: ParallelLMHead | None = None  # shared_head.head where it is not the target's LM head
        self.latent = isinstance(target.kv_cache_spec(), LatentKVCacheSpec)
        self._load(target)

    def _load(self, target: Any) -> None:
        prefix = f"model.layers.{target.config.num_layers}."
        params = dict(self.named_parameters())
        loaded: set[tuple[str, object]] = set()
        for name, tensor in target.mtp_weights.items():
            if not name.startswith(prefix):
                continue  # a later MTP layer (chain drafting reuses the first)
            rest = name.removeprefix(prefix)
            if rest == _EMBED:
                continue
            if rest == _HEAD:
                self._load_head(target, tensor)
                continue
            if rest in _OWN:
                parts = [(rest.replace("shared_head.norm", "shared_head_norm"), None, tensor)]
            else:  # the decoder layer's tensors, named and fused as the target's own layers are
                parts = [(t.replace("model.layers.0.", "layer.", 1), s, p)
                         for t, s, p in target.checkpoint_tensors("model.layers.0." + rest, tensor)]
            load_parts(params, name, tensor, parts, target, loaded)
        check_complete(self, loaded, prefix)

    def _load_head(self, target: Any, tensor: torch.Tensor) -> None:
        """``shared_head.head``: kept only where it is not the target's LM head (this rank's rows)."""
        tp, args = target.tp, target.config
        head = ParallelLMHead(args.vocab_size, args.hidden_size, tp.rank, tp.size, self.dtype, tp.comm)
        try:
            with torch.no_grad():
                head.weight_loader(head.weight, tensor.to(head.weight.dtype))
        except (ValueError, RuntimeError, IndexError) as e:
            raise ValueError(f"the checkpoint's MTP tensor shared_head.head.weight {tuple(tensor.shape)} does not fit "
                             f"the target's LM head (vocabulary {args.vocab_size}, hidden {args.hidden_size}): {e}") from None
        target_head = target.lm_head
        differs = torch.tensor([float(target_head.quant is not None or not torch.equal(head.weight, target_head.weight))],
                               device=head.weight.device)
        if tp.size > 1:  # every rank decides alike (their proposals must agree)
            differs = tp.comm.all_reduce(differs)
        if bool(differs.item()):
            self.lm_head = head

    def kv_cache_spec(self) -> KVCacheSpec:
        return dataclasses.replace(self._target[0].kv_cache_spec(), num_layers=1)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:  # (EAGLE-3's; an MTP head reads the final hidden state)
        return aux

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        target = self._target[0]
        emb, rope = target.embed(ids, positions)
        emb = emb.masked_fill((positions == 0)[:, None], 0)
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        layer = self.layer
        if self.latent:
            query, latent = layer.pre_attention(h, *rope[:2])
            attn: Any = layer.self_attn
            o = ctx.backend.latent_attention(query, latent, ctx.kv_caches[0], ctx.metadata, attn.scale, attn.latent_dim)
        else:
            q, k, v = layer.pre_attention(h, *rope[:2])
            o = ctx.attention(0, q, k, v, layer.self_attn.scale, **layer.self_attn.features)
        h = layer.post_attention(h, o)
        return self.shared_head_norm(h), h

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).argmax(dim=-1)
        return cast(torch.Tensor, self._target[0].compute_logits(hidden).argmax(dim=-1))
