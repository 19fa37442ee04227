"""int4 (GPTQ/AWQ) weights times 8-bit activations (`backends/cpu/int4_dot.py`, `csrc/int4_dot.cpp`):
every instruction-set path this CPU runs, against

(a) `portside.quant.int4_dot_ref`, the same arithmetic in pure torch: the integer block dots are
    exact on both sides, so they differ only in the order of the fp32 sums (and in converting an
    integer sum lane by lane): a few ulps of the row's sum of |lane terms|;
(b) dequantize-then-matmul (`dequantize` of the canonical weight): the kernel rounds x per block to
    int8, at most half a step (scale / 2) per value, so |y - x W^T| <= sum_k |W[n, k]| step(t, k) / 2
    (plus the fp32 sums above).

Shapes: N odd (the decode kernel's leftover row), odd group counts, K an odd number of 32s (the
SIMD kernels' half step), group sizes 32, 64, 128, 256 and one per row; zero points or none
(symmetric); act order (a random g_idx, through `CpuQuantOps`, which sorts the columns); T = 1
(decode), 2, 3, 5..9 (token rows 4 at a time and a remainder), 16, 17 and 40 (from 16 token rows on
AVX-512 VNNI and AVX2: gguf_tile.cpp's tiles of interleaved rows); fp32 and bf16, with a bias.
"""

from __future__ import annotations

import pytest
import torch

from portside.backends.cpu import native_ops
from portside.quant import int4_dot_ref
from portside.quant.gguf_dot_ref import quantize_activations
from portside.quant.weight import QuantWeight, dequantize, pack_int4

if native_ops.unavailable_reason() is not None:
    pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}", allow_module_level=True)

from portside.backends.cpu import gguf_dot, int4_dot  # noqa: E402

ISAS = gguf_dot.isas()
# (N, K, group size): odd group counts; K = 352 and 96 are odd numbers of 32s
SHAPES = ((33, 96, 32), (7, 352, 32), (9, 192, 64), (5, 384, 128), (3, 640, 128), (5, 768, 256), (3, 320, 320))
ROWS = (1, 2, 3, 5, 6, 7, 8, 9, 16, 17, 40)
EPS = torch.finfo(torch.float32).eps


