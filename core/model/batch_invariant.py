"""Batch-invariant mode on a loaded model (`make_batch_invariant`): its linears, norms and MLP
activations switch to core's batch-invariant kernels (`portside.ops.batch_invariant`); a model
with a layer those kernels do not cover is refused, naming the layer, rather than run with
results that would still depend on the batch.

Covered: decoder models built from `portside.model.decoder` and `portside.model.layers` (the
Llama family, Qwen2/3, Mistral, Gemma and the like) with dense, unquantized weights. Not covered
(refused): mixture-of-experts blocks (routing groups tokens by expert, so a token's matmul
shares its rows with the batch's), recurrent (Mamba, delta-rule) and latent-attention layers,
quantized weights, vision towers.
"""

from __future__ import annotations

from torch import nn

from portside.model.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    MissingLayer,
)
from portside.model.layers import LinearBase, ParallelLMHead, RMSNorm, VocabParallelEmbedding
from portside.model.rotary import RotaryEmbedding
from portside.ops import batch_invariant

__all__ = ["make_batch_invariant"]

_PLAIN = (DecoderModel, DecoderLayer, DecoderAttention, MissingLayer, RotaryEmbedding, nn.ModuleList)
"""Modules whose own computation is elementwise or delegated to their children / the attention
backend (so invariant once those are)."""


def make_batch_invariant(model: nn.Module) -> None:
    """Switch `model`'s layers to the batch-invariant kernels, or raise ValueError naming the
    first layer they do not cover (before anything is changed)."""
    arch = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
    if not isinstance(model, DecoderForCausalLM):
        raise ValueError(f"--batch-invariant does not support {arch}: only decoder models built from "
                         "portside.model.decoder (the Llama family and the like) are covered")
    for name, module in model.named_modules():
        if module is model or isinstance(module, (*_PLAIN, RMSNorm, GatedMLP)):
            continue
        if isinstance(module, (LinearBase, VocabParallelEmbedding)):
            if getattr(module, "quant", None) is not None:
                raise ValueError(f"--batch-invariant does not support quantized weights ({arch}: {name}); "
                                 "use a full-precision checkpoint")
            continue
        raise ValueError(f"--batch-invariant does not support {arch}: its layer {name} ({type(module).__name__}) "
                         "has no batch-invariant kernel (mixture-of-experts, recurrent, latent-attention and vision "
                         "layers are not covered)")
    act = batch_invariant.activation(model.config.hidden_act)
    for module in model.modules():
        if isinstance(module, (LinearBase, RMSNorm, ParallelLMHead)):
            module.batch_invariant = True
        elif isinstance(module, GatedMLP):
            module.act = act
