"""Mixtral: Mistral's attention with a top-k routed mixture of experts in every layer; its
checkpoint names the block `block_sparse_moe` and each expert's gate/down/up `w1`/`w2`/`w3`."""

from __future__ import annotations

from portside.model.decoder import DecoderForCausalLM

__all__ = ["MixtralForCausalLM"]


class MixtralForCausalLM(DecoderForCausalLM):
    renames = (
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),  # .weight, or a quantized format's .qweight, .scales, ...
        (".w2.", ".down_proj."),
        (".w3.", ".up_proj."),
    )
