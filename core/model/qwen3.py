"""Qwen3 and Qwen3-MoE: the Llama layout with an RMSNorm on each query and key head before rotary
(`q_norm`, `k_norm`); Qwen3-MoE's layers hold routed experts (`moe`, from `ModelArgs`)."""

from __future__ import annotations

from portside.model.decoder import DecoderForCausalLM

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Serves Qwen3ForCausalLM and Qwen3MoeForCausalLM."""

    qk_norm = "head"
