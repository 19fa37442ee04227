"""Quantizing a built model: `prepare_model_for_format` before the checkpoint loads (each linear
layer gets its format's checkpoint tensors instead of a dense weight), `finalize_quantized` after
(each becomes a canonical `QuantWeight`, handed to the platform's `ModelOps.prepare_quantized`).
"""

from __future__ import annotations

import logging

from torch import nn

from portside.contract import ModelOps
from portside.model.layers import LinearBase
from portside.model.moe import MoEExperts
from portside.quant import mxfp4
from portside.quant.config import QuantConfig
from portside.quant.formats import add_checkpoint_params, add_expert_params, stacked_expert_weights, to_quant_weights
from portside.quant.gguf import finalize_gguf_model, prepare_gguf_model
from portside.quant.weight import QuantParts, QuantWeight, quantize_per_channel

__all__ = ["prepare_model_for_format", "finalize_quantized", "weight_bytes"]

logger = logging.getLogger(__name__)

_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _hf_names(name: str) -> list[str]:
    """The checkpoint module names a portside layer is loaded from (fused layers: every part)."""
    head, _, last = name.rpartition(".")
    return [name] + [f"{head}.{p}" for p in _PARTS.get(last, ())]


def prepare_model_for_format(model: nn.Module, qc: QuantConfig, ops: ModelOps) -> None:
    """Give every quantized linear layer of `model` its checkpoint tensors (`formats`); layers
    the format leaves in full precision (ignore lists, lm_head, MoE routers) keep theirs."""
    if qc.method == "gguf":
        prepare_gguf_model(model, qc, ops)
        return
    if qc.method == "mxfp4":  # only the experts are in MXFP4; every linear layer stays dense
        experts = [(n, m) for n, m in model.named_modules() if mxfp4.is_experts(m) and qc.quantizes(n)]
        if not experts:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts layers for an mxfp4 checkpoint's experts")
        for _, module in experts:
            mxfp4.add_expert_params(module)
        return
    for name, module in model.named_modules():
        if isinstance(module, MoEExperts) and not qc.online:
            if all(qc.quantizes(f"{name}.{e}.{p}_proj") for e in range(module.num_experts) for p in ("gate", "up", "down")):
                add_expert_params(module, qc)
            continue
        if not isinstance(module, LinearBase):
            continue
        module.ops = ops
        wanted = [qc.quantizes(n) for n in _hf_names(name)]
        if not getattr(module, "quantizable", True) or not all(wanted):
            if any(wanted) and getattr(module, "quantizable", True):
                raise ValueError(f"{name}: its fused parts are not all quantized ({qc.method} ignore list); portside fuses them")
            continue
        add_checkpoint_params(module, qc)
        module.quant_format = qc  # type: ignore[assignment]


def finalize_quantized(model: nn.Module, qc: QuantConfig, ops: ModelOps) -> None:
    """Convert every loaded quantized layer to a `QuantWeight` the platform has prepared (a fused
    one whose parts' act orders differ: a `QuantParts`), and (online methods) quantize the
    experts of MoE layers. Raises ValueError naming the layer."""
    if qc.method == "gguf":
        finalize_gguf_model(model, qc, ops)
        return
    split = 0
    for name, module in list(model.named_modules()):
        if getattr(module, "quant_format", None) == "mxfp4":
            w13, w2 = mxfp4.expert_weights(module)
            module.quant13, module.quant2 = ops.prepare_quantized(w13), ops.prepare_quantized(w2)
            continue
        if isinstance(module, LinearBase) and getattr(module, "quant_format", None) is not None:
            try:
                qws = to_quant_weights(module, qc)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            for pname in list(module._parameters):
                if pname != "bias":
                    delattr(module, pname)
            module.weight = None
            module.quant = _prepared(qws, ops)
            split += len(qws) > 1
            module.quant_format = None  # type: ignore[assignment]
        elif isinstance(module, MoEExperts) and (qc.online or getattr(module, "quant_format", None) is not None):
            if qc.online:
                w13s = [quantize_per_channel(module.w13.detach(), qc.method, qc.act)]
                w2s = [quantize_per_channel(module.w2.detach(), qc.method, qc.act)]
                del module.w13, module.w2
            else:
                try:
                    w13s, w2s = stacked_expert_weights(module, qc)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
                module.quant_format = None  # type: ignore[assignment]
            module.quant13, module.quant2 = _prepared(w13s, ops), _prepared(w2s, ops)
            split += len(w13s) > 1
    logger.info("quantized %s: %s%s", type(model).__name__, qc.describe(),
                f"; {split} fused layers computed part by part (their parts' act orders differ)" if split else "")


def _prepared(weights: list[QuantWeight], ops: ModelOps) -> QuantWeight | QuantParts:
    """One prepared weight, or a fused layer's parts (`QuantParts`), each prepared on its own."""
    if len(weights) == 1:
        return ops.prepare_quantized(weights[0])
    return QuantParts([ops.prepare_quantized(w) for w in weights])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model` (a tied tensor counted once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values())
