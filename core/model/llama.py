"""The Llama family: Llama, Mistral and Qwen2 (and their sliding-window checkpoints).

What differs between them is data in `ModelArgs` (qkv bias, tied embeddings, explicit head_dim,
rope scaling, sliding window); the layers are `decoder`'s.
"""

from __future__ import annotations

from portside.model.decoder import DecoderForCausalLM

__all__ = ["LlamaForCausalLM"]


class LlamaForCausalLM(DecoderForCausalLM):
    """Serves LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM."""
