"""OLMoE: routed experts in every layer (softmax top-k, not renormalised), an RMSNorm over each
token's whole query and key projections, and optional q/k/v clipping (`clip_qkv`)."""

from __future__ import annotations

from portside.model.decoder import DecoderForCausalLM

__all__ = ["OlmoeForCausalLM"]


class OlmoeForCausalLM(DecoderForCausalLM):
    qk_norm = "full"
