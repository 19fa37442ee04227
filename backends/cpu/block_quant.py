"""The cpu backend's linears over block-scaled weights: block-wise fp8 (``kind == "fp8"`` with
``block``: DeepSeek-V3, FineGrainedFP8) and ``mxfp4`` (gpt-oss experts), kept in their checkpoint
codes and decoded tile by tile inside the matmul.

- native: ``portside_cpu_native::block_quant_linear`` (`csrc/block_quant.cpp`): 32 columns at
  a time, AVX-512, AVX2 or portable C++ as the build's CPU has them (``block_quant_isa``);
- torch: where the library is not built (or a weight's shape is not one it takes): the weight's
  rows dequantized `TILE_ROWS` at a time into the activation's dtype (core's reference on each
  tile) and multiplied, so the dense copy alive at once is one tile, never the matrix.

`prepare` records the choice as ``weight.layout`` (a `BlockLayout`); the canonical buffers are
left as loaded (nothing is copied: the resident weight is the checkpoint's bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portside.contract import ModelOps, QuantWeight, quantize_activation

FMT_FP8_BLOCK, FMT_MXFP4 = 0, 1  # csrc/block_quant.cpp
TILE_ROWS = 256  # torch path: weight rows dequantized per matmul
X_DTYPES = (torch.float32, torch.bfloat16)
_REFERENCE = ModelOps()  # core's reference quantized linear, for the torch path's tiles


@dataclass(frozen=True)
class BlockLayout:
    """What `prepare` chose for one block-scaled weight."""

    kernel: str  # "native" or "torch"
    fmt: int
    block: tuple[int, int]  # (rows, columns) per scale


def is_block_scaled(w: QuantWeight) -> bool:
    return w.kind == "mxfp4" or (w.kind == "fp8" and w.block is not None)


def prepare(w: QuantWeight, native: bool) -> QuantWeight:
    """Record the kernel for a block-scaled weight (`native`: the library is loaded)."""
    fmt, block = (FMT_MXFP4, (1, 32)) if w.kind == "mxfp4" else (FMT_FP8_BLOCK, w.block)
    assert block is not None
    n, k = w.shape
    fits = k % 32 == 0 and block[1] % 32 == 0 and w.qweight.device.type == "cpu"
    if not w.qweight.is_contiguous():
        w.qweight = w.qweight.contiguous()
    if w.scales is not None and not w.scales.is_contiguous():
        w.scales = w.scales.contiguous()
    w.layout = BlockLayout("native" if native and fits else "torch", fmt, block)
    return w


def linear(x: torch.Tensor, w: QuantWeight, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias) for one weight's (or one expert's) `codes` and `scales`."""
    layout: BlockLayout = w.layout
    if w.act is not None:  # compressed-tensors FP8_BLOCK: rounded as the reference does, then weight-only
        x = quantize_activation(x, w.act, w.input_scale, getattr(w, "act_group", 0))
    if layout.kernel == "native" and x.dtype in X_DTYPES:
        return torch.ops.portside_cpu_native.block_quant_linear(x, codes, scales, bias, layout.fmt, *layout.block)
    return tiled_linear(x, w.kind, codes, scales, layout.block, bias)


def tiled_linear(x: torch.Tensor, kind: str, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None) -> torch.Tensor:
    """The torch path: `TILE_ROWS` rows of the weight at a time (a whole number of block rows),
    each tile a `QuantWeight` of its own through core's reference (which dequantizes only it)."""
    n, k = codes.shape[0], x.shape[-1]
    step = TILE_ROWS if kind == "mxfp4" else max(block[0], TILE_ROWS // block[0] * block[0])
    out = x.new_empty((x.shape[0], n))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        if kind == "mxfp4":
            tile = QuantWeight("mxfp4", (r1 - r0, k), codes[r0:r1], bits=4, scales=scales[r0:r1], group_size=32)
        else:
            tile = QuantWeight("fp8", (r1 - r0, k), codes[r0:r1], scales=scales[r0 // block[0]: -(-r1 // block[0])],
                               group_size=block[1], block=block)
        out[:, r0:r1] = _REFERENCE.quantized_linear(x, tile)
    if bias is not None:
        out += bias.to(out.dtype)
    return out
