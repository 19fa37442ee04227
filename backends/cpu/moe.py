"""The cpu backend's `ModelOps`: mixture-of-experts grouped by expert.

`CpuModelOps.moe_experts` calls one opaque torch operator, so a compiled graph holds it as a
black box (its data-dependent grouping must not be traced):

- fp32, when the native operators build: ``portside_cpu_native::moe_experts`` (`csrc/moe.cpp`):
  the (token, slot) pairs sorted by expert, each expert's few token rows multiplied in one
  OpenMP region that reads each weight row once for up to 4 tokens (an expert with many tokens:
  a GEMM);
- otherwise ``portside_cpu::moe_experts`` below: the pairs sorted by expert once, then two
  matmuls per expert that received tokens, over its contiguous rows of the sorted tokens, and a
  weighted scatter-add; a single token just runs its k experts.

Nothing is done for an expert no token chose. Shapes as `portside.backend_api.ModelOps`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portside.backends.cpu import native_ops
from portside.backends.cpu.lora import CpuLoRAOps
from portside.backends.cpu.quant import CpuQuantOps
from portside.backends.cpu.recurrent import CpuRecurrentOps
from portside.contract import ModelOps
from portside.contract.model_ops import MOE_ACTIVATIONS, SWIGLU_OAI_ALPHA


def moe_experts(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2I, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [E, hidden, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    w2_bias: torch.Tensor | None = None,  # [E, hidden]
    swiglu_alpha: float = SWIGLU_OAI_ALPHA,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]): [T, hidden] in x's dtype,
    summed in fp32 (`portside.ops.moe.moe_experts`, grouped by expert)."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:  # rows [n, hidden] -> [n, hidden]
        gate, up = F.linear(rows, w13[e], _row(w13_bias, e, rows.dtype)).chunk(2, dim=-1)  # [n, I] each
        h = ModelOps.activate(gate, activation, up, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        return F.linear(h, w2[e], _row(w2_bias, e, h.dtype))

    num_tokens, k = topk_ids.shape
    if num_tokens == 1:  # a decode: its k experts, nothing to sort
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e, weight in zip(topk_ids[0].tolist(), topk_weights[0].tolist(), strict=True):
            out.add_(expert(e, x).float(), alpha=weight)
        return out.to(x.dtype)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # [T*k]: the (token, slot) pairs grouped by expert
    tokens = order // k  # [T*k]: each pair's token
    xs = x.index_select(0, tokens)  # [T*k, hidden]
    ys = torch.empty(xs.shape, dtype=x.dtype)
    start = 0
    for e, n in enumerate(torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()):  # pairs per expert
        if n:
            ys[start : start + n] = expert(e, xs[start : start + n])
            start += n
    ys = ys.float() * topk_weights.reshape(-1).index_select(0, order).float().unsqueeze(1)
    return torch.zeros(x.shape, dtype=torch.float32).index_add_(0, tokens, ys).to(x.dtype)


def _row(bias: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias[e].to(dtype)


# `torch.library.Library`, as `attention_op`: the dispatcher's plain Python kernel.
_lib = torch.library.Library("portside_cpu", "FRAGMENT")
_lib.define("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
            "str activation='silu', Tensor? w13_bias=None, Tensor? w2_bias=None, float swiglu_alpha=1.702, "
            "float swiglu_limit=7.0) -> Tensor")  # fmt: skip
_lib.impl("moe_experts", moe_experts, "CPU")


@torch.library.register_fake("portside_cpu::moe_experts")
def _moe_experts_fake(x, w13, w2, topk_weights, topk_ids, activation="silu", w13_bias=None, w2_bias=None,  # noqa: ANN001, ANN202
                      swiglu_alpha=SWIGLU_OAI_ALPHA, swiglu_limit=7.0):  # noqa: ANN001
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class CpuModelOps(CpuRecurrentOps, CpuLoRAOps, CpuQuantOps, ModelOps):
    """`ModelOps` with `moe_experts` grouped by expert (above), the quantized linears of
    `quant.CpuQuantOps` and the multi-LoRA kernels of `lora.CpuLoRAOps`; routing stays core's
    reference."""

    name = "cpu"

    def __init__(self, wait: bool = False) -> None:
        """`wait`: for a native library being built in the background (`native_ops.wait`; a
        quantized model's weights are laid out for its kernels as they load); else the experts
        take it once built (`moe_experts`)."""
        self.native = native_ops.wait("quantized weights are laid out for them") if wait else native_ops.ready()

    def moe_experts(
        self,
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation: str = "silu",
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        swiglu_alpha: float = SWIGLU_OAI_ALPHA,
        swiglu_limit: float = 7.0,
    ) -> torch.Tensor:
        if w13_bias is not None or w2_bias is not None or activation not in MOE_ACTIVATIONS:  # not in the native op
            return torch.ops.portside_cpu.moe_experts(
                x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_alpha, swiglu_limit
            )
        if not self.native and not torch.compiler.is_compiling():  # (a traced graph keeps its choice)
            self.native = native_ops.loaded()  # built in the background since (the step's start loaded it)
        native = self.native and x.dtype == w13.dtype == w2.dtype == torch.float32
        op = torch.ops.portside_cpu_native.moe_experts if native else torch.ops.portside_cpu.moe_experts
        return op(x, w13, w2, topk_weights, topk_ids, activation)
