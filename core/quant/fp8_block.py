"""Block-wise FP8 checkpoints (``quant_method: fp8`` with ``weight_block_size: [bn, bk]``: DeepSeek-V3/R1,
Qwen3-FP8, transformers' FineGrainedFP8): loading one layer's ``weight_scale_inv`` [ceil(N / bn),
ceil(K / bk)] into a fused layer's part or a tensor-parallel rank's shard.

The e4m3 ``weight`` loads like any other [N, K] tensor (`portside.quant.formats`); its scales are
one per bn x bk block, so a part or shard is a whole number of block rows (columns): each
fused part (q/k/v, gate/up, an expert's gate/up) must start on a block boundary of the fused
weight, and each rank's rows (columns) must start and end on one of the checkpoint's tensor. The
one exception is a tensor's last rows (columns), whose block may be partial (ceil) when it is the
last thing in this rank's weight too. Anything else is refused with the sizes that do not align
(a tensor-parallel size that splits the blocks evenly fixes it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

__all__ = ["block_scale_shape", "block_scale_loader", "quantize_fp8_block"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_scale_shape(block: tuple[int, int]) -> Callable[[int, int, int], tuple[int, ...]]:
    """(N, K, groups) of a rank's weight -> its scales' shape."""
    return lambda n, k, g: (_cdiv(n, block[0]), _cdiv(k, block[1]))


def _span(what: str, start: int, size: int, full: int, unit: int, dst_start: int, dst_full: int) -> tuple[int, int, int]:
    """(checkpoint block index, local block index, blocks) of rows/columns [start, start + size)
    of a tensor of `full`, placed at `dst_start` of this rank's `dst_full`; ValueError when they do
    not fall on `unit` boundaries."""
    ends_tensor = start + size == full and dst_start + size == dst_full
    if start % unit or dst_start % unit or (size % unit and not ends_tensor):
        raise ValueError(
            f"block-wise fp8 with {unit}-{what} blocks: {what} {start}..{start + size} of {full} (placed at {dst_start} of "
            f"{dst_full} on this rank) do not start and end on block boundaries, so the blocks' scales cannot be split "
            f"there; use a tensor-parallel size that splits every projection into whole {unit}-{what} blocks")
    return start // unit, dst_start // unit, _cdiv(size, unit)


def block_scale_loader(layer: Any, block: tuple[int, int], name: str = "weight_scale_inv") -> Callable[..., None]:
    """The weight loader of a layer's (or stacked experts' slot's) block scales (`name`:
    ``weight_scale_inv``, or compressed-tensors' ``weight_scale``)."""
    bn, bk = block

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if not loaded.is_floating_point():
            raise ValueError(f"{name} is stored as {loaded.dtype}, expected floating-point scales")
        key, dst = shard_id, param.data
        if getattr(layer, "stacked", False):
            e, shard_id = cast(tuple[int, str], shard_id)
            dst = dst[e]
        full_rows = layer.checkpoint_rows(shard_id)
        d0, s0, n = layer.out_partition(shard_id)
        cols = layer.in_partition()
        tp = getattr(layer, "tp_size", 1)
        full_cols = layer.in_local * tp if cols is not None else layer.in_local
        want = (_cdiv(full_rows, bn), _cdiv(full_cols, bk))
        if loaded.dim() != 2 or tuple(loaded.shape) != want:
            raise ValueError(f"{name} has shape {tuple(loaded.shape)}, expected {want}: one scale per "
                             f"{bn}x{bk} block of the [{full_rows}, {full_cols}] weight")
        r_src, r_dst, r_n = _span("row", s0, n, full_rows, bn, d0, layer.out_local)
        c0, csize = cols if cols is not None else (0, full_cols)
        c_src, _, c_n = _span("column", c0, csize, full_cols, bk, 0, layer.in_local)
        t = loaded.narrow(0, r_src, r_n).narrow(1, c_src, c_n)
        view = dst.narrow(0, r_dst, r_n)
        if tuple(view.shape) != tuple(t.shape):
            raise ValueError(f"{name} {tuple(loaded.shape)}: this rank's blocks {tuple(t.shape)} do not fit "
                             f"{tuple(view.shape)}")
        view.copy_(t)
        param.loaded_parts.add(key)  # type: ignore[attr-defined]

    return load


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> Any:
    """A dense [.., N, K] weight quantized to e4m3 per `block` (rows, columns) as transformers'
    FineGrainedFP8 does (scale_inv = amax / 448 per block), as a canonical `QuantWeight` (tests,
    conformance; partial last blocks allowed)."""
    from portside.quant.weight import FP8_MAX, QuantWeight, expand_block_scales

    n, k = w.shape[-2], w.shape[-1]
    bn, bk = block
    pad = torch.nn.functional.pad(w.float(), (0, _cdiv(k, bk) * bk - k, 0, _cdiv(n, bn) * bn - n))
    tiles = pad.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [.., N/bn, bn, K/bk, bk]
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / expand_block_scales(scale, block, n, k)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantWeight("fp8", (n, k), q, scales=scale, group_size=bk, block=block, method="fp8")
