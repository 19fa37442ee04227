"""Paged attention as an opaque torch custom op, so a whole forward pass compiles as one graph.

`torch.ops.portside_cpu.attention(q, k, v, layer, scale, sliding_window=0, logit_softcap=0.0)`
runs the step's attention backend (`ForwardContext.attention`: KV write + paged attention) for one
layer, with the layer's attention features (`feature_args`; 0: not used); a layer with attention
sinks calls `portside_cpu::attention_sinks(..., sliding_window, logit_softcap, sinks)` instead
(`sinks_arg`: [heads] fp32; a separate operator because the C++ front `portside_cpu_native::attention`
calls back into `attention` through a handle typed against its schema). To dynamo and Inductor it
is a black box with a fixed output shape (its fake implementation), so nothing about the batch's
block tables, sequence lengths or prefill chunks is traced or guarded on, and the graph compiled
once serves every step. The step's context comes from `forward_context(ctx)`, which the graph
runner enters around each call of the compiled graph (as vLLM does with its forward context).

Importing this module registers the op (once per process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from portside.contract import ATTENTION_FEATURES, ForwardContext

_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext, native: bool = False) -> Iterator[None]:
    """Make `ctx` the context the attention op reads while the block runs. With `native` (the
    graph calls `portside_cpu_native::attention`, `native_ops`), a decode-only step's native plan
    (`kernels.DecodeStep`) is also installed for the C++ operator, which then runs every layer
    without calling back into Python."""
    global _current
    previous, _current = _current, ctx
    step = getattr(ctx.metadata.backend_data, "native_step", None) if native else None
    if step is not None:
        torch.ops.portside_cpu_native.set_decode_step(ctx.kv_caches, *step.tensors)
    try:
        yield
    finally:
        _current = previous
        if step is not None:
            torch.ops.portside_cpu_native.clear_decode_step()


def feature_args(features: dict[str, Any]) -> tuple[int, float]:
    """A layer's attention features (`PiecewiseModel.attention_features`) as the op's trailing
    arguments (sliding_window, logit_softcap), 0 for one not used."""
    unknown = set(features) - set(ATTENTION_FEATURES)
    if unknown:
        raise ValueError(f"attention features {sorted(unknown)} are not among {ATTENTION_FEATURES}")
    return int(features.get("sliding_window") or 0), float(features.get("logit_softcap") or 0.0)


def sinks_arg(features: dict[str, Any]) -> torch.Tensor | None:
    """A layer's attention sinks (`ATTENTION_FEATURES` "sinks": [heads] fp32), the last argument of
    `portside_cpu::attention_sinks`, or None (the layer calls `portside_cpu::attention`)."""
    return features.get("sinks")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float, sliding_window: int = 0,
              logit_softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]: layer `layer`'s paged attention in the current step
    (writes k/v into that layer's cache first); features as `feature_args` / `sinks_arg` give them."""
    if _current is None:
        raise RuntimeError("portside_cpu::attention called outside forward_context(ctx)")
    out = _current.attention(layer, q, k, v, scale, sliding_window=sliding_window or None,
                             logit_softcap=logit_softcap or None, sinks=sinks)
    if out.untyped_storage().data_ptr() == q.untyped_storage().data_ptr():
        return out.clone()  # an operator's output may not alias its inputs
    return out.contiguous()  # the strides the fake implementation promised


# Registered with `torch.library.Library` rather than `custom_op`: the compiled graph calls it once
# per layer, and the dispatcher's plain Python kernel costs ~5 us a call against ~12 for
# custom_op's wrapper (autograd and aliasing checks this op does not need).
_lib = torch.library.Library("portside_cpu", "FRAGMENT")
_lib.define("attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int sliding_window=0, "
            "float logit_softcap=0.0) -> Tensor")
_lib.impl("attention", attention, "CPU")
_lib.define("attention_sinks(Tensor q, Tensor k, Tensor v, int layer, float scale, int sliding_window, "
            "float logit_softcap, Tensor sinks) -> Tensor")
_lib.impl("attention_sinks", attention, "CPU")


def attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float, sliding_window: int = 0,
                   logit_softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


torch.library.register_fake("portside_cpu::attention", attention_fake)
torch.library.register_fake("portside_cpu::attention_sinks", attention_fake)
