"""The cpu backend's quantized linears (`backends/cpu/quant.py`, `csrc/quant_gemm.cpp`) against
core's reference (`portside.quant.weight.quantized_linear`: dequantize, then matmul), and through
the engine against the engine on the reference.

Each weight is prepared by `CpuModelOps.prepare_quantized` (which must leave the canonical
buffers valid, so the reference runs on the very same weight) and checked to have taken the native
kernel it is meant to. Weights and inputs are scaled so outputs are O(1): the tolerances are then
absolute and relative alike (`TOL`). Row counts 1, 3, 17 and 64 cover the decode kernel (two weight
rows side by side), the batched one (token rows in blocks of 4, a remainder) and the tiled GEMM of
prefill; N is odd (the pair kernel's leftover row, a partial tile).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from portside.backends.cpu import native_ops
from portside.quant.weight import QuantWeight, pack_int4, quantize_per_channel, quantized_linear
from portside.testing.tolerances import TOLERANCES

if native_ops.unavailable_reason() is not None:
    pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}", allow_module_level=True)

from portside.backends.cpu import quant  # noqa: E402
from portside.backends.cpu.moe import CpuModelOps  # noqa: E402

if not quant.isa():
    pytest.skip("the quantized kernels need AVX2, FMA and F16C", allow_module_level=True)

# Per x dtype. fp32: both sides sum in fp32 in different orders (and the int kernels subtract
# zero points before multiplying, the reference after): a few ulps of an O(1) output over K <=
# 512 products. bf16: the reference rounds the dequantized weight (and W8A8's dequantized
# activations) to bf16 before its bf16 matmul, the kernels keep them in fp32: the table's bf16.
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: TOLERANCES[torch.bfloat16]}
# W8A8 in fp32: the integer dot products are exact, the reference multiplies the same rounded
# values in fp32: the same few ulps.
TOL_W8A8 = TOL
ROWS = (1, 3, 17, 64)
X_DTYPES = (torch.float32, torch.bfloat16)


def _x(t: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _check(w: QuantWeight, kernel: str, rows=ROWS, dtypes=X_DTYPES, bias: bool = False, tol=TOL) -> None:
    ops = CpuModelOps()
    ops.gguf_act = "fp32"  # GGUF: the weight-only kernels (int8 activations: test_cpu_gguf_dot.py)
    w = ops.prepare_quantized(w)
    assert isinstance(w.layout, quant.CpuQuantLayout) and w.layout.kernel == kernel, w.layout
    n, k = w.shape
    b = torch.randn(n, generator=torch.Generator().manual_seed(7)) if bias else None
    for dtype in dtypes:
        for t in rows:
            x = _x(t, k, dtype)
            bb = None if b is None else b.to(dtype)
            out = ops.quantized_linear(x, w, bb)
            ref = quantized_linear(x, w, bb)
            assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
            what = f"{kernel} T={t} {dtype}: max err {(out.float() - ref.float()).abs().max().item():.2e}"
            torch.testing.assert_close(out, ref, **tol[dtype], msg=lambda m, what=what: f"{what}\n{m}")


def _int_weight(n: int, k: int, bits: int, group: int | None, zeros: bool, act: str | None = None,
                g_idx: torch.Tensor | None = None, seed: int = 0) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    groups = k // (group or k)
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    # scale so that a row of K codes times N(0, 1) inputs sums to O(1)
    scales = (torch.rand(n, groups, generator=g) + 0.5) / (2 ** (bits - 1) * k**0.5)
    zero = torch.randint(0, 2**bits, (n, groups), generator=g).float() if zeros else None
    return QuantWeight("int", (n, k), pack_int4(codes) if bits == 4 else codes, bits=bits, scales=scales, zeros=zero,
                       group_size=group, g_idx=g_idx, act=act, method=f"int{bits}")


# ---- int8 / int4 weight-only -------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, 32, 64])
@pytest.mark.parametrize("zeros", [False, True])
def test_int8_weight_only(group, zeros):
    _check(_int_weight(37, 256, 8, group, zeros), "int8", bias=True)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("zeros", [False, True])
def test_int4_weight_only(group, zeros):
    _check(_int_weight(45, 256, 4, group, zeros), "int4")


def test_quantize_per_channel_int8():
    """What ``--quantization int8`` makes at load: symmetric per channel, no zeros."""
    dense = torch.randn(33, 96, generator=torch.Generator().manual_seed(3)) / 96**0.5
    _check(quantize_per_channel(dense, "int8"), "int8", bias=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_g_idx(bits):
    """GPTQ desc_act: input columns in a permuted group order; the kernel reads codes sorted by
    group and gathers x by the same order, the canonical codes stay as they were."""
    k, group = 256, 64
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(5))
    g_idx = (perm // group).to(torch.int32)  # each group still has `group` columns
    w = _int_weight(19, k, bits, group, zeros=True, g_idx=g_idx)
    before = w.qweight.clone()
    _check(w, f"int{bits}", rows=(1, 5, 20))
    assert torch.equal(w.qweight, before)
    assert w.layout.permuted and torch.equal(w.g_idx.long()[w.packed_perm], torch.arange(k) // group)


def test_trivial_g_idx_is_not_permuted():
    k, group = 128, 32
    w = CpuModelOps().prepare_quantized(_int_weight(8, k, 4, group, False, g_idx=(torch.arange(k) // group).int()))
    assert w.layout.kernel == "int4" and not w.layout.permuted and not hasattr(w, "packed_qweight")


# ---- W8A8 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, 64])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("n", [37, 48])
def test_w8a8(group, zeros, n):
    """N = 48 (whole 16-row tiles, K and groups in 64s): where the CPU has AMX-INT8, 17 and 64 rows
    run on the tiles; elsewhere (and N = 37) the AVX2 or AVX512-VNNI kernel, but 64 rows of a
    symmetric weight (no zeros) on the int8-activation GGUF kernels' tiles (`csrc/gguf_tile.cpp`)."""
    _check(_int_weight(n, 256, 8, group, zeros, act="int8"), "w8a8", bias=True, tol=TOL_W8A8)


