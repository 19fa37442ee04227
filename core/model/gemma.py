"""Gemma 2 and Gemma 3 text models.

Both: embeddings scaled by sqrt(hidden), RMSNorms whose weight is an offset from 1, a norm after
each block as well as before it, a GeGLU MLP (tanh-approximated GELU), attention scaled by
``query_pre_attn_scalar`` and alternating sliding-window and global layers (`ModelArgs`).
Gemma 2 soft-caps the attention scores and the final logits; Gemma 3 normalises each query and
key head instead and gives its sliding layers a rope base of their own (`rope_local_theta`).
"""

from __future__ import annotations

from portside.model.decoder import DecoderForCausalLM
from portside.model.layers import GemmaRMSNorm

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]


class Gemma2ForCausalLM(DecoderForCausalLM):
    norm = GemmaRMSNorm
    sandwich_norms = True
    scale_embeddings = True


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = "head"
