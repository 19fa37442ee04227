"""Quantized-weight contract: the platform's `ModelOps.prepare_quantized` + `quantized_linear`
(and `quantized_moe_experts`) equal core's reference (`portside.quant.weight`: dequantize, then
matmul) for every canonical layout: int8 per channel, int4 per group with and without zeros and
with act order (g_idx), fp8 (per channel, and block-wise: DeepSeek-V3's 128x128 scales and partial
blocks), MXFP4 (gpt-oss experts), int8 and fp8 activations rounded per token (W8A8), and GGUF
blocks.
A platform that overrides nothing runs the reference itself and passes.

Weight-only layouts use the dtype table (`TOLERANCES`, fp32 loosened for the summation order of
a K-long dot product); with activations rounded per token a kernel may round a value that sits
on a rounding boundary the other way, so those compare by relative error of the whole output
(`QUANT_REL_TOLERANCE`).
"""

from __future__ import annotations

import pytest
import torch

from portside.contract import ModelOps, Platform
from portside.ops.moe import select_experts
from portside.quant.fp8_block import quantize_fp8_block
from portside.quant.mxfp4 import mxfp4_weight
from portside.quant.weight import QuantWeight, pack_int4, quantize_per_channel, quantized_linear
from portside.testing.conformance.cases import contract_failure, engine_config
from portside.testing.tolerances import QUANT_REL_TOLERANCE, TOLERANCES

# (tokens, in K, out N): a decode row, an odd batch, a prefill chunk
SHAPES = ((1, 128, 96), (5, 256, 40), (33, 128, 72))


def _int_weight(n: int, k: int, bits: int, group: int, zeros: bool, act_order: bool, gen: torch.Generator) -> QuantWeight:
    groups = k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005) / (1 << (bits - 4))  # weights ~0.05 whatever the bits
    z = torch.randint(0, 1 << bits, (n, groups), generator=gen).float() if zeros else None
    g_idx = torch.randperm(k, generator=gen) // group if act_order else None
    return QuantWeight("int", (n, k), pack_int4(codes) if bits == 4 else codes, bits=bits, scales=scales, zeros=z,
                       group_size=group, g_idx=None if g_idx is None else g_idx.to(torch.int32), method=f"int{bits}")


def _gguf_weight(n: int, k: int, qtype: str, gen: torch.Generator) -> QuantWeight | None:
    try:
        import gguf
        import numpy as np
        from gguf.quants import quantize
    except ImportError:
        return None
    t = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[t][0]
    if k % block:
        return None
    w = (torch.randn(n, k, generator=gen) * 0.05).numpy()
    try:
        data = torch.from_numpy(np.ascontiguousarray(quantize(w, t)).view(np.uint8).reshape(n, -1).copy())
    except NotImplementedError:  # gguf's Python package has no quantizer for the K-quants: random blocks
        data = _random_blocks(n, k, t, gen)
    return QuantWeight("gguf", (n, k), data, ggml_type=int(t), method="gguf")


# where the fp16 super-block scales sit in a K-quant block (d, and dmin where there is one), and a
# d that makes the weights ~0.05 (random sub-block scales and codes multiply it by up to ~1000)
_K_SCALES = {"Q4_K": ((0, 2), 2e-4), "Q5_K": ((0, 2), 1e-4), "Q6_K": ((208,), 5e-5), "Q3_K": ((108,), 4e-4),
             "Q2_K": ((80, 82), 3e-3)}


