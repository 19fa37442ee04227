"""GGUF weights times 8-bit activations (`backends/cpu/gguf_dot.py`, `csrc/gguf_dot*.cpp`): every
format and every instruction-set path this CPU runs, against

(a) `portside.quant.gguf_dot_ref`, the same arithmetic in pure torch: the integer block dots are
    exact on both sides, so they differ only in the order of the fp32 sums (and in converting an
    integer sum lane by lane): a few ulps of the row's sum of |block terms|;
(b) the dequantize-then-matmul reference (`quantized_linear` on the weight-only `QuantWeight`):
    the kernel rounds x per block to int8, at most half a step (scale / 2) per value, so
    |y - x W^T| <= sum_k |W[n, k]| scale(t, k) / 2 (plus the fp32 sums above).

Shapes are random-ish: N odd (the decode kernel's leftover rows after passes of 4 and 2) and N
over a chunk of 32 rows (the several-token path), K not a multiple of 256 where the format allows
it (Q8_0 and Q4_0 have blocks of 32; GGUF rows are whole blocks), an odd number of 32-blocks (the
VNNI kernel's single last block; Q4_0's 4-block pass, then a pair), T = 1 (decode), 3, 5..9 (token
rows 4 at a time and a remainder), 16, 17 and 40 (on AVX-512 VNNI and AVX2, from 16 token rows: the
tiles of 16 (8) interleaved weight rows, `csrc/gguf_tile.cpp`, 8 (4) token rows a pass and a
remainder of 1; N 5, 7, 33 and 70 leave a partial tile); fp32 and bf16 activations, with a bias.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from portside.backends.cpu import native_ops
from portside.quant import gguf_dot_ref
from portside.quant.weight import QuantWeight, dequantize

if native_ops.unavailable_reason() is not None:
    pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}", allow_module_level=True)

from portside.backends.cpu import gguf_dot  # noqa: E402

gguf = pytest.importorskip("gguf")

ISAS = gguf_dot.isas()
FORMATS = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# (N, K) per weight block size; N 70: more than a chunk of the several-token path (32 rows), and
# (like 7 and 33) not a multiple of the 4 rows per decode pass; K 224: 7 blocks of 32 (Q4_0's
# 4-block VNNI pass, then a pair, then one)
SHAPES = {32: ((33, 96), (7, 800), (70, 224)), 256: ((33, 768), (5, 256), (70, 512))}
ROWS = (1, 3, 5, 6, 7, 8, 9, 16, 17, 40)
EPS = torch.finfo(torch.float32).eps
# where each format keeps its fp16 super-scales (d, and Q4_K/Q5_K's dmin), to set them to sizes
# giving O(1) outputs on random code bytes (all codes, the extreme ones included)
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
TYPICAL = {"Q8_0": 80, "Q4_0": 5, "Q4_K": 300, "Q5_K": 600, "Q6_K": 1500, "IQ4_XS": 1500}  # |scale x code|


def _weight(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    t = gguf.GGMLQuantizationType[name]
    block, nbytes = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
    d = np.frombuffer(np.float16(1 / (TYPICAL[name] * k**0.5)).tobytes(), dtype=np.uint8)
    for off in SCALE_OFFSETS[name]:
        raw[:, :, off : off + 2] = d
    return torch.from_numpy(raw.reshape(n, -1).copy())


def _x(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0  # an all-zero activation block: scale 0
    if t > 2:
        x[2] *= 1000  # rows of very different sizes (per-block scales)
    return x.to(dtype)


def _dense(qweight: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    w = QuantWeight("gguf", (qweight.shape[0], k), qweight, ggml_type=ggml_type, method="gguf")
    return dequantize(w, torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", FORMATS)
def test_kernel_against_references(name: str, isa: str):
    ggml_type = int(gguf.GGMLQuantizationType[name])
    block = gguf_dot_ref.ACT_BLOCK[name]
    for i, (n, k) in enumerate(SHAPES[gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0]]):
        qweight = _weight(name, n, k, seed=i)
        dense = _dense(qweight, ggml_type, k).double()
        bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
        for t in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = _x(t, k, dtype, seed=t)
                out = gguf_dot.linear(x, qweight, ggml_type, bias.to(dtype), isa=isa)
                assert out.shape == (t, n) and out.dtype == dtype
                what = f"{name} {isa} N={n} K={k} T={t} {dtype}"
                # (a) the same arithmetic: a few ulps of sum |term| per row (and bf16's rounding of y)
                ref, mag = gguf_dot_ref.gguf_dot(x, qweight, ggml_type, bias.to(dtype))
                tol = (k // block + 16) * 2 * EPS * (mag + bias.abs())
                if dtype == torch.bfloat16:
                    tol = tol + ref.float().abs() * 2**-7  # one bf16 step: two fp32 sums a few ulps apart can round either side of a tie
                err = (out.float() - ref.float()).abs()
                assert (err <= tol).all(), f"{what}: vs the same arithmetic, max err/tol {(err / tol).max():.2f}"
                # (b) dequantize-then-matmul: bounded by the activations' rounding
                _, d = gguf_dot_ref.quantize_activations(x, block)
                step = d.double().repeat_interleave(block, dim=1)  # [T, K]
                bound = (dense.abs() @ step.T).T / 2 + tol
                exact = x.double() @ dense.T + bias.to(dtype).double()
                err = (out.double() - exact).abs()
                assert (err <= bound).all(), f"{what}: vs dequantize-then-matmul, max err/bound {(err / bound).max():.2f}"
                # and the rounding is not all there is: much of the bound is never used
                assert err.mean() < bound.mean() / 4, what


def test_quantize_matches_the_reference():
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    x[1, :32] = torch.tensor([127.0] + [i + 0.5 for i in range(-15, 16)])  # scale 1: ties round to even
    x[2, 32:64] = 0
    for block in (32, 256):
        for dtype in (torch.float32, torch.bfloat16):
            q, d = gguf_dot.quantize(x.to(dtype), block)
            rq, rd = gguf_dot_ref.quantize_activations(x.to(dtype), block)
            assert q.dtype == torch.int8 and d.dtype == torch.float32
            assert torch.equal(q, rq) and torch.equal(d, rd), (block, dtype)
    q, _ = gguf_dot.quantize(x, 32)
    assert q[1, 1:32].tolist() == [round(i + 0.5) for i in range(-15, 16)]  # Python's round: half to even


def test_decode_size_rows_and_threads():
    """A decode-sized matrix over several threads: the same as one thread, and as the reference."""
    qweight = _weight("Q4_K", 301, 2048, seed=9)
    x = _x(1, 2048, torch.float32, seed=4)
    ref, mag = gguf_dot_ref.gguf_dot(x, qweight, 12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_dot.linear(x, qweight, 12)
        torch.set_num_threads(max(2, threads))
        many = gguf_dot.linear(x, qweight, 12)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)  # each output is one thread's sum, in the same order
    assert ((one - ref).abs() <= 24 * 2 * EPS * mag).all()


@pytest.mark.parametrize("name", FORMATS)
def test_many_token_rows_over_threads(name: str):
    """A prefill-sized call over several threads (on VNNI: the tiles, split across threads by 16
    weight rows): the same as one thread, and as the reference."""
    ggml_type = int(gguf.GGMLQuantizationType[name])
    qweight = _weight(name, 77, 512, seed=7)
    x = _x(37, 512, torch.float32, seed=6)
    ref, mag = gguf_dot_ref.gguf_dot(x, qweight, ggml_type)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_dot.linear(x, qweight, ggml_type)
        torch.set_num_threads(max(2, threads))
        many = gguf_dot.linear(x, qweight, ggml_type)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    block = gguf_dot_ref.ACT_BLOCK[name]
    assert ((one - ref).abs() <= (512 // block + 16) * 2 * EPS * mag).all()


def test_bad_arguments_are_refused():
    qweight = _weight("Q8_0", 4, 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="no kernel"):
        torch.ops.portside_cpu_native.gguf_dot(x, qweight, 11, None, 0)  # Q3_K
    with pytest.raises(RuntimeError, match="not whole blocks"):
        gguf_dot.linear(torch.randn(2, 96), qweight, 8)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        gguf_dot.linear(x.half(), qweight, 8)


# ---- through CpuQuantOps (backend option cpu_gguf_act) ---------------------------------------------


def test_quant_ops_run_gguf_weights_with_int8_activations_by_option():
    from portside.backends.cpu.moe import CpuModelOps

    assert CpuModelOps().gguf_act == "fp32"  # cpu_gguf_act's default
    for name in FORMATS:
        ggml_type = int(gguf.GGMLQuantizationType[name])
        qweight = _weight(name, 9, 512, seed=1)
        ops = CpuModelOps()
        ops.gguf_act = "int8"
        w = ops.prepare_quantized(QuantWeight("gguf", (9, 512), qweight, ggml_type=ggml_type, method="gguf"))
        assert w.layout.kernel == f"gguf-{name}-int8"
        x = _x(3, 512, torch.float32, seed=2)
        assert torch.equal(ops.quantized_linear(x, w), gguf_dot.linear(x, qweight, ggml_type))
        ops.gguf_act = "fp32"  # the weight-only kernels (IQ4_XS has none: the reference)
        w = ops.prepare_quantized(QuantWeight("gguf", (9, 512), qweight, ggml_type=ggml_type, method="gguf"))
        assert (w.layout is None) if name == "IQ4_XS" else (w.layout.kernel == f"gguf-{name}")


def test_stacked_gguf_experts_take_the_int8_kernel_per_expert():
    from portside.backends.cpu.moe import CpuModelOps

    qweight = torch.stack([_weight("Q4_K", 16, 256, seed=e) for e in range(3)])  # [E, N, row_bytes]
    ops = CpuModelOps()
    ops.gguf_act = "int8"
    w = ops.prepare_quantized(QuantWeight("gguf", (16, 256), qweight, ggml_type=12, method="gguf"))
    assert w.layout.kernel == "gguf-Q4_K-int8"
    x = _x(5, 256, torch.float32, seed=3)
    for e in range(3):
        assert torch.equal(ops._expert_linear(x, w, e), gguf_dot.linear(x, qweight[e], 12))


def test_a_bad_cpu_gguf_act_is_refused_naming_the_choices(tmp_path):
    from portside import LLM
    from portside.testing.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match=r"cpu_gguf_act='int4': use one of \['int8', 'fp32'\]"):
        LLM(model=str(path), device="cpu", platform_options={"cpu_gguf_act": "int4"})
