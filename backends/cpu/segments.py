"""The dense segments of a `PiecewiseModel`, cut at its attention calls, for graph runners that
compile them (OpenVINO) and run paged attention eagerly between them:

    head:  h, *aux                -> h, q, k, v       (layer 0 up to attention)
    mid i: h, o, *aux             -> h, q, k, v       (layer i-1 after attention, layer i up to it)
    tail:  h, o                   -> hidden           (last layer after attention, final norm)

`aux` is what every layer shares (the rotary cos/sin). `make_segments(model)` returns the
``num_layers + 1`` modules in order; `run_segments` is the step loop both runners share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from portside.contract import ForwardContext, PiecewiseModel

# A compiled segment: called with the segment's inputs, returns its outputs as a sequence.
SegmentFn = Callable[..., Sequence[torch.Tensor]]


class Head(nn.Module):
    """Layer 0 up to its attention: h, *aux -> h, q, k, v."""

    def __init__(self, model: PiecewiseModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, h, *aux):
        return (h, *self.model.pre_attention(0, h, aux))


class Mid(nn.Module):
    """From layer i-1's attention output to layer i's attention: h, o, *aux -> h, q, k, v."""

    def __init__(self, model: PiecewiseModel, i: int) -> None:
        super().__init__()
        self.model, self.i = model, i

    def forward(self, h, o, *aux):
        h = self.model.post_attention(self.i - 1, h, o)
        return (h, *self.model.pre_attention(self.i, h, aux))


class Tail(nn.Module):
    """The last layer after its attention, and the final norm: h, o -> (hidden,)."""

    def __init__(self, model: PiecewiseModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, h, o):
        return (self.model.final_norm(self.model.post_attention(self.model.num_layers - 1, h, o)),)


def make_segments(model: PiecewiseModel) -> list[nn.Module]:
    """[head, mid 1 .. mid num_layers-1, tail]: ``num_layers + 1`` modules (shared weights)."""
    return [Head(model), *(Mid(model, i) for i in range(1, model.num_layers)), Tail(model)]


def run_segments(
    model: PiecewiseModel, segments: Sequence[SegmentFn], input_ids: torch.Tensor, positions: torch.Tensor,
    ctx: ForwardContext,
) -> torch.Tensor:  # fmt: skip
    """One step: embed eagerly, then segment 0, attention, segment 1, ..., attention, tail.
    input_ids, positions [T] -> hidden [T, hidden]."""
    h, aux = model.embed(input_ids, positions)  # embedding and rotary gathers stay eager
    h, q, k, v = segments[0](h, *aux)
    last = model.num_layers - 1
    for i in range(model.num_layers):
        o = ctx.attention(i, q, k, v, model.attention_scale(i), **model.attention_features(i))  # [T, H, D], paged, eager
        if i < last:
            h, q, k, v = segments[i + 1](h, o, *aux)
        else:
            (h,) = segments[i + 1](h, o)
    return h
