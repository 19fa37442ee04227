"""The encoder models' fusable dense layers (`portside.model.bert_base.dense_act` / `dense_add`)
in the cpu eager runner: one oneDNN call over the prepacked weight with the activation or the
residual add as its post-op, instead of the linear and then a second pass over its output.

BERT's MLP output is [T, 4H]: at 8192 rows of a MiniLM-sized model a fresh 50 MB tensor that the
separate GELU reads and writes again, and every layer adds its residual in another pass over
[T, H]. oneDNN applies both while the output tile is still in registers (`_linear_pointwise` with
the "gelu" post-op, erf or tanh as transformers' activation names it; `_linear_pointwise.binary`
"add"). What it cannot take (another activation, a widened bf16 weight, a residual of another
shape or dtype, one row) runs core's reference, its linear still through the runner's mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from portside.model.bert_base import dense_act, dense_act_reference, dense_add, dense_add_reference

__all__ = ["FUSED", "fused_dense"]

# transformers' activation name -> oneDNN's GELU algorithm
GELU_ALGORITHMS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
FUSED: dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = {
    dense_act: dense_act_reference,
    dense_add: dense_add_reference,
}


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if rows > t.shape[0] else t


def fused_dense(func: Callable[..., torch.Tensor], args: tuple[Any, ...], packed: Any,
                padded_rows: Callable[[int], int]) -> torch.Tensor | None:
    """`func(*args)` (one of `FUSED`) as one oneDNN call over `packed.get(weight)`, rows padded to
    `padded_rows`; None where it does not apply (the caller runs the reference)."""
    x, weight, bias, extra = args
    if x.dim() != 2 or x.shape[0] < 2 or x.dtype != weight.dtype or not x.is_contiguous():
        return None
    if bias is not None and bias.dtype != x.dtype:
        return None
    pk = packed.get(weight)
    if pk is None or pk.dtype != x.dtype:  # not packed, or widened bf16 (`EagerLinears` handles it)
        return None
    rows = x.shape[0]
    padded = padded_rows(rows)
    if func is dense_act:
        algorithm = GELU_ALGORITHMS.get(extra)
        if algorithm is None:
            return None
        return torch.ops.mkldnn._linear_pointwise(_pad(x, padded), pk, bias, "gelu", [], algorithm)[:rows]
    if extra.shape != (rows, weight.shape[0]) or extra.dtype != x.dtype or not extra.is_contiguous():
        return None
    return torch.ops.mkldnn._linear_pointwise.binary(_pad(x, padded), _pad(extra, padded), pk, bias, "add")[:rows]
