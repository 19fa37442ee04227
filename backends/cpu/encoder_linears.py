"""The encoder models' dense layer with its residual add (`portside.model.bert_base.dense_add`,
recognised by its ``fusion`` attribute, `LINEAR_ADD`) in the cpu eager runner: one oneDNN call over the prepacked weight with the add as its binary
post-op (`_linear_pointwise.binary` "add"), instead of the linear and then a second pass over
its [T, H] output. What it cannot take (a widened bf16 weight, a residual of another shape or
dtype, one row) runs core's reference, its linear still through the runner's mode.

Measured on the shared Zen 3 (AVX2) dev VM, 2 threads, under load 10-16: 8192 x 1536 -> 384 fp32
with the add as post-op 132 ms of CPU time against 145 for the linear and then the add (min of 6);
the whole MiniLM-shaped step alternated in one process was within noise of the unfused one. The
GELU post-op (erf or tanh) is not used: the linear with it cost about what the linear and torch's
GELU did, and the whole step ran ~15% slower with it (15.4 against 17.8 s for 128 inputs, min of
three alternated runs, load 10).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LINEAR_ADD", "fused_dense"]

LINEAR_ADD = "linear+add"  # the ``fusion`` attribute of `dense_add` (backends do not import core's models)


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if rows > t.shape[0] else t


def fused_dense(func: Callable[..., torch.Tensor], args: tuple[Any, ...], packed: Any,
                padded_rows: Callable[[int], int]) -> torch.Tensor | None:
    """`func(*args)` (a `LINEAR_ADD` function, `dense_add`) as one oneDNN call over `packed.get(weight)`, rows padded to
    `padded_rows`; None where it does not apply (the caller runs the reference)."""
    x, weight, bias, residual = args
    if x.dim() != 2 or x.shape[0] < 2 or x.dtype != weight.dtype or not x.is_contiguous():
        return None
    if bias is not None and bias.dtype != x.dtype:
        return None
    pk = packed.get(weight)
    if pk is None or pk.dtype != x.dtype:  # not packed, or widened bf16 (`EagerLinears` handles it)
        return None
    rows = x.shape[0]
    if residual.shape != (rows, weight.shape[0]) or residual.dtype != x.dtype or not residual.is_contiguous():
        return None
    padded = padded_rows(rows)
    return torch.ops.mkldnn._linear_pointwise.binary(_pad(x, padded), _pad(residual, padded), pk, bias, "add")[:rows]
