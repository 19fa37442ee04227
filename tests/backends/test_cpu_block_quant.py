"""`csrc/block_quant.cpp`'s three decoders (AVX-512, AVX2, portable C++) against core's reference:
block-wise fp8 (whole and partial blocks) and mxfp4, fp32 and bf16 activations, decode (up to 8
rows: the dot-product path) and prefill (the tiled GEMM path). The native library itself is built
with -march=native, so a machine runs one of them: that one is checked in the native library; the
other two are each built on their own for this test with the flags that select them (a CPU
without AVX-512, or a compiler without -march support)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portside.backends.cpu import native_build, native_ops
from portside.backends.cpu.host import cpu_flags

pytestmark = pytest.mark.slow

VARIANTS = {"avx512": ("-march=native",), "avx2": ("-mavx2", "-mfma", "-mf16c"), "portable": ()}

CHECK = r"""
import json, sys, torch
torch.ops.load_library(sys.argv[1])
from portside.quant.fp8_block import quantize_fp8_block
from portside.quant.mxfp4 import mxfp4_weight
from portside.quant.weight import quantized_linear
gen = torch.Generator().manual_seed(0)
worst = {}
for t in (1, 3, 8, 9, 33):
    for dtype in (torch.float32, torch.bfloat16):
        for k, n, block in ((96, 64, (32, 32)), (256, 200, (128, 128)), (192, 130, (64, 64)), (320, 72, None)):
            w = torch.randn(n, k, generator=gen) * k ** -0.5
            qw = mxfp4_weight(w) if block is None else quantize_fp8_block(w, block)
            fmt, blk = (1, (1, 32)) if block is None else (0, block)
            x = torch.randn(t, k, generator=gen).to(dtype)
            bias = torch.randn(n, generator=gen).to(dtype)
            got = torch.ops.portside_cpu_native.block_quant_linear(x, qw.qweight, qw.scales, bias, fmt, *blk)
            want = quantized_linear(x, qw, bias)
            assert got.dtype == dtype and got.shape == want.shape
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            key = f"{'mxfp4' if block is None else 'fp8'} {dtype}"
            worst[key] = max(worst.get(key, 0.0), err)
print(json.dumps({"isa": torch.ops.portside_cpu_native.block_quant_isa(), "worst": worst}))
"""


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_decoder_matches_reference(variant: str, tmp_path: Path) -> None:
    if native_ops.unavailable_reason() is not None:
        pytest.skip(f"no native build here: {native_ops.unavailable_reason()}")
    if variant == "avx512" and not {"avx512f", "avx512bw"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    if variant == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    if variant == torch.ops.portside_cpu_native.block_quant_isa():
        # the decoder -march=native selects: the native library itself (built with exactly these
        # flags) rather than a second compile of the same file (~20 s on CI's 2 cores)
        lib = native_ops.load()
    else:
        compile_flags, libs = native_ops._torch_flags()
        flags = [f for f in compile_flags if f != "-march=native"] + list(VARIANTS[variant])
        lib = tmp_path / f"block_quant_{variant}.so"
        cmd = [*native_build.compiler(), *flags, str(native_ops.CSRC / "block_quant.cpp"), "-o", str(lib), *libs]
        build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([sys.executable, "-c", CHECK, str(lib)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["isa"] == variant, result
    for key, err in result["worst"].items():  # fp32: summation order; bf16: the output's rounding
        assert err < (1e-5 if "float32" in key else 1e-2), (key, err)
