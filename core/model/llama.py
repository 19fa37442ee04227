"""The Llama family: Llama, Mistral, Qwen2 (and their sliding-window checkpoints) and Qwen2-MoE.

What differs between them is data in `ModelArgs` (qkv bias, tied embeddings, explicit head_dim,
rope scaling, sliding window; Qwen2-MoE's experts and gated shared expert); the layers are
`decoder`'s.
"""

from __future__ import annotations

from portside.model.decoder import DecoderForCausalLM

__all__ = ["LlamaForCausalLM"]


class LlamaForCausalLM(DecoderForCausalLM):
    """Serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen2MoeForCausalLM."""
