"""4-bit integer weights times 8-bit activations on the cpu: the Python side of
``portside_cpu_native::int4_dot`` (`csrc/int4_dot.cpp`).

GPTQ, AWQ and compressed-tensors int4 weights, in portside's canonical layout (codes packed two a
byte, fp32 scales and zero points per group of 32, 64, 128... columns; act order as columns
sorted by group), multiplied with the activations quantized on the fly to int8 per block of
gcd(group_size, 128) columns: each block's integer dot product with the codes (less the zero
point times the codes' sum) is exact, scaled once in fp32 (`portside.quant.int4_dot_ref`, the
pure-torch reference). A scalar, an AVX2 and an AVX-512 VNNI path, chosen at run time from the
CPU's flags (`gguf_dot.isas`: the same paths; tests force each). `quant.CpuQuantOps` runs it for
weight-only int4 layers (layout kernel ``w4a8``) when backend option ``cpu_int4_act`` is
``int8``; ``fp32`` (the default) keeps the weight-only kernel of `csrc/quant_gemm.cpp`.

Why fp32 stays the default: as with GGUF (`gguf_dot`), rounding activations to 8 bits moves a
tiny random model's logits enough to flip near-tied greedy tokens, and greedy decoding must equal
transformers' on the dequantized weights.
"""

from __future__ import annotations

import torch

from portside.backends.cpu.gguf_dot import ISAS

__all__ = ["INT4_ACTS", "DEFAULT_INT4_ACT", "linear"]

# backend option cpu_int4_act: the activations of weight-only int4 layers
INT4_ACTS = ("int8", "fp32")
DEFAULT_INT4_ACT = "fp32"


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
           bias: torch.Tensor | None = None, isa: str = "best") -> torch.Tensor:
    """y [T, N] = x [T, K] . W^T (+ bias) in x's dtype (fp32 or bf16): W the canonical int4 codes
    uint8 [N, K / 2] with fp32 scales and zeros (None: 8) [N, K / group_size], groups of
    consecutive columns; x quantized per block to int8 as the kernel goes."""
    return torch.ops.portside_cpu_native.int4_dot(x, qweight, scales, zeros, group_size, bias, ISAS[isa])