def test_w8a8_static_input_scale():
    w = _int_weight(21, 128, 8, None, False, act="int8")
    w.input_scale = torch.tensor([0.02])  # clips the larger inputs, as the reference does
    _check(w, "w8a8", rows=(1, 4, 33), tol=TOL_W8A8)


def test_w8a8_rounds_like_the_reference():
    """Inputs exactly halfway between two codes round half to even, as torch.round does."""
    k = 64
    w = _int_weight(16, k, 8, None, False, act="int8")
    x = torch.zeros(2, k)
    x[:, 0] = 127.0  # scale 1.0
    x[0, 1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5])
    ops = CpuModelOps()
    w = ops.prepare_quantized(w)
    torch.testing.assert_close(ops.quantized_linear(x, w), quantized_linear(x, w), **TOL_W8A8[torch.float32])


def test_int4_with_int8_activations_rounds_in_torch():
    """int8 activations of a non-int8 weight: rounded as the reference does, then the int4
    kernel (there is no int4 x int8 kernel)."""
    _check(_int_weight(13, 128, 4, 32, False, act="int8"), "int4", rows=(1, 7))


# ---- fp8 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", [None, "fp8"])
def test_fp8(act):
    dense = torch.randn(29, 160, generator=torch.Generator().manual_seed(2)) / 160**0.5
    w = quantize_per_channel(dense, "fp8", act)
    _check(w, "fp8", bias=True)


