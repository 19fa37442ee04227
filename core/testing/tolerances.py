"""Per-dtype tolerances for kernel-vs-reference comparisons, in one table.

fp32: torch.testing.assert_close defaults. fp16/bf16: vLLM's FlashAttention test tolerances for
paged attention (the reference computes in fp32; the kernels accumulate in fp32 too, the
difference is the inputs' and outputs' rounding).

Shared by portside's own kernel tests and the conformance kit (`portside.testing.conformance`).
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "QUANT_REL_TOLERANCE", "assert_close"]

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.float16: {"atol": 1.5e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 1.5e-2, "rtol": 1e-2},
}

# A quantized matmul whose activations are rounded per token (W8A8, int8 or fp8) against the
# reference: relative error of the whole output, ||got - want|| / ||want||. A kernel may compute
# the token's scale in another order and round an activation on a boundary the other way (one
# int8 step, 1/127 of the token's range; one fp8 step, 1/16 of the value).
QUANT_REL_TOLERANCE = 1e-2


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, context: str = ""
) -> None:
    """`torch.testing.assert_close` with the table's tolerance for `dtype` (default: actual's);
    the failure message starts with `context` and adds the max and mean absolute error."""
    tol = TOLERANCES[dtype or actual.dtype]
    err = (actual.float() - expected.float()).abs()
    prefix = f"{context}\n" if context else ""
    torch.testing.assert_close(
        actual,
        expected,
        rtol=tol["rtol"],
        atol=tol["atol"],
        msg=lambda m: f"{prefix}{m}\nmax abs err {err.max().item():.3e}, mean abs err {err.mean().item():.3e}",
    )
