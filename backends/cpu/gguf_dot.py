"""GGUF weights times 8-bit activations on the cpu: the Python side of
``portside_cpu_native::gguf_dot`` (`csrc/gguf_dot.cpp`, `csrc/gguf_dot_q8.cpp`, `csrc/gguf_dot_k.cpp`).

llama.cpp multiplies its blocks with activations quantized on the fly (Q8_0 x Q8_0, K-quants x
Q8_K): each block's dot product is an exact integer, scaled once in fp32. The kernels here do the
same arithmetic (`portside.quant.gguf_dot_ref`, the pure-torch reference), on the raw blocks as
the file stores them, with a scalar, an AVX2 and an AVX-512 VNNI path chosen at run time (`isas`;
tests force each). `quant.CpuQuantOps` runs them for GGUF weights of the types in `TYPES` when
backend option ``cpu_gguf_act`` is ``int8``; ``fp32`` (the default) keeps the weight-only kernels
of `csrc/quant_gemm.cpp` (activations in fp32; IQ4_XS: the reference).

Why fp32 stays the default: greedy decoding must equal transformers' on the dequantized weights
(tests/test_quant_gguf.py), and rounding the activations to 8 bits moves a tiny random model's
logits enough to flip near-tied tokens (6 of the 11 parity cases part after a few tokens); with
``int8`` the tokens agree where transformers' top-2 margin is clear (the same check as against
llama.cpp, which always rounds them).
"""

from __future__ import annotations

import functools

import torch

from portside.backends.cpu import native_ops

__all__ = ["TYPES", "ISAS", "GGUF_ACTS", "DEFAULT_GGUF_ACT", "isas", "linear", "quantize"]

# ggml type -> name: the types with an int8-activation kernel
TYPES = {8: "Q8_0", 2: "Q4_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 23: "IQ4_XS"}
# backend option cpu_gguf_act: the activations of GGUF weights in `TYPES`
GGUF_ACTS = ("int8", "fp32")
DEFAULT_GGUF_ACT = "fp32"
# a path's name -> the operator's `isa` argument (0: the best one here)
ISAS = {"best": 0, "scalar": 1, "avx2": 2, "avx512vnni": 3}


@functools.lru_cache(maxsize=1)
def isas() -> tuple[str, ...]:
    """The paths the native library runs on this CPU, e.g. ("scalar", "avx2", "avx512vnni"); ()
    without the library."""
    if native_ops.unavailable_reason() is not None:
        return ()
    return tuple(str(torch.ops.portside_cpu_native.gguf_dot_isas()).split(","))


def linear(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None,
           isa: str = "best") -> torch.Tensor:
    """y [T, N] = x [T, K] . W^T (+ bias) in x's dtype (fp32 or bf16): W uint8 GGUF rows
    [N, row_bytes] of a type in `TYPES`, x quantized per block to int8 as the kernel goes."""
    return torch.ops.portside_cpu_native.gguf_dot(x, qweight, ggml_type, bias, ISAS[isa])


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] as the kernels quantize it: (int8 codes [T, K], fp32 scales [T, K / block])."""
    return torch.ops.portside_cpu_native.gguf_dot_quantize(x, block)
