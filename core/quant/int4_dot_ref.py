"""4-bit integer weights times 8-bit activations, in pure torch: the arithmetic of the cpu backend's
``portside_cpu_native::int4_dot`` kernel (`backends/cpu/csrc/int4_dot.cpp`), written out so the
kernel can be checked to the ulp.

The weight is portside's canonical int4 (`portside.quant.weight`): codes q [N, K] in [0, 16) packed
two a byte, scales s and zero points z [N, G] (z whole numbers; None: 8), ``W[n, k] = (q - z) *
s`` with column k in group ``g_idx[k]`` (or ``k // group_size``). Act order (a ``g_idx`` that is
not ``k // group_size``) is computed on the columns sorted by group (stable), x gathered alike:
the sum is the same, and each group is then a run of consecutive columns.

The activations x [T, K] are quantized per block of ``act_block(group_size)`` = gcd(group_size,
128) consecutive (sorted) columns, as `gguf_dot_ref.quantize_activations` does (scale = amax /
127, codes = round-half-even(x / scale) in [-127, 127]). Each block gives one fp32 term per output:
``(s[n, g] * d_x[t, b]) * sum_k (q[n, k] - z[n, g]) * x_code[t, k]``, the integer sum exact; the
output is the fp32 sum of a row's terms (+ bias), in x's dtype. The kernel differs only in the
order of that fp32 sum and in converting the integer sum in SIMD lanes of 4 codes (each lane a
true signed dot product): a few ulps of the terms taken with those lanes' absolute values, which
`int4_dot` returns as the tolerance's scale.
"""

from __future__ import annotations

import math

import torch

from portside.quant.gguf_dot_ref import quantize_activations
from portside.quant.weight import unpack_int4

__all__ = ["act_block", "sorted_columns", "int4_dot"]


def act_block(group_size: int) -> int:
    """Columns per activation scale for weights of `group_size` (a multiple of 32)."""
    return math.gcd(group_size, 128)


def sorted_columns(g_idx: torch.Tensor | None, k: int, group_size: int) -> torch.Tensor | None:
    """The column order that makes every group consecutive (argsort of g_idx, stable), or None
    where it already is."""
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group_size):
        return None
    return torch.argsort(g_idx.long(), stable=True)


def int4_dot(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             group_size: int, g_idx: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [T, N] in x's dtype, the scale of a kernel's rounding [T, N] fp32) for x [T, K] and the
    canonical int4 weight (qweight uint8 [N, K / 2], scales and zeros [N, K / group_size])."""
    t, k = x.shape
    n = qweight.shape[0]
    if group_size % 32 or k % group_size or tuple(qweight.shape) != (n, k // 2) or qweight.dtype != torch.uint8:
        raise ValueError(f"int4 rows of {k} values in groups of {group_size} are uint8 [N, {k // 2}], got "
                         f"{tuple(qweight.shape)} {qweight.dtype} (groups a multiple of 32)")
    q = unpack_int4(qweight).to(torch.int32)  # [N, K]
    perm = sorted_columns(g_idx, k, group_size)
    if perm is not None:
        q, x = q.index_select(1, perm), x.index_select(1, perm)
    ab = act_block(group_size)
    nb = k // ab
    xq, xd = quantize_activations(x, ab)  # [T, K], [T, K / ab]
    groups = torch.arange(nb) * ab // group_size  # each activation block's weight group
    z = zeros.index_select(1, groups).round().to(torch.int32) if zeros is not None else torch.full((n, nb), 8, dtype=torch.int32)
    w = (q.reshape(n, nb, ab) - z.unsqueeze(-1)).reshape(n, nb, ab // 4, 4).double()  # signed codes, exact
    xs = xq.reshape(t, nb, ab // 4, 4).double()
    lanes = torch.einsum("nblj,tblj->tnbl", w, xs)  # the 4-code dot products, exact in float64
    scale = scales.float().index_select(1, groups).unsqueeze(0) * xd.unsqueeze(1)  # [T, N, B] fp32
    terms = scale * lanes.sum(-1).float()
    mags = scale.abs() * lanes.abs().sum(-1).float()
    y = terms.sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mags.sum(-1)
