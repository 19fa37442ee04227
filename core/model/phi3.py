"""Phi-3: the Llama layout with q/k/v stored as one `qkv_proj` tensor and gate/up as one
`gate_up_proj` in the checkpoint (split here into the parts each rank keeps), longrope scaling
and, in some checkpoints, a sliding window and partial rotary (`ModelArgs`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from portside.model.decoder import DecoderForCausalLM

__all__ = ["Phi3ForCausalLM"]


class Phi3ForCausalLM(DecoderForCausalLM):
    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, object, torch.Tensor]]:
        c = self.config
        if name.endswith(".qkv_proj.weight"):
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            if tensor.shape[0] != q + 2 * kv:
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected {q + 2 * kv}")
            yield from ((name, sid, part) for sid, part in zip("qkv", tensor.split([q, kv, kv])))
        elif name.endswith(".gate_up_proj.weight"):
            if tensor.shape[0] != 2 * c.intermediate_size:
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected {2 * c.intermediate_size}")
            yield from ((name, sid, part) for sid, part in enumerate(tensor.chunk(2)))
        else:
            yield from super().checkpoint_tensors(name, tensor)