def _random_blocks(n: int, k: int, t, gen: torch.Generator) -> torch.Tensor:
    """Random K-quant blocks with sane fp16 scales (random bytes there could be inf or NaN)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[t]
    blocks = torch.randint(0, 256, (n * k // block, size), generator=gen, dtype=torch.int32).to(torch.uint8)
    offsets, scale = _K_SCALES[t.name]
    for off in offsets:
        d = (torch.rand(blocks.shape[0], generator=gen) * scale + scale / 4).half()
        blocks[:, off : off + 2] = d.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def _cases(n: int, k: int, gen: torch.Generator) -> list[tuple[str, QuantWeight]]:
    w = torch.randn(n, k, generator=gen) * 0.05
    cases = [
        ("int8 per channel", quantize_per_channel(w, "int8")),
        ("int8 per channel, int8 activations", quantize_per_channel(w, "int8", "int8")),
        ("int4 group 32, symmetric", _int_weight(n, k, 4, 32, False, False, gen)),
        ("int4 group 64, zeros", _int_weight(n, k, 4, 64, True, False, gen)),
        ("int4 group 32, zeros, act order", _int_weight(n, k, 4, 32, True, True, gen)),
        ("int8 group 32, zeros, act order", _int_weight(n, k, 8, 32, True, True, gen)),
        ("fp8 per channel", quantize_per_channel(w, "fp8", None)),
        ("fp8 per channel, fp8 activations", quantize_per_channel(w, "fp8", "fp8")),
    ]
    for block in ((128, 128), (32, 64), (48, 96)):  # whole blocks; partial blocks at the edges
        cases.append((f"fp8 {block[0]}x{block[1]} blocks", quantize_fp8_block(w, block)))
    grouped = quantize_fp8_block(w, (32, 32))
    grouped.act, grouped.act_group = "fp8", 32  # compressed-tensors FP8_BLOCK: fp8 activations per token and 32 columns
    cases.append(("fp8 32x32 blocks, fp8 activations per 32-column group", grouped))
    cases.append(("mxfp4", mxfp4_weight(w)))
    static = quantize_per_channel(w, "fp8", "fp8")
    static.input_scale = torch.tensor([3.0 / 448])
    cases.append(("fp8, static input scale", static))
    for qtype in ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"):
        g = _gguf_weight(n, k, qtype, gen)
        if g is not None:
            cases.append((f"gguf {qtype}", g))
    return cases


@pytest.fixture(scope="module")
def model_ops(conformance_platform: type[Platform]) -> dict[torch.dtype, ModelOps]:
    platform = conformance_platform
    return {dtype: platform.model_ops(engine_config(platform, dtype, platform.default_block_size))
            for dtype in platform.supported_dtypes}  # fmt: skip


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, rounded_acts: bool, what: str) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        contract_failure("quantized-ops", f"{what} returned {tuple(got.shape)} {got.dtype}; expected "
                         f"{tuple(want.shape)} {want.dtype}")  # fmt: skip
    got, want = got.cpu().float(), want.float()
    if rounded_acts:
        rel = ((got - want).norm() / want.norm().clamp(min=1e-12)).item()
        if rel > QUANT_REL_TOLERANCE:
            contract_failure("quantized-ops", f"{what}: relative error {rel:.2e} > {QUANT_REL_TOLERANCE}")
        return
    tol = TOLERANCES[dtype]
    atol = max(tol["atol"], 1e-4) if dtype == torch.float32 else tol["atol"]
    err = (got - want).abs()
    bad = err > atol + tol["rtol"] * want.abs()
    if bad.any():
        contract_failure("quantized-ops", f"{what} differs from core's reference: {int(bad.sum())} of {bad.numel()} "
                         f"out of tolerance, max abs err {err.max().item():.3e}")  # fmt: skip


def test_quantized_linear_matches_reference(conformance_platform: type[Platform], model_ops) -> None:
    device, gen = conformance_platform.device(0), torch.Generator().manual_seed(7)
    for dtype, ops in model_ops.items():
        for t, k, n in SHAPES:
            x = torch.randn(t, k, generator=gen).to(dtype)
            bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
            for name, canonical in _cases(n, k, gen):
                want = quantized_linear(x, canonical, bias)  # the reference, on the host, in x's dtype
                prepared = ops.prepare_quantized(canonical.to(device))
                got = ops.quantized_linear(x.to(device), prepared, bias.to(device))
                _check(got, want, dtype, canonical.act is not None,
                       f"{type(ops).__name__}.quantized_linear ({name}, T={t}, K={k}, N={n}, {dtype})")


def test_quantized_moe_experts_matches_reference(conformance_platform: type[Platform], model_ops) -> None:
    device, gen = conformance_platform.device(0), torch.Generator().manual_seed(8)
    t, hidden, inter, e, k = 7, 128, 64, 4, 2
    quantizers = {"int8": lambda w: quantize_per_channel(w, "int8"), "fp8 32x32 blocks": lambda w: quantize_fp8_block(w, (32, 32)),
                  "mxfp4": mxfp4_weight}
    for dtype, ops in model_ops.items():
        for what, quantize in quantizers.items():
            x = torch.randn(t, hidden, generator=gen).to(dtype)
            w13 = quantize(torch.randn(e, 2 * inter, hidden, generator=gen) * hidden**-0.5)
            w2 = quantize(torch.randn(e, hidden, inter, generator=gen) * inter**-0.5)
            weights, ids = select_experts(torch.randn(t, e, generator=gen), k, True)
            want = ModelOps().quantized_moe_experts(x, w13, w2, weights, ids)
            got = ops.quantized_moe_experts(x.to(device), ops.prepare_quantized(w13.to(device)),
                                            ops.prepare_quantized(w2.to(device)), weights.to(device), ids.to(device))
            _check(got, want, dtype, False, f"{type(ops).__name__}.quantized_moe_experts ({what} experts, {dtype})")
