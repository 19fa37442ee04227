"""Triton quantized linear kernels vs core's reference (`portside.quant.weight.quantized_linear`).

Under the interpreter on CPU tensors (conftest sets TRITON_INTERPRET), so shapes are small: K =
256 (a multiple of every group size), N = 72 (not a multiple of the 32-wide tiles), M = 1, 5
and 33 (a partial second row tile); int4 and int8 codes with group sizes 32, 128 and -1, with
and without zeros and act-order g_idx; FP8 weight-only; W8A8 int8 and FP8 with dynamic and
static activation scales; split-K and each tile path forced by explicit launches; the per-token
activation rounding checked code for code against the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import assert_close  # tests/ is on sys.path (rootdir conftest)

from portside.contract import ModelOps
from portside.quant.weight import QuantWeight, pack_int4, quantize_activation, quantize_per_channel, quantized_linear

triton = pytest.importorskip("triton")

from portside.backends.triton.launch import ArchInfo  # noqa: E402  (after the interpreter is set)
from portside.backends.triton.moe import TritonModelOps  # noqa: E402
from portside.backends.triton.quant import (  # noqa: E402
    QuantLaunch,
    TritonQuantLayout,
    choose_quant_launch,
    dequant_matmul,
    quant_path,
    quantize_rows,
    scaled_matmul,
)

pytestmark = pytest.mark.triton

N, K = 72, 256
H200 = ArchInfo(vendor="nvidia", num_sms=132, capability=(9, 0))
A100 = ArchInfo(vendor="nvidia", num_sms=108, capability=(8, 0))
MI300 = ArchInfo(vendor="amd", num_sms=304, warp_size=64, arch_name="gfx942")


def int_weight(bits: int, group_size: int, zeros: bool, g_idx: bool, seed: int = 0, n: int = N, k: int = K) -> QuantWeight:
    """Random canonical int codes whose dequantized rows have unit-order outputs (scale ~ 1 /
    (2^(bits-1) sqrt(K))). `group_size` -1: one group per row; `g_idx`: a shuffled act order."""
    gen = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = k // gs
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = (0.5 + torch.rand(n, groups, generator=gen)) / ((1 << (bits - 1)) * k**0.5)
    z = torch.randint(0, 1 << bits, (n, groups), generator=gen).float() if zeros else None
    order = (torch.arange(k) // gs)[torch.randperm(k, generator=gen)].to(torch.int32) if g_idx else None
    q = pack_int4(codes) if bits == 4 else codes
    return QuantWeight("int", (n, k), q, bits=bits, scales=scales, zeros=z, group_size=gs, g_idx=order, method=f"int{bits}")


def dense(seed: int, n: int = N, k: int = K) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5


def has_fp8_type(device: torch.device) -> bool:
    return device.type != "cuda" or torch.version.hip is not None or torch.cuda.get_device_capability() >= (8, 9)


def inputs(m: int, dtype: torch.dtype, seed: int = 1, k: int = K, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x, b


def on_cpu(w: QuantWeight) -> QuantWeight:
    return copy.deepcopy(w).to("cpu")  # Module.to moves in place


def check(out: torch.Tensor, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, context: str = "") -> None:
    """`out` (any device) against the reference on CPU copies."""
    expected = quantized_linear(x.cpu(), on_cpu(w), None if bias is None else bias.cpu())
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert_close(out.cpu(), expected, context=context)


# M with the dtype it runs in: fp32 holds the kernels to fp32's tight tolerance, bf16 checks the
# half-precision path; M = 1 splits K, M = 33 has a partial second row tile
M_DTYPES = [(1, torch.float32), (5, torch.bfloat16), (33, torch.float32)]
M_IDS = [f"m{m}-{str(d).removeprefix('torch.')}" for m, d in M_DTYPES]

GROUPINGS = [  # (group_size, zeros, g_idx)
    (32, True, False),
    (128, False, False),
    (-1, False, False),
    (-1, True, False),
    (32, True, True),
    (128, False, True),
]


@pytest.mark.parametrize(("m", "dtype"), M_DTYPES, ids=M_IDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("group_size", "zeros", "g_idx"), GROUPINGS, ids=[f"g{g}{'-zeros' if z else ''}{'-gidx' if a else ''}" for g, z, a in GROUPINGS])
def test_int_weight_only_matches_reference(bits: int, group_size: int, zeros: bool, g_idx: bool, m: int, dtype: torch.dtype, kernel_device) -> None:
    w = int_weight(bits, group_size, zeros, g_idx, seed=bits + group_size).to(kernel_device)
    x, bias = inputs(m, dtype, seed=m, bias=m == 5)
    ops = TritonModelOps()
    w = ops.prepare_quantized(w)
    assert isinstance(w.layout, TritonQuantLayout) and w.layout.path == "dequant"
    check(ops.quantized_linear(x.to(kernel_device), w, None if bias is None else bias.to(kernel_device)), x, w, bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp16_activations_and_leading_dims(dtype: torch.dtype, kernel_device) -> None:
    w = TritonModelOps().prepare_quantized(int_weight(4, 32, True, False, seed=5).to(kernel_device))
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = TritonModelOps().quantized_linear(x.to(kernel_device), w)
    assert out.shape == (2, 3, N)
    check(out.reshape(6, N), x.reshape(6, K), w, None)


# tile paths forced: split-K 1 and 3 slices; a 64-wide K step over 32-column groups (scales
# gathered per code, no g_idx); 16-wide steps; 64-row tiles
LAUNCHES = [
    QuantLaunch(16, 32, 32, 1, 4, 1, "ieee", upcast=True),
    QuantLaunch(16, 32, 32, 3, 4, 1, "ieee", upcast=True),
    QuantLaunch(16, 32, 64, 2, 4, 1, "ieee", upcast=True),
    QuantLaunch(32, 16, 16, 1, 4, 1, "ieee", upcast=True),
    QuantLaunch(64, 32, 32, 1, 4, 1, "ieee", upcast=True),
]


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda lc: f"m{lc.block_m}n{lc.block_n}k{lc.block_k}s{lc.split_k}")
@pytest.mark.parametrize("bits", [4, 8])
def test_explicit_launches(launch: QuantLaunch, bits: int, kernel_device) -> None:
    w = int_weight(bits, 32, True, False, seed=9).to(kernel_device)
    x, bias = inputs(7, torch.float32, seed=3, bias=True)
    check(dequant_matmul(x.to(kernel_device), w, bias.to(kernel_device), launch), x, w, bias, str(launch))


def test_group_size_not_a_power_of_two(kernel_device) -> None:
    """48-column groups: the chosen K step (16) stays inside a group."""
    w = int_weight(8, 48, True, False, seed=4, k=192).to(kernel_device)
    x, _ = inputs(3, torch.float32, k=192)
    check(TritonModelOps().quantized_linear(x.to(kernel_device), w), x, w, None)


@pytest.mark.parametrize(("m", "dtype"), M_DTYPES, ids=M_IDS)
def test_fp8_weight_only_matches_reference(m: int, dtype: torch.dtype, kernel_device) -> None:
    w = quantize_per_channel(dense(seed=m), "fp8").to(kernel_device)
    ops = TritonModelOps()
    w = ops.prepare_quantized(w)
    assert w.layout.path == "dequant"
    x, bias = inputs(m, dtype, seed=m + 1, bias=m == 5)
    check(ops.quantized_linear(x.to(kernel_device), w, None if bias is None else bias.to(kernel_device)), x, w, bias)


@pytest.mark.parametrize(("m", "dtype"), M_DTYPES, ids=M_IDS)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_w8a8_matches_reference(method: str, static: bool, m: int, dtype: torch.dtype, kernel_device) -> None:
    w = quantize_per_channel(dense(seed=m + 7), method, act=method)
    x, bias = inputs(m, dtype, seed=m + 2, bias=m == 5)
    if static:  # a calibrated scale that clips the largest activations
        w.input_scale = (x.float().abs().amax() / (127.0 if method == "int8" else 448.0) * 0.8).reshape(1)
    ops = TritonModelOps()
    w = ops.prepare_quantized(w.to(kernel_device))
    assert w.layout.path == "scaled_mm"
    check(ops.quantized_linear(x.to(kernel_device), w, None if bias is None else bias.to(kernel_device)), x, w, bias)


# the scaled kernel's operand modes: native int8 / fp8 dots, and both upcasts (fp8 without fp8 MMA)
OPERANDS = [("int8", "native", 1), ("int8", "fp32", 2), ("fp8", "native", 1), ("fp8", "fp16", 3), ("fp8", "fp32", 1)]


@pytest.mark.parametrize(("method", "operand", "split"), OPERANDS, ids=[f"{a}-{b}-split{c}" for a, b, c in OPERANDS])
def test_scaled_operand_modes(method: str, operand: str, split: int, kernel_device) -> None:
    if method == "fp8" and not has_fp8_type(kernel_device):
        pytest.skip("Triton has no e4m3 type before sm89 (the byte path is tested below)")
    import triton

    from portside.backends.triton.launch import interpreter_int8_dot

    if (method, operand) == ("int8", "native") and torch.device(kernel_device).type == "cpu" and not interpreter_int8_dot():
        pytest.skip(f"the interpreter of Triton {triton.__version__} cannot run an int8 dot (3.8+ can)")
    w = quantize_per_channel(dense(seed=11), method, act=method).to(kernel_device)
    x, bias = inputs(5, torch.float32, seed=12, bias=True)
    launch = QuantLaunch(16, 32, 32, split, 4, 1, "ieee", upcast=True, operand=operand)
    check(scaled_matmul(x.to(kernel_device), w, bias.to(kernel_device), launch), x, w, bias, operand)


def test_fp8_as_bytes_decodes_every_value(kernel_device) -> None:
    """NVIDIA before sm89 (no e4m3 type in Triton): FP8 weights read as bytes and decoded in
    integer ops; every finite byte, through an identity x, comes back as torch's value."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8).view(2, 127)
    w = QuantWeight("fp8", (2, 127), codes.view(torch.float8_e4m3fn), scales=torch.ones(2, 1), method="fp8")
    launch = QuantLaunch(16, 32, 32, 1, 4, 1, "ieee", upcast=False, fp8_bytes=True)
    out = dequant_matmul(torch.eye(127, device=kernel_device), w.to(kernel_device), None, launch)
    assert torch.equal(out.T.cpu(), codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_as_bytes_matches_reference(dtype: torch.dtype, kernel_device) -> None:
    upcast = dtype != torch.float32 and kernel_device.type == "cpu"
    x, bias = inputs(5, dtype, seed=13, bias=True)
    d = kernel_device
    weight_only = quantize_per_channel(dense(seed=14), "fp8").to(d)
    launch = QuantLaunch(16, 32, 32, 2, 4, 1, "ieee", upcast=upcast, fp8_bytes=True)
    check(dequant_matmul(x.to(d), weight_only, bias.to(d), launch), x, weight_only, bias)
    w8a8 = quantize_per_channel(dense(seed=15), "fp8", act="fp8").to(d)
    for operand in ("fp16", "fp32"):
        launch = QuantLaunch(16, 32, 32, 1, 4, 1, "ieee", upcast=upcast, operand=operand, fp8_bytes=True)
        check(scaled_matmul(x.to(d), w8a8, bias.to(d), launch), x, w8a8, bias, operand)
    codes, scale = quantize_rows(x.to(d), "fp8", fp8_bytes=True)
    assert codes.dtype == torch.uint8
    got = (codes.view(torch.float8_e4m3fn).cpu().float() * scale.cpu()[:, None]).to(dtype)
    assert torch.equal(got, quantize_activation(x, "fp8"))


def _rounding_probe(mode: str, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose scale is exactly 1 (amax = qmax), holding ties and e4m3 values whose rounding
    carries into the exponent (31.6 -> 32), subnormals, and a row of zeros."""
    gen = torch.Generator().manual_seed(6)
    qmax = 127.0 if mode == "int8" else 448.0
    x = torch.randn(4, 300, generator=gen) * (20.0 if mode == "int8" else 40.0)
    x[:3, 0] = qmax
    x[0, 1:9] = torch.tensor([2.5, 3.5, -2.5, -0.5, 0.5, 31.6, 7.9, -15.8])
    x[1, 1:6] = torch.tensor([0.013, -0.0009, 0.0011, 0.0029, 0.0137])  # e4m3 subnormals (< 2^-6)
    x[3] = 0.0
    return x.clamp(-qmax, qmax).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_activation_rounding_is_the_references(mode: str, dtype: torch.dtype, kernel_device) -> None:
    x = _rounding_probe(mode, dtype)
    x = torch.cat([x, torch.randn(5, 300).to(dtype)])
    codes, scale = quantize_rows(x.to(kernel_device), mode)
    expected = quantize_activation(x, mode)
    got = (codes.cpu().float() * scale.cpu()[:, None]).to(dtype)
    assert torch.equal(got, expected), (got - expected).abs().max()
    static = torch.tensor([0.05])
    codes, scale = quantize_rows(x.to(kernel_device), mode, static.to(kernel_device))
    assert torch.equal((codes.cpu().float() * 0.05).to(dtype), quantize_activation(x, mode, static))


def test_prepare_normalizes_in_place_and_the_reference_still_reads_it(kernel_device) -> None:
    w = int_weight(4, 32, True, True, seed=2)
    w.scales, w.zeros, w.g_idx = w.scales.half(), w.zeros.to(torch.uint8), w.g_idx.long()
    x, _ = inputs(3, torch.float32)
    before = quantized_linear(x, w)
    w = TritonModelOps().prepare_quantized(w.to(kernel_device))
    assert w.scales.dtype == w.zeros.dtype == torch.float32 and w.g_idx.dtype == torch.int32
    assert torch.equal(quantized_linear(x, on_cpu(w)), before)
    assert_close(TritonModelOps().quantized_linear(x.to(kernel_device), w).cpu(), before)


def test_paths_the_kernels_leave_to_the_reference(kernel_device) -> None:
    grouped_w8a8 = int_weight(8, 32, False, False, seed=3)
    grouped_w8a8.act = "int8"
    int_fp8 = int_weight(8, -1, False, False, seed=3)
    int_fp8.act = "fp8"
    gguf = QuantWeight("gguf", (N, K), torch.zeros(N, 8, dtype=torch.uint8), ggml_type=8)
    assert quant_path(grouped_w8a8) is None and quant_path(int_fp8) is None and quant_path(gguf) is None
    ops = TritonModelOps()
    for w in (grouped_w8a8, int_fp8):
        w = ops.prepare_quantized(w.to(kernel_device))
        assert w.layout is None
        x, _ = inputs(2, torch.float32)
        out = ops.quantized_linear(x.to(kernel_device), w)
        assert torch.equal(out, ModelOps().quantized_linear(x.to(kernel_device), w))
    assert ops.prepare_quantized(gguf).layout is None


def test_empty_batch(kernel_device) -> None:
    w = TritonModelOps().prepare_quantized(int_weight(8, -1, False, False).to(kernel_device))
    assert TritonModelOps().quantized_linear(torch.zeros(0, K, device=kernel_device), w).shape == (0, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_reach_the_kernels(dtype: torch.dtype, kernel_device, monkeypatch) -> None:
    """Stacked experts are prepared for their slices; each routed expert goes through the kernel.
    Two layers and an activation in bf16: only a weight and output rounded the reference's way
    stay within tolerance."""
    import portside.backends.triton.quant as quant

    gen = torch.Generator().manual_seed(8)
    hidden, inter, experts = 64, 48, 4
    w13 = quantize_per_channel(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5, "int8")
    w2 = quantize_per_channel(torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5, "int8")
    x = torch.randn(6, hidden, generator=gen).to(dtype)
    weights, ids = ModelOps().select_experts(torch.randn(6, experts, generator=gen), 2, True)
    expected = ModelOps().quantized_moe_experts(x, w13, w2, weights, ids)
    ops = TritonModelOps()
    calls = []
    monkeypatch.setattr(quant, "dequant_matmul", lambda *a, **kw: calls.append(1) or dequant_matmul(*a, **kw))
    d = kernel_device
    out = ops.quantized_moe_experts(x.to(d), ops.prepare_quantized(w13.to(d)), ops.prepare_quantized(w2.to(d)), weights.to(d), ids.to(d))
    assert calls, "the experts did not reach the kernel"
    assert_close(out.cpu(), expected)


def test_launch_table() -> None:
    decode = choose_quant_launch(H200, 1, 4096, 4096, torch.bfloat16)
    assert decode.block_m == 16 and decode.split_k > 1 and decode.input_precision == "tf32" and not decode.upcast
    prefill = choose_quant_launch(H200, 4096, 4096, 4096, torch.bfloat16)
    assert prefill.block_m == 128 and prefill.split_k == 1
    assert choose_quant_launch(H200, 1, 4096, 4096, torch.float16, group_size=32).block_k == 32  # one group per K step
    assert choose_quant_launch(H200, 1, 4096, 4096, torch.float16, group_size=128).block_k == 128
    assert choose_quant_launch(H200, 8, 4096, 4096, torch.bfloat16, scaled="fp8").operand == "native"
    assert choose_quant_launch(A100, 8, 4096, 4096, torch.bfloat16, scaled="fp8").operand == "fp16"
    assert choose_quant_launch(MI300, 8, 4096, 4096, torch.bfloat16, scaled="fp8").operand == "fp16"
    assert choose_quant_launch(MI300, 8, 4096, 4096, torch.bfloat16, scaled="int8").operand == "native"
    assert choose_quant_launch(A100, 8, 4096, 4096, torch.bfloat16).fp8_bytes  # no e4m3 type before sm89
    assert not choose_quant_launch(H200, 8, 4096, 4096, torch.bfloat16).fp8_bytes
    assert not choose_quant_launch(MI300, 8, 4096, 4096, torch.bfloat16).fp8_bytes
    assert choose_quant_launch(H200, 8, 4096, 4096, torch.float32).input_precision == "ieee"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("method", ["int4", "int8-w8a8", "fp8-w8a8"])
def test_quantized_linear_replays_in_a_cuda_graph(method: str, kernel_device) -> None:
    """No host sync in `quantized_linear` (capture would fail); a replay reads new inputs."""
    if method == "int4":
        w = int_weight(4, 128, True, True, seed=1)
    else:
        base = method.partition("-")[0]
        w = quantize_per_channel(dense(seed=2), base, act=base)
    ops = TritonModelOps()
    w = ops.prepare_quantized(w.to(kernel_device))
    x = torch.randn(4, K, device=kernel_device, dtype=torch.bfloat16)
    ops.quantized_linear(x, w)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.quantized_linear(x, w)
    x2, _ = inputs(4, torch.bfloat16, seed=5)
    x.copy_(x2)
    graph.replay()
    check(out, x2, w, None)
