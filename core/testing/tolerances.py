"""Per-dtype tolerances for kernel-vs-reference comparisons, in one table.

fp32: torch.testing.assert_close defaults. fp16/bf16: vLLM's FlashAttention test tolerances for
paged attention (the reference computes in fp32; the kernels accumulate in fp32 too, the
difference is the inputs' and outputs' rounding).

8-bit KV caches (`--kv-cache-dtype`) are not bit-exact: `KV_CACHE_TOLERANCES` bounds attention
over a cache of that dtype against attention over the exact values (measured on the conformance
kit's shapes with N(0, 1) keys and values: max abs error 0.18 e4m3, 0.32 e5m2, 0.031 int8, mostly
at short sequences, where an output is one or two quantized values), and the kit allows the same
between a backend's 8-bit attention and the reference's (`portside.contract.quantize_kv`
formats); `KV_ROUND_TRIP` bounds one stored element (one quantization step: an implementation
may round differently from the reference).

Shared by portside's own kernel tests and the conformance kit (`portside.testing.conformance`).
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "QUANT_REL_TOLERANCE", "KV_CACHE_TOLERANCES", "KV_ROUND_TRIP", "assert_close",
           "kv_round_trip_bound"]

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


KV_CACHE_TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float8_e4m3fn: {"atol": 0.25, "rtol": 2**-4},
    torch.float8_e5m2: {"atol": 0.5, "rtol": 2**-3},
    torch.int8: {"atol": 0.06, "rtol": 0.0},
}

# |stored - x| <= rtol * |x| + atol + row * amax(|x| over the row's head_size values)
KV_ROUND_TRIP: dict[torch.dtype, dict[str, float]] = {
    torch.float8_e4m3fn: {"rtol": 2**-3, "atol": 2**-9, "row": 0.0},  # 3 mantissa bits; subnormal step 2^-9
    torch.float8_e5m2: {"rtol": 2**-2, "atol": 2**-16, "row": 0.0},
    torch.int8: {"rtol": 0.0, "atol": 1e-6, "row": 1 / 127 * (1 + 1e-5)},  # a step of the row's scale
}


def kv_round_trip_bound(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The largest error `KV_ROUND_TRIP` allows for each element of K/V rows x [..., head_size]
    stored in a cache of `cache_dtype` and read back."""
    tol = KV_ROUND_TRIP[cache_dtype]
    xf = x.float().abs()
    return tol["rtol"] * xf + tol["atol"] + tol["row"] * xf.amax(dim=-1, keepdim=True)


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
