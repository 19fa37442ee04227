"""Triton's weight-only GEMM on block-scaled weights vs core's reference
(`portside.quant.weight.quantized_linear`): block-wise FP8 (a scale per bn x bk block, partial
edge blocks, blocks narrower than a K tile and wider than it) and MXFP4 (e2m1 nibbles, e8m0
scales), fp32 and bf16, decode and prefill row counts, split-K and every tile path of the launch
table; stacked experts through `quantized_moe_experts`. Under the interpreter on CPU tensors
(conftest sets TRITON_INTERPRET)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.contract import ModelOps
from portside.ops.moe import select_experts
from portside.quant.fp8_block import quantize_fp8_block
from portside.quant.mxfp4 import mxfp4_weight
from portside.quant.weight import quantized_linear

triton = pytest.importorskip("triton")

from portside.backends.triton.launch import ArchInfo  # noqa: E402  (after the interpreter is set)
from portside.backends.triton.moe import TritonModelOps  # noqa: E402
from portside.backends.triton.quant import TritonQuantLayout, choose_quant_launch, dequant_matmul, quant_path  # noqa: E402

pytestmark = pytest.mark.triton

H200 = ArchInfo(vendor="nvidia", num_sms=132, capability=(9, 0))
MI300 = ArchInfo(vendor="amd", num_sms=304, warp_size=64, arch_name="gfx942")


def _weights(n: int, k: int, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    return {"fp8 128x128": quantize_fp8_block(w, (128, 128)), "fp8 32x64": quantize_fp8_block(w, (32, 64)),
            "fp8 48x16": quantize_fp8_block(w, (48, 16)), "mxfp4": mxfp4_weight(w)}


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_scaled_weights_match_reference(m: int, dtype: torch.dtype) -> None:
    n, k = 72, 256  # N not a multiple of the tiles; 128-row blocks: a partial second block row
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    for name, w in _weights(n, k, m).items():
        assert quant_path(w) == "dequant", name
        assert_close(dequant_matmul(x, w, bias), quantized_linear(x, w, bias), dtype, context=f"{name} M={m}")


@pytest.mark.parametrize("arch", [H200, MI300], ids=["h200", "mi300"])
def test_block_scaled_weights_under_device_launches(arch: ArchInfo) -> None:
    """The tiles and split-K a GPU would get (not the interpreter's), run under the interpreter."""
    n, k = 40, 512
    gen = torch.Generator().manual_seed(9)
    for m in (1, 20):
        x = torch.randn(m, k, generator=gen)
        for name, w in _weights(n, k, m).items():
            group = w.group_size if w.kind == "mxfp4" else w.block[1]
            launch = choose_quant_launch(arch, m, n, k, x.dtype, group_size=group)
            launch = dataclasses.replace(launch, upcast=False, fp8_bytes=w.kind == "fp8")  # e4m3 read as bytes too
            assert_close(dequant_matmul(x, w, None, launch=launch), quantized_linear(x, w), torch.float32, context=f"{name} M={m}")


def test_model_ops_prepare_and_experts() -> None:
    """`TritonModelOps` keeps MXFP4 scales as e8m0 bytes (the reference reads them so), records
    the dequant path, and runs stacked block-scaled experts through `quantized_moe_experts`."""
    ops = TritonModelOps()
    w = ops.prepare_quantized(mxfp4_weight(torch.randn(64, 96)))
    assert w.scales.dtype == torch.uint8 and w.layout == TritonQuantLayout("dequant")
    x = torch.randn(7, 64)
    weights, ids = select_experts(torch.randn(7, 4), 2, True)
    for quantize in (mxfp4_weight, lambda t: quantize_fp8_block(t, (32, 32))):
        w13 = quantize(torch.randn(4, 64, 64) * 0.125)
        w2 = quantize(torch.randn(4, 64, 32) * 0.17)
        want = ModelOps().quantized_moe_experts(x, w13, w2, weights, ids)
        got = ops.quantized_moe_experts(x, ops.prepare_quantized(w13), ops.prepare_quantized(w2), weights, ids)
        assert_close(got, want, torch.float32)


def test_fp8_block_with_grouped_activations() -> None:
    """compressed-tensors FP8_BLOCK: activations rounded per token and 32 columns, then the
    dequant GEMM; equal to the reference's rounding and matmul."""
    ops = TritonModelOps()
    w = quantize_fp8_block(torch.randn(72, 256, generator=torch.Generator().manual_seed(5)) * 0.0625, (32, 32))
    w.act, w.act_group = "fp8", 32
    w = ops.prepare_quantized(w)
    assert w.layout == TritonQuantLayout("dequant")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    assert_close(ops.quantized_linear(x, w), quantized_linear(x, w), torch.float32)