def _weight(n: int, k: int, gs: int, zeros: bool, seed: int, act_order: bool = False) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0, :gs] = torch.tensor([0, 15] * (gs // 2), dtype=torch.uint8)  # the extreme codes
    groups = k // gs
    scales = (torch.rand(n, groups, generator=g) + 0.5) / (4 * k**0.5)
    zero = torch.randint(0, 16, (n, groups), generator=g).float() if zeros else None
    g_idx = torch.randperm(k, generator=g).remainder(groups).int() if act_order else None
    return QuantWeight("int", (n, k), pack_int4(codes).contiguous(), bits=4, scales=scales, zeros=zero, group_size=gs,
                       g_idx=g_idx, method="gptq")


def _x(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0  # an all-zero activation block: scale 0
    if t > 2:
        x[2] *= 1000  # rows of very different sizes (per-block scales)
    return x.to(dtype)


def _check(out: torch.Tensor, w: QuantWeight, x: torch.Tensor, bias: torch.Tensor, what: str) -> None:
    t, k = x.shape
    assert out.shape == (t, w.out_features) and out.dtype == x.dtype, what
    # (a) the same arithmetic: a few ulps of sum |lane term| per row (and bf16's rounding of y)
    ref, mag = int4_dot_ref.int4_dot(x, w.qweight, w.scales, w.zeros, w.group_size, w.g_idx, bias.to(x.dtype))
    tol = (k // 32 + 16) * 2 * EPS * (mag + bias.abs())
    if x.dtype == torch.bfloat16:
        tol = tol + ref.float().abs() * 2**-7  # one bf16 step: two fp32 sums a few ulps apart can round either side of a tie
    err = (out.float() - ref.float()).abs()
    assert (err <= tol).all(), f"{what}: vs the same arithmetic, max err/tol {(err / tol).max():.2f}"
    # (b) dequantize-then-matmul: bounded by the activations' rounding (steps in the sorted column order)
    dense = dequantize(w, torch.float32).double()
    perm = int4_dot_ref.sorted_columns(w.g_idx, k, w.group_size)
    xs, ds = (x, dense) if perm is None else (x.index_select(1, perm), dense.index_select(1, perm))
    ab = int4_dot_ref.act_block(w.group_size)
    _, d = quantize_activations(xs, ab)
    step = d.double().repeat_interleave(ab, dim=1)  # [T, K]
    bound = (ds.abs() @ step.T).T / 2 + tol
    exact = x.double() @ dense.T + bias.to(x.dtype).double()
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"{what}: vs dequantize-then-matmul, max err/bound {(err / bound).max():.2f}"
    assert err.mean() < bound.mean() / 4, what  # the rounding is not all there is


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("zeros", [True, False], ids=["zeros", "symmetric"])
def test_kernel_against_references(isa: str, zeros: bool):
    for i, (n, k, gs) in enumerate(SHAPES):
        w = _weight(n, k, gs, zeros, seed=i)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
        for t in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = _x(t, k, dtype, seed=t)
                out = int4_dot.linear(x, w.qweight, w.scales, w.zeros, gs, bias.to(dtype), isa=isa)
                _check(out, w, x, bias, f"{isa} N={n} K={k} group={gs} zeros={zeros} T={t} {dtype}")


def test_paths_agree_closely():
    """Every path against the scalar one, on a decode-sized row (2048 = 16 groups of 128)."""
    w = _weight(37, 2048, 128, True, seed=7)
    x = _x(1, 2048, torch.float32, seed=1)
    scalar = int4_dot.linear(x, w.qweight, w.scales, w.zeros, 128, isa="scalar")
    _, mag = int4_dot_ref.int4_dot(x, w.qweight, w.scales, w.zeros, 128)
    for isa in ISAS:
        out = int4_dot.linear(x, w.qweight, w.scales, w.zeros, 128, isa=isa)
        assert ((out - scalar).abs() <= 80 * 2 * EPS * mag).all(), isa


def test_decode_size_rows_and_threads():
    """A decode-sized matrix over several threads: the same as one thread."""
    w = _weight(301, 2048, 64, True, seed=9)
    x = _x(1, 2048, torch.float32, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int4_dot.linear(x, w.qweight, w.scales, w.zeros, 64)
        torch.set_num_threads(max(2, threads))
        many = int4_dot.linear(x, w.qweight, w.scales, w.zeros, 64)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)  # each output is one thread's sum, in the same order
    _check(one, w, x, torch.zeros(301), "decode")


def test_bad_arguments_are_refused():
    w = _weight(4, 128, 32, True, seed=0)
    x = torch.randn(2, 128)
    with pytest.raises(RuntimeError, match="do not fit"):
        int4_dot.linear(torch.randn(2, 96), w.qweight, w.scales, w.zeros, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        int4_dot.linear(x, w.qweight, w.scales, w.zeros, 48)
    with pytest.raises(RuntimeError, match="scales must be"):
        int4_dot.linear(x, w.qweight, w.scales[:, :2].contiguous(), None, 32)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        int4_dot.linear(x.half(), w.qweight, w.scales, w.zeros, 32)


# ---- through CpuQuantOps (backend option cpu_int4_act) ---------------------------------------------


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_quant_ops_take_the_kernel_by_option(act_order: bool):
    from portside.backends.cpu.moe import CpuModelOps

    assert CpuModelOps().int4_act == "fp32"  # cpu_int4_act's default
    for i, (n, k, gs) in enumerate(SHAPES):
        ops = CpuModelOps()
        ops.int4_act = "int8"
        w = ops.prepare_quantized(_weight(n, k, gs, True, seed=10 + i, act_order=act_order))
        assert w.layout.kernel == "w4a8" and w.layout.permuted == (act_order and k > gs)  # one group: in order
        bias = torch.randn(n)
        for t in (1, 5, 19):  # (19: the tiles, over the sorted columns)
            x = _x(t, k, torch.float32, seed=t)
            _check(ops.quantized_linear(x, w, bias), w, x, bias, f"CpuQuantOps N={n} K={k} group={gs} T={t}")
        ops.int4_act = "fp32"  # the weight-only kernel
        w = ops.prepare_quantized(_weight(n, k, gs, True, seed=10 + i, act_order=act_order))
        assert w.layout.kernel == "int4"


def test_int8_activation_checkpoints_and_int8_weights_keep_their_kernels():
    from portside.backends.cpu.moe import CpuModelOps

    ops = CpuModelOps()
    ops.int4_act = "int8"
    w = _weight(8, 128, 32, False, seed=1)
    w.act = "int8"  # the checkpoint rounds activations per token: the reference's rounding, not ours
    assert ops.prepare_quantized(w).layout.kernel == "int4"


def test_a_bad_cpu_int4_act_is_refused_naming_the_choices(tmp_path):
    from portside import LLM
    from portside.testing.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match=r"cpu_int4_act='int4': use one of \['int8', 'fp32'\]"):
        LLM(model=str(path), device="cpu", platform_options={"cpu_int4_act": "int4"})


# ---- end to end: a GPTQ (act order) and an AWQ checkpoint with cpu_int4_act=int8 ---------------------

PROMPT = [12, 250, 31, 99, 8, 120, 64, 300, 45, 77, 390, 6, 7]
N_FORCED = 16
CLEAR_MARGIN = 1.0  # logits: well above what rounding the activations to 8 bits moves them by here


@pytest.mark.parametrize("fmt,kw", [("gptq", {"desc_act": True}), ("awq", {})], ids=["gptq-act-order", "awq"])
def test_int8_activations_agree_with_transformers_where_the_margin_is_clear(fmt: str, kw: dict, tmp_path):
    """Teacher-forced on transformers' greedy tokens (on the dequantized weights), the engine with
    cpu_int4_act=int8 picks transformers' next token wherever its top-2 margin is clear; its
    logprobs differ from fp32 activations' (the kernel ran), whose tokens equal transformers' at
    every step."""
    from transformers import AutoModelForCausalLM

    from portside import LLM, SamplingParams
    from portside.testing.quant_checkpoints import write_quantized
    from portside.testing.tiny import hf_greedy, make_tiny_model

    src = make_tiny_model(tmp_path / "m", "llama")
    path, oracle = write_quantized(src, tmp_path / fmt, fmt, bits=4, group_size=32, **kw)
    theirs = hf_greedy(oracle, PROMPT, N_FORCED)
    model = AutoModelForCausalLM.from_pretrained(str(oracle), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + theirs])).logits[0, len(PROMPT) - 1 : len(PROMPT) - 1 + N_FORCED]
    top2 = logits.topk(2).values
    clear = ((top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN).tolist()
    assert sum(clear) >= N_FORCED // 6
    prompts = [{"prompt_token_ids": PROMPT + theirs[:i]} for i in range(N_FORCED)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    runs = {}
    for act in ("int8", "fp32"):
        llm = LLM(model=str(path), device="cpu", max_model_len=128,
                  platform_options={"cpu_fused_decode": "off", "cpu_int4_act": act})
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[act] = ([o.outputs[0].token_ids[0] for o in outs], [o.outputs[0].cumulative_logprob for o in outs])
        llm.engine.shutdown()
    forced, logprobs = runs["int8"]
    assert [a for a, c in zip(forced, clear) if c] == [b for b, c in zip(theirs, clear) if c]
    assert runs["fp32"][0] == theirs
    assert max(abs(a - b) for a, b in zip(logprobs, runs["fp32"][1])) > 1e-4


def test_weight_only_int8_takes_the_w8a8_kernel_by_option():
    """cpu_int8_act=int8: a weight-only int8 layer runs the W8A8 kernel (activations rounded per
    token), exactly as the same weight declared with int8 activations does."""
    from portside.backends.cpu.moe import CpuModelOps
    from portside.quant.weight import quantize_per_channel

    dense = torch.randn(37, 256, generator=torch.Generator().manual_seed(3))
    ops = CpuModelOps()
    assert ops.int8_act == "fp32" and ops.prepare_quantized(quantize_per_channel(dense, "int8")).layout.kernel == "int8"
    ops.int8_act = "int8"
    w = ops.prepare_quantized(quantize_per_channel(dense, "int8"))
    assert w.layout.kernel == "w8a8" and w.act is None
    declared = CpuModelOps().prepare_quantized(quantize_per_channel(dense, "int8", act="int8"))
    assert declared.layout.kernel == "w8a8"
    for t in (1, 7):
        x = _x(t, 256, torch.float32, seed=t)
        assert torch.equal(ops.quantized_linear(x, w), CpuModelOps().quantized_linear(x, declared))
