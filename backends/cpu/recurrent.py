"""The cpu backend's recurrent-layer kernels: `CpuRecurrentOps`, the `ModelOps` mixin that
`moe.CpuModelOps` inherits, over the native operators of `csrc/recurrent.cpp`
(``portside_cpu_native::causal_conv1d``, ``ssd_scan``, ``selective_scan``,
``gated_delta_rule``).

Each kernel runs a step's requests in C++ (their tokens in order, the state of a head's block of
rows in L1, heads and blocks side by side on the OpenMP threads), in fp32 whatever the inputs'
dtype, as core's references (`portside.ops.recurrent`) define it. A call the operators were not
written for takes the reference (``super()``): before the native library is built (`native_ops.ready`),
activations other than fp32/bf16, states other than fp32/bf16, tensors off the CPU, an
activation the reference refuses (it says why).
"""

from __future__ import annotations

import math

import torch

from portside.backends.cpu import native_ops
from portside.contract import RecurrentKernels, RecurrentMetadata

DTYPES = (torch.float32, torch.bfloat16)


def _native(md: RecurrentMetadata, *tensors: torch.Tensor | None) -> bool:
    """Whether the native operators are loaded and take these tensors (None: an absent operand)."""
    return (native_ops.ready() and md.query_start_loc.device.type == "cpu"
            and all(t is None or (t.device.type == "cpu" and t.dtype in DTYPES) for t in tensors))


def _md(md: RecurrentMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return md.query_start_loc, md.state_slots, md.has_initial_state


class CpuRecurrentOps(RecurrentKernels):
    """`RecurrentKernels` over the native operators (above), ``super()`` where they do not apply."""

    def causal_conv1d(self, x, weight, bias, conv_state, md, activation="silu"):
        if activation in (None, "silu") and _native(md, x, conv_state):
            return torch.ops.portside_cpu_native.causal_conv1d(x, weight, bias, conv_state, *_md(md), activation == "silu")
        return super().causal_conv1d(x, weight, bias, conv_state, md, activation)

    def ssd_scan(self, x, dt, A, B, C, ssm_state, md, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, math.inf)):
        if _native(md, x, B, C, ssm_state):
            return torch.ops.portside_cpu_native.ssd_scan(x, dt, A, B, C, ssm_state, *_md(md), D, dt_bias, dt_softplus,
                                                          float(dt_limit[0]), float(dt_limit[1]))
        return super().ssd_scan(x, dt, A, B, C, ssm_state, md, D, dt_bias, dt_softplus, dt_limit)

    def selective_scan(self, x, dt, A, B, C, ssm_state, md, D=None, z=None, dt_bias=None, dt_softplus=True):
        if _native(md, x, B, C, z, ssm_state):
            return torch.ops.portside_cpu_native.selective_scan(x, dt, A, B, C, ssm_state, *_md(md), D, z, dt_bias,
                                                                dt_softplus)
        return super().selective_scan(x, dt, A, B, C, ssm_state, md, D, z, dt_bias, dt_softplus)

    def gated_delta_rule(self, q, k, v, g, beta, state, md, scale, use_qk_l2norm=True):
        if q.dtype == k.dtype == v.dtype and _native(md, q, k, v, state):
            return torch.ops.portside_cpu_native.gated_delta_rule(q, k, v, g, beta, state, *_md(md), float(scale),
                                                                  use_qk_l2norm)
        return super().gated_delta_rule(q, k, v, g, beta, state, md, scale, use_qk_l2norm)