def test_fp8_subnormal_codes():
    """Every e4m3 code but NaN, subnormals included, decodes exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaNs
    q = codes.repeat(2)[:480].view(torch.float8_e4m3fn).reshape(3, 160)
    w = QuantWeight("fp8", (3, 160), q, scales=torch.full((3, 1), 1e-3), method="fp8")
    _check(w, "fp8", rows=(1, 2), dtypes=(torch.float32,))


# ---- GGUF ----------------------------------------------------------------------------------------


def _gguf_weight(type_name: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    t = gguf.GGMLQuantizationType[type_name]
    block, type_bytes = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    try:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32) / k**0.5, t)
    except NotImplementedError:  # gguf-py quantizes only some types: random blocks, scales for O(1) outputs
        raw = rng.integers(0, 256, (n, k // block * type_bytes), dtype=np.uint8)
        typical = 1500 if type_name == "Q6_K" else 300  # |scale x code|: int8 x 6-bit, or 6-bit x 4/5-bit
        d = np.frombuffer(np.float16(1 / (typical * k**0.5)).tobytes(), dtype=np.uint8)
        for b in range(k // block):
            for off in ({"Q6_K": (208,)}.get(type_name) or (0, 2)):  # Q4_K/Q5_K: d and dmin
                raw[:, b * type_bytes + off : b * type_bytes + off + 2] = d
    qweight = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1).copy())
    return QuantWeight("gguf", (n, k), qweight, ggml_type=int(t), method="gguf")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf(type_name):
    pytest.importorskip("portside.quant.gguf")
    _check(_gguf_weight(type_name, 23, 512), f"gguf-{type_name}", bias=True)


def test_gguf_against_gguf_py():
    """The K-quant decoders against gguf-py's own dequantization (not only portside's)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    ops = CpuModelOps()
    ops.gguf_act = "fp32"
    for name in ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0"):
        w = _gguf_weight(name, 9, 256, seed=4)
        dense = torch.from_numpy(dequantize(w.qweight.numpy(), gguf.GGMLQuantizationType[name]).reshape(9, 256).copy())
        w = ops.prepare_quantized(w)
        for t in (1, 2, 9):
            x = _x(t, 256, torch.float32)
            torch.testing.assert_close(ops.quantized_linear(x, w), x @ dense.float().T, **TOL[torch.float32])


# ---- what stays on the reference -------------------------------------------------------------------


def test_uncovered_shapes_and_inputs_use_the_reference():
    ops = CpuModelOps()
    odd_k = ops.prepare_quantized(_int_weight(5, 40, 8, None, False))  # K not a multiple of 32
    assert odd_k.layout is None
    x = _x(3, 40, torch.float32)
    torch.testing.assert_close(ops.quantized_linear(x, odd_k), quantized_linear(x, odd_k))
    w = ops.prepare_quantized(_int_weight(5, 64, 8, None, False))
    x16 = _x(2, 64, torch.float16)  # fp16 activations: the reference
    torch.testing.assert_close(ops.quantized_linear(x16, w), quantized_linear(x16, w))
    q3 = QuantWeight("gguf", (4, 256), torch.zeros(4, 110, dtype=torch.uint8), ggml_type=11)  # Q3_K: no kernel
    assert ops.prepare_quantized(q3).layout is None


def test_stacked_experts_take_the_kernel_per_expert():
    """MoE experts quantized at load (stacked [E, N, K]): each expert's slice goes to the kernel."""
    dense = torch.randn(3, 48, 64, generator=torch.Generator().manual_seed(9)) / 8
    ops = CpuModelOps()
    w = ops.prepare_quantized(quantize_per_channel(dense, "int8"))
    assert w.layout.kernel == "int8"
    x = _x(5, 64, torch.float32)
    for e in range(3):
        torch.testing.assert_close(ops._expert_linear(x, w, e), quantized_linear(x, w.expert(e)), **TOL[torch.float32])


