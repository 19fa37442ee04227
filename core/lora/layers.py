"""LoRA on a model's linear layers: each layer an adapter may target holds its adapters' A and B
in a fixed number of slots, and adds ``x A^T B^T`` of each token's adapter to its output.

A layer of P fused parts (q/k/v, gate/up) keeps A as ``[slots, P * R, in]`` (one shrink for
every part) and one B per part ``[slots, rows of the part on this rank, R]`` (expanded into the
part's rows). Ranks below R are zero-padded, the adapter's scaling is folded into B. Under
tensor parallelism A and B are cut as the base weight is: a column-parallel layer keeps B's rows
of its slice, a row-parallel one A's columns of its slice (its partial products are summed by
the base layer's all-reduce, which comes after the LoRA term is added).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from portside.model.layers import LinearBase

# portside's names of the linear layers adapters may target (Hugging Face's q/k/v and gate/up
# land in the fused ones through the model's own checkpoint-name mapping; up_proj: an MLP without
# a gate, Nemotron-H's); `portside.lora.targets.lora_layers` leaves out recurrent mixers' layers
LORA_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "up_proj")


@dataclass
class LoRAState:
    """What every LoRA layer of a model reads in a forward: the step's token -> slot mapping
    (None: no token of the batch has an adapter) and the kernels."""

    ops: Any
    mapping: Any = None  # a portside.ops.lora.LoRAMapping


@dataclass
class LoRALayer:
    linear: LinearBase
    state: LoRAState
    a: torch.Tensor  # [slots, P * R, in_local]
    b: list[torch.Tensor]  # per part: [slots, rows_local, R]
    offsets: list[int]  # per part: first row in the layer's (local) output
    parts: list[object] = field(default_factory=list)

    @classmethod
    def attach(cls, linear: LinearBase, state: LoRAState, num_slots: int, rank: int) -> LoRALayer:
        parts: list[object] = list(linear.parts) if linear.parts is not None else [None]
        w = linear.weight if linear.weight is not None else next(linear.buffers())
        dtype = linear.dtype if linear.dtype.is_floating_point else torch.float32
        a = torch.zeros(num_slots, len(parts) * rank, linear.in_local, dtype=dtype, device=w.device)
        b, offsets = [], []
        for p in parts:
            dst, _, n = linear.out_partition(p)
            b.append(torch.zeros(num_slots, n, rank, dtype=dtype, device=w.device))
            offsets.append(dst)
        layer = cls(linear, state, a, b, offsets, parts)
        linear.lora = layer
        return layer

    @property
    def rank(self) -> int:
        return self.b[0].shape[2]

    def shard(self, part: object, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of one part's full (A [r, in], B [rows, r])."""
        lin = self.linear
        if b.shape[0] != lin.checkpoint_rows(part):
            raise ValueError(f"B has {b.shape[0]} rows, the layer's part {part!r} has {lin.checkpoint_rows(part)}")
        cols = lin.in_partition()
        if cols is not None:
            a = a.narrow(1, *cols)
        if a.shape[1] != lin.in_local:
            raise ValueError(f"A has {a.shape[1]} input columns, the layer has {lin.in_local}")
        _, src, n = lin.out_partition(part)
        return a, b.narrow(0, src, n)

    def write_slot(self, slot: int, weights: dict[object, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` with this rank's (A, B) per part (parts the adapter skips stay zero)."""
        R = self.rank
        self.a[slot].zero_()
        for i, part in enumerate(self.parts):
            self.b[i][slot].zero_()
            if part in weights:
                a, b = weights[part]
                r = a.shape[0]
                self.a[slot, i * R : i * R + r].copy_(a)
                self.b[i][slot, :, :r].copy_(b)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each token's adapter term, in place (x [T, in_local], y [T, out_local])."""
        mapping = self.state.mapping
        if mapping is None:
            return
        ops, R = self.state.ops, self.rank
        h = ops.lora_shrink(x, self.a, mapping)  # [T, P * R]
        for i, (b, offset) in enumerate(zip(self.b, self.offsets)):
            ops.lora_expand(h[:, i * R : (i + 1) * R], b, mapping, y, offset)
