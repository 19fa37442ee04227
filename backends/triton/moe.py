"""Fused mixture-of-experts: the routed tokens of every expert in two grouped-GEMM launches.

The approach of vLLM's fused_moe, written afresh. The ``P = T * top_k`` (token, slot) pairs,
flat index ``pair = t * top_k + j``, are grouped by expert and each expert's run is padded to a
multiple of ``BLOCK_M`` (`align_pairs`: torch ops on the device), so every ``BLOCK_M`` rows of
the sorted list belong to one expert. Then, with ``I`` the intermediate size:

1. ``h[pair] = act(gate, up)`` with ``gate, up = x[t] @ w13[e]^T (+ w13_bias[e])``: one launch,
   the gate and up tiles accumulated side by side in each program ([P, I] in x's dtype);
2. ``y[pair] = topk_weights[pair] * (h[pair] @ w2[e]^T (+ w2_bias[e]))``: the same kernel
   ([P, hidden]);
3. ``out[t] = sum_j y[t * top_k + j]`` (torch), [T, hidden] in x's dtype.

Grids are bounds computed from shapes (``P + E * (BLOCK_M - 1)`` sorted rows at most); programs
past the padded total, a device scalar, return at once. Nothing is read back to the host, so a
CUDA/HIP graph can capture `fused_experts`. No atomics: the result does not depend on timing.

Numerics: fp32 accumulation. On GPUs half-precision operands go to ``tl.dot`` as they are; under
the interpreter (whose bf16 dot is wrong) they are upcast to fp32 on load (`MoeLaunch.upcast`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from portside.backends.triton.launch import ArchInfo, MoeLaunch, choose_moe_launch, detect_arch
from portside.backends.triton.lora import TritonLoRAOps
from portside.backends.triton.quant import TritonQuantOps
from portside.backends.triton.recurrent import TritonRecurrentOps
from portside.contract import ModelOps
from portside.contract.model_ops import SWIGLU_OAI_ALPHA

__all__ = ["align_pairs", "fused_experts", "TritonModelOps"]

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # GATED: x [T, K]; else h [P, K]
    w_ptr,  # GATED: w13 [E, 2N, K] (gate rows, then up rows); else w2 [E, N, K]
    c_ptr,  # [P, N]
    sorted_pairs_ptr,  # [max_rows] int32: pairs grouped by expert, num_pairs in padding rows
    block_experts_ptr,  # [max_rows // BLOCK_M] int32: the expert of each BLOCK_M rows
    num_rows_ptr,  # [1] int32: sorted rows in use
    topk_weights_ptr,  # [P] fp32 (ROUTED_WEIGHT)
    bias_ptr,  # HAS_BIAS: GATED: w13_bias [E, 2N]; else w2_bias [E, N]
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_be,
    swiglu_alpha,
    swiglu_limit,
    A_ROW_DIV: tl.constexpr,  # pair -> row of a: top_k (rows are tokens) or 1 (rows are pairs)
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "silu", "gelu_tanh" or "swiglu_oai" (GATED)
    ROUTED_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (M,)
    row_ok = pair < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + (pair // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]  # (M, K)
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # (K, N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GATED only
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                up = up.to(tl.float32)
            acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + expert * stride_be + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == "silu":
            acc = acc * tl.sigmoid(acc) * acc_up
        elif ACTIVATION == "swiglu_oai":
            acc = tl.minimum(acc, swiglu_limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
            acc = acc * tl.sigmoid(swiglu_alpha * acc) * (acc_up + 1.0)
        else:
            # gelu_tanh(g) = g * sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3))
            acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)) * acc_up
    if ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs of `topk_ids` [T, top_k] by expert, each expert's run padded
    to a multiple of `block_m` rows. Device ops only (no host sync).

    Returns ``sorted_pairs`` [max_rows] int32 (flat pair indices, P in padding rows),
    ``block_experts`` [max_rows // block_m] int32 (clamped to the last expert past the end) and
    ``num_rows`` [1] int32 (rows in use), with ``max_rows = ceil((P + E * (block_m - 1)) / block_m)
    * block_m``, the most any routing needs.
    """
    flat = topk_ids.flatten().long()  # [P]
    num_pairs, device = flat.numel(), flat.device
    max_rows = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # pair indices, grouped by expert
    expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert]  # within its expert
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(padded_end - padded)[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, max_rows, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_experts, padded_end[-1:].to(torch.int32)


def fused_experts(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2I, hidden]
    w2: torch.Tensor,  # [E, hidden, I]
    topk_weights: torch.Tensor,  # [T, top_k] fp32
    topk_ids: torch.Tensor,  # [T, top_k] int64
    activation: str = "silu",
    launch: MoeLaunch | None = None,
    *,
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    w2_bias: torch.Tensor | None = None,  # [E, hidden]
    swiglu_alpha: float = SWIGLU_OAI_ALPHA,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """`portside.ops.moe.moe_experts` in two Triton launches: [T, hidden] in x's dtype. The
    biases are added to the fp32 accumulators (before the activation, before the routing weight)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoE activation {activation!r} is not one of {ACTIVATIONS}")
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter)
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    launch = launch or choose_moe_launch(detect_arch(x.device), num_pairs, num_experts, x.dtype)
    bm = launch.block_m
    sorted_pairs, block_experts, num_rows = align_pairs(topk_ids, num_experts, bm)
    weights = topk_weights.reshape(-1).float()  # [P]
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    common = dict(
        BLOCK_M=bm, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, PRECISION=launch.input_precision, UPCAST=launch.upcast
    )
    for a, w, c, row_div, gated, bias in ((x, w13, h, top_k, True, w13_bias), (h, w2, y, 1, False, w2_bias)):
        n = c.shape[1]
        if bias is not None:
            assert bias.shape == (num_experts, w.shape[1]), f"expert bias {tuple(bias.shape)} for weights {tuple(w.shape)}"
            bias = bias if bias.stride(-1) == 1 else bias.contiguous()
        _moe_gemm_kernel[(sorted_pairs.shape[0] // bm, triton.cdiv(n, launch.block_n))](
            a,
            w,
            c,
            sorted_pairs,
            block_experts,
            num_rows,
            weights,
            weights if bias is None else bias,
            num_pairs,
            n,
            a.shape[1],
            a.stride(0),
            w.stride(0),
            w.stride(1),
            w.stride(2),
            c.stride(0),
            0 if bias is None else bias.stride(0),
            float(swiglu_alpha),
            float(swiglu_limit),
            A_ROW_DIV=row_div,
            GATED=gated,
            ACTIVATION=activation,
            ROUTED_WEIGHT=not gated,
            HAS_BIAS=bias is not None,
            **common,
            **launch.kernel_options(),
        )
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


class TritonModelOps(TritonRecurrentOps, TritonLoRAOps, TritonQuantOps, ModelOps):
    """`ModelOps` whose `moe_experts` is the fused Triton kernel, whose quantized linear layers
    are the Triton kernels of `portside.backends.triton.quant`, whose multi-LoRA shrink and
    expand are those of `portside.backends.triton.lora` and whose recurrent-layer kernels are
    those of `portside.backends.triton.recurrent`; routing (`select_experts`, a softmax and a
    top-k) stays core's torch reference."""

    name = "triton"

    def __init__(self, arch: ArchInfo | None = None) -> None:
        """`arch`: override device detection (tests)."""
        self._arch = arch

    def moe_experts(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        swiglu_alpha: float = SWIGLU_OAI_ALPHA,
        swiglu_limit: float = 7.0,
    ) -> torch.Tensor:
        if self._arch is None:
            self._arch = detect_arch(x.device)
        launch = choose_moe_launch(self._arch, topk_ids.numel(), w13.shape[0], x.dtype)
        return fused_experts(
            x, w13, w2, topk_weights, topk_ids, activation, launch, w13_bias=w13_bias, w2_bias=w2_bias,
            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
        )  # fmt: skip