def test_isa_follows_the_cpu_flags():
    from portside.backends.cpu.platform import cpu_flags

    paths = quant.isa().split(",")
    assert "avx2" in paths
    if {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags():
        assert "avx512vnni" in paths
    else:
        assert "avx512vnni" not in paths and "amx" not in paths
    if "amx" in paths:
        assert "amx_int8" in cpu_flags()


# ---- under torch.compile -------------------------------------------------------------------------


class _Linear(torch.nn.Module):
    def __init__(self, ops: CpuModelOps, w: QuantWeight) -> None:
        super().__init__()
        self.ops, self.w = ops, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.quantized_linear(torch.relu(x), self.w) * 2


@pytest.mark.parametrize("make", [
    lambda: _int_weight(17, 128, 8, None, False),
    lambda: _int_weight(17, 128, 4, 32, True, g_idx=(torch.randperm(128, generator=torch.Generator().manual_seed(1)) // 32).int()),
    lambda: _int_weight(17, 128, 8, 64, False, act="int8"),
    lambda: quantize_per_channel(torch.randn(17, 128) / 12, "fp8", "fp8"),
], ids=["int8", "int4-act-order", "w8a8", "fp8"])
def test_inside_torch_compile(make):
    """The operators are opaque in an Inductor graph (their fakes give the shapes); one graph for
    a symbolic row count, and the same results as eager."""
    ops = CpuModelOps()
    w = ops.prepare_quantized(make())
    module = _Linear(ops, w)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for t in (1, 3, 17):
        x = _x(t, 128, torch.float32)
        torch.testing.assert_close(compiled(x), module(x), **TOL[torch.float32])


# ---- the platform and the engine ---------------------------------------------------------------------


def test_openvino_refuses_quantized_models(tmp_path):
    from portside import LLM
    from portside.testing.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="quantiz.*eager.*inductor"):
        LLM(model=str(path), device="cpu", quantization="int8", platform_options={"cpu_graph": "openvino"})


MAX_TOKENS = 10


def _engine(path, mode: str, act: str | None, monkeypatch=None, reference: bool = False):
    """An engine and the kernels its quantized weights took (`reference`: every layer kept on
    core's reference ModelOps, until the caller undoes `monkeypatch`)."""
    from portside import LLM

    if reference:
        monkeypatch.setattr(quant, "isa", lambda: "")  # prepare_quantized keeps every layer on the reference
    llm = LLM(model=str(path), device="cpu", quantization="int8", quantized_activations=act, max_model_len=128,
              block_size=8, max_num_batched_tokens=24, platform_options={"cpu_graph": mode})
    model = llm.engine.executor.runner.model
    return llm, {getattr(m.layout, "kernel", None) for m in model.modules() if isinstance(m, QuantWeight)}


def _tokens(llm, prompts):
    from portside import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


def _generate(path, mode: str, act: str | None, prompts, monkeypatch=None, reference: bool = False):
    llm, kernels = _engine(path, mode, act, monkeypatch, reference)
    tokens = _tokens(llm, prompts)
    llm.shutdown()
    if reference:
        monkeypatch.undo()
    return tokens, kernels


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from portside.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


PROMPTS = [[1, 5, 9, 33, 70, 2], [7, 8], list(range(40, 57)), [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 12]]


def _engine_parity(tiny_llama, mode, act, monkeypatch):
    expected, ref_kernels = _generate(tiny_llama, "eager", act, PROMPTS, monkeypatch, reference=True)
    assert ref_kernels == {None}
    llm, kernels = _engine(tiny_llama, mode, act)
    assert kernels == {"w8a8" if act else "int8"}
    assert _tokens(llm, PROMPTS) == expected, f"{mode} act={act}"
    # one sequence at a time: every decode step a one-row batch (the same engine: these prompts
    # are shorter than a block, so nothing of them is a prefix-cache hit)
    for p in PROMPTS[:2]:
        assert _tokens(llm, [p]) == [expected[PROMPTS.index(p)]]
    llm.shutdown()


def test_engine_int8_eager_matches_the_reference(tiny_llama, monkeypatch):
    """``--quantization int8`` (weight-only), greedy tokens through the native kernels equal the
    engine's on core's reference ModelOps; steps mix prefill chunks and decodes."""
    _engine_parity(tiny_llama, "eager", None, monkeypatch)


def test_engine_w8a8_eager_matches_the_reference(tiny_llama, monkeypatch):
    _engine_parity(tiny_llama, "eager", "int8", monkeypatch)


@pytest.mark.slow
def test_engine_int8_inductor_matches_the_reference(tiny_llama, monkeypatch):
    _engine_parity(tiny_llama, "inductor", None, monkeypatch)


def test_engine_int8_matches_transformers(tiny_llama):
    """The tiny model's logits are peaked enough that per-channel int8 keeps transformers' fp32
    greedy tokens (checked here so a regression in the quantizer shows too)."""
    from portside.testing.tiny import hf_greedy

    tokens, _ = _generate(tiny_llama, "eager", None, PROMPTS[:2])
    assert tokens == [hf_greedy(tiny_llama, p, MAX_TOKENS) for p in PROMPTS[:2]]
