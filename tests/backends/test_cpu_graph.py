"""cpu graph modes end to end: greedy parity with transformers for eager, inductor and openvino,
proof that the OpenVINO mode really ran OpenVINO (not a silent Inductor fallback), and that the
inductor mode does not recompile after its warm-up.

One engine per mode runs a ragged batch across block boundaries with a small token budget, so
steps mix decodes with prefill chunks and the token count changes every step (dynamic shapes).
Engines are built once per model, mode and attention and shared by the tests of this module
(an inductor engine compiles its graphs for ~10 s, more with a cold compile cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from portside import LLM, SamplingParams
from portside.backends.cpu.graph import GRAPH_MODES
from portside.testing.tiny import hf_greedy, make_tiny_model

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [3, 9, 17, 30]

# compiling a graph mode takes 10-25 s on a 2-core machine: those run under -m slow (CI)
COMPILED_SLOW = [m if m == "eager" else pytest.param(m, marks=pytest.mark.slow) for m in GRAPH_MODES]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_path(request, tmp_path_factory) -> Path:
    if request.param == "llama":  # the session's tiny Llama (the same defaults): its engines serve both
        return request.getfixturevalue("tiny_llama")
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


_ENGINES: dict[tuple[str, str, str], LLM] = {}
_GRAPHS_AT_BUILD: dict[int, int] = {}  # id(engine) -> graphs dynamo compiled while building it


@pytest.fixture(scope="module", autouse=True)
def _shared_engines():
    yield
    for llm in _ENGINES.values():
        llm.shutdown()
    _ENGINES.clear()
    _GRAPHS_AT_BUILD.clear()


def _prompts(llm: LLM) -> list[list[int]]:
    text = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun " * 3
    base = llm.get_tokenizer().encode(text)
    return [base[2 * i : 2 * i + n] for i, n in enumerate(PROMPT_LENGTHS)]


def _engine(model_path: Path, mode: str, attention: str = "torch") -> LLM:
    """The module's engine for this model, mode and attention (built on first use)."""
    from torch._dynamo.utils import counters

    if mode == "openvino":
        pytest.importorskip("openvino", reason="openvino is not installed (pip install 'portside[openvino]')")
    key = (str(model_path), mode, attention)
    if key not in _ENGINES:
        before = counters["stats"]["unique_graphs"]
        _ENGINES[key] = llm = LLM(
            model=str(model_path), device="cpu", max_model_len=128, block_size=8, max_num_batched_tokens=24,
            platform_options={"cpu_graph": mode, "cpu_attention": attention},
        )  # fmt: skip
        _GRAPHS_AT_BUILD[id(llm)] = counters["stats"]["unique_graphs"] - before
    return _ENGINES[key]


def _runner(llm: LLM):
    return llm.engine.executor.runner.graph_runner


@pytest.mark.parametrize("mode", COMPILED_SLOW)
def test_greedy_parity_with_transformers(request, model_path, mode):
    """Attention through the Python (torch) backend; for qwen2 in the compiled modes, through the
    default one, on the engine of the tests below: the torch backend inside a compiled graph is
    the llama case's, qwen2's qkv biases are compiled in either way (one engine fewer per mode).
    OpenVINO keeps attention out of its segments (the platform's backend runs between them, as in
    eager mode, which tests both backends): both models on the default's engine (one fewer)."""
    compiled_qwen2 = mode != "eager" and request.node.callspec.params["model_path"] == "qwen2"
    llm = _engine(model_path, mode, attention="auto" if compiled_qwen2 or mode == "openvino" else "torch")
    assert _runner(llm).name == mode
    prompts = _prompts(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(model_path, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, f"{mode}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("mode", COMPILED_SLOW)
def test_batch1_decode_parity_with_transformers(model_path, mode):
    """One request at a time: every decode step is a one-row batch (inductor: the graph whose
    linears `GemvAsReduction` rewrote), attention through the default (native when it builds)."""
    llm = _engine(model_path, mode, attention="auto")
    prompt = _prompts(llm)[2]
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model_path, prompt, MAX_TOKENS), mode


@pytest.mark.slow
def test_inductor_decode_steps_attend_in_cpp(model_path, monkeypatch):
    """With the native operators, a decode-only step's attention runs in C++
    (`portside_cpu_native::attention` with the plan `forward_context` installs): the Python
    backend is called for prefill steps only, and greedy tokens still match transformers, batched."""
    from portside.backends.cpu import native_ops
    from portside.backends.cpu.attention import NativeAttentionBackend

    if native_ops.unavailable_reason() is not None:
        pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}")
    calls: list[bool] = []  # per Python attention call: was its step decode-only?
    forward = NativeAttentionBackend.forward

    def counting(self, query, key, value, kv_cache, metadata, scale):
        calls.append(metadata.num_decode_tokens == query.shape[0])
        return forward(self, query, key, value, kv_cache, metadata, scale)

    llm = _engine(model_path, "inductor", attention="auto")
    monkeypatch.setattr(NativeAttentionBackend, "forward", counting)
    prompts = _prompts(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_path, prompt, MAX_TOKENS)
    assert calls and not any(calls)  # prefill (and mixed) steps only


@pytest.mark.slow
def test_openvino_really_executes(tiny_llama):
    """Every step goes through compiled OpenVINO models: the runner counts its inferences, and
    each segment is an OpenVINO CompiledModel on the CPU device with a dynamic token axis."""
    llm = _engine(tiny_llama, "openvino", attention="auto")  # the parity tests' engine
    runner = _runner(llm)
    import openvino as ov

    assert all(isinstance(c, ov.CompiledModel) for c in runner._compiled)
    assert len(runner._compiled) == llm.engine.executor.runner.model.config.num_layers + 1
    assert all(c.inputs[0].get_partial_shape()[0].is_dynamic for c in runner._compiled)
    assert runner._compiled[0].get_property("EXECUTION_DEVICES") == ["CPU"]
    before = runner.num_ov_calls
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    steps = 3  # one prefill step + two decode steps
    assert runner.num_ov_calls - before == steps * len(runner._compiled)


@pytest.mark.slow
def test_inductor_does_not_recompile_after_warmup(tiny_llama):
    """The inductor runner compiles the model body and the LM head at startup (two graphs each: 1 token and a
    symbolic count >= 2); batches of other shapes afterwards (prefill chunks, mixed steps, decodes
    of several sizes) reuse them: dynamo compiles no new graph and hits no recompile limit."""
    from torch._dynamo.utils import counters

    llm = _engine(tiny_llama, "inductor")
    assert _runner(llm).name == "inductor"
    # compiled in capture: the body and the LM head, 1 row and >= 2 rows each (a graph break
    # would add more)
    assert _GRAPHS_AT_BUILD[id(llm)] == 4
    warm_graphs, warm_frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for lengths in ([5], [3, 9, 17, 30], [2, 2, 2, 2, 2, 40], [7, 1]):
        llm.generate([{"prompt_token_ids": list(range(1, n + 1))} for n in lengths], params, use_tqdm=False)
    # every call hit a cached graph: a guard miss would convert a frame again (also when dynamo
    # gives up at its recompile limit and falls back to eager, which adds no graph)
    assert counters["frames"]["total"] == warm_frames
    assert counters["stats"]["unique_graphs"] == warm_graphs


def test_inductor_falls_back_to_eager_for_a_non_piecewise_model(tiny_llama, caplog):
    """A model without the PiecewiseModel seam runs eagerly (with a warning), never compiled whole."""
    import torch

    from portside.backends.cpu.graph import InductorGraphRunner

    def model_fn(input_ids, positions, ctx):  # a plain ModelFn
        return torch.ones(input_ids.shape[0], 4)

    with caplog.at_level("WARNING"):
        runner = InductorGraphRunner(model_fn, None)
    assert "not a PiecewiseModel" in caplog.text
    assert torch.equal(runner(torch.zeros(3, dtype=torch.long), torch.arange(3), None), torch.ones(3, 4))


def test_unknown_graph_mode_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match=r"cpu backend option cpu_graph='tvm': use one of \['eager', 'inductor', 'openvino'\]"):
        LLM(model=str(tiny_llama), device="cpu", max_model_len=64, platform_options={"cpu_graph": "tvm"})


def test_unknown_attention_impl_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match=r"cpu backend option cpu_attention='fast': use one of \['auto', 'native', 'torch', 'ipex'\]"):
        LLM(model=str(tiny_llama), device="cpu", max_model_len=64, platform_options={"cpu_attention": "fast"})


def test_unknown_platform_option_is_rejected(tiny_llama):
    """A misspelt option fails with the known ones named, rather than being ignored."""
    with pytest.raises(ValueError, match=r"unknown cpu backend option\(s\) \['cpu_grpah'\] \(did you mean cpu_graph\?\)"):
        LLM(model=str(tiny_llama), device="cpu", max_model_len=64, platform_options={"cpu_grpah": "inductor"})


# ---- platform knobs: collectives, threads ------------------------------------------------------


def test_dist_backend_selection():
    from portside.backends.cpu.communicator import ccl_installed, select_dist_backend

    assert select_dist_backend({"PORTSIDE_CPU_DIST": "gloo"}) == "gloo"
    assert select_dist_backend({}) == ("ccl" if ccl_installed() else "gloo")
    if not ccl_installed():
        with pytest.raises(RuntimeError, match="oneccl_bindings_for_pytorch"):
            select_dist_backend({"PORTSIDE_CPU_DIST": "ccl"})
    with pytest.raises(ValueError, match="PORTSIDE_CPU_DIST"):
        select_dist_backend({"PORTSIDE_CPU_DIST": "mpi"})


def test_threads_never_exceed_usable_cores():
    import torch

    from portside.backends.cpu.platform import configure_threads, usable_cores

    before = torch.get_num_threads()
    try:
        assert configure_threads(10_000) == usable_cores()
        assert configure_threads(1) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("native", [False, True], ids=["fused-reduction", "native-op"])
def test_gemv_pass_rewrites_single_row_linears_only(native, dtype):
    """`GemvAsReduction` turns a one-row `F.linear` (with or without bias; fp32 or bf16) into the
    native C++ operator, or (native=False) into mul + sum, materializing a row computed in the
    graph first (not a graph input); the result is the same (bf16: up to the rounding of the
    output), and a multi-row one (a GEMM) is left alone."""
    import torch
    import torch.nn.functional as F

    from portside.backends.cpu.gemv_pass import GemvAsReduction

    dt = getattr(torch, dtype)
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    w, b = torch.randn(7, 5, dtype=dt), torch.randn(7, dtype=dt)
    seen: list[list[str]] = []
    rewrite = GemvAsReduction(native=native)
    assert rewrite.native == native  # the operator builds on this machine

    def backend(gm, example_inputs):
        rewrite(gm.graph)
        gm.recompile()
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    def f(x):
        return F.linear(x, w) + F.linear(x * 2, w, b)

    torch._dynamo.reset()
    fn = torch.compile(f, backend=backend, dynamic=False)
    for rows in (1, 3):
        x = torch.randn(rows, 5, dtype=dt)
        got = fn(x)
        assert got.dtype == dt and torch.allclose(got.float(), f(x).float(), atol=tol, rtol=tol)
    one, many = seen
    def plain(t: str) -> bool:  # F.linear prints as "<built-in function linear>"
        return "function linear" in t

    assert not any(map(plain, one))
    if native:
        assert sum("linear_row" in t for t in one) == 2 and not any("sum" in t for t in one)
    else:
        assert sum("sum" in t for t in one) == 2
        assert sum("materialize" in t for t in one) == 1  # for x * 2 only
    assert sum(map(plain, many)) == 2


def test_gemv_pass_sends_bf16_linears_of_a_bounded_row_count_to_the_amx_kernel():
    """With `amx_rows`, `GemvAsReduction` turns a bf16 `F.linear` whose rows the graph bounds to
    2..amx_rows (the few-rows graphs of `graph._compile`) into `portside_cpu_native::linear_amx`;
    unbounded rows (the many-rows graph) and fp32 keep the GEMM; results equal `F.linear`'s (one
    bf16 rounding step)."""
    import torch
    import torch.nn.functional as F

    from portside.backends.cpu.gemv_pass import GemvAsReduction

    rewrite = GemvAsReduction(native=True, amx_rows=8)
    if not rewrite.native:
        pytest.skip("the native operators do not build here")
    seen: list[list[str]] = []

    def backend(gm, example_inputs):
        rewrite(gm.graph)
        gm.recompile()
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    for dtype, bound, amx in [(torch.bfloat16, 8, True), (torch.bfloat16, None, False), (torch.float32, 8, False)]:
        w, b = torch.randn(24, 40, dtype=dtype), torch.randn(24, dtype=dtype)

        def f(x, w=w, b=b):
            return F.linear(x, w, b) * 2

        torch._dynamo.reset()
        seen.clear()
        fn = torch.compile(f, backend=backend)
        for rows in (3, 5):
            x = torch.randn(rows, 40, dtype=dtype)
            torch._dynamo.mark_dynamic(x, 0, min=2, max=bound) if bound else torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(fn(x), f(x), atol=1e-5, rtol=2 ** -7)
        assert len(seen) == 1  # one graph for both row counts
        assert any("linear_amx" in t for t in seen[0]) == amx
        assert any("function linear" in t for t in seen[0]) != amx


@pytest.mark.parametrize("widen_bf16", [False, True])
def test_eager_linears_send_one_row_to_the_native_operator_and_more_rows_to_onednn(widen_bf16):
    """cpu eager: F.linear of one fp32 or bf16 row runs `portside_cpu_native::linear_row`; of
    several rows (fp32 or bf16), oneDNN's linear over a prepacked copy of the weight, packed once:
    bf16 weights as they are where oneDNN packs bf16, or widened to an fp32 copy
    (`cpu_bf16_linears=widen`: the activations widened, the output bf16). Results equal F.linear
    (to each dtype's tolerance), in the input's dtype."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from portside.backends.cpu import native_ops
    from portside.backends.cpu.eager_linears import EagerLinears, PackedWeights, prepack_unavailable_reason

    if native_ops.unavailable_reason() is not None:  # also loads the operators when this test runs alone
        pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}")

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    packed = PackedWeights(batch_hint=8, widen_bf16=widen_bf16) if prepack_unavailable_reason() is None else None
    w, b = torch.randn(48, 64), torch.randn(48)
    cases = [(torch.randn(1, 64), "linear_row"), (torch.randn(1, 64).bfloat16(), "linear_row")]
    packs_bf16 = packed is not None and (widen_bf16 or _onednn_packs_bf16())
    if packed is not None:  # oneDNN packs bf16 weights only on CPUs with AVX-512 (or AVX-NE-CONVERT)
        cases += [(torch.randn(5, 64), "mkldnn"), (torch.randn(300, 64), "mkldnn"),
                  (torch.randn(7, 64).bfloat16(), "mkldnn" if packs_bf16 else None)]
    for x, kernel in cases:
        ww, bb = torch.nn.Parameter(w.to(x.dtype), requires_grad=False), b.to(x.dtype)  # a model's weight
        for bias in (bb, None):
            with Record() as rec, EagerLinears(native=True, packed=packed):
                out = F.linear(x, ww, bias=bias)
            kernels = {"linear_row": "linear_row", "mkldnn": "mkldnn._linear_pointwise"}  # not a failed reorder
            used = {k for k, name in kernels.items() if any(name in op for op in rec.ops)}
            assert used == ({kernel} if kernel else set()), rec.ops
            assert out.dtype == x.dtype and out.shape == (x.shape[0], 48)
            tol = {"atol": 2e-2, "rtol": 2e-2} if x.dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
            torch.testing.assert_close(out, F.linear(x, ww, bias), **tol)
            if x.dtype == torch.bfloat16:  # fp32 sums of the same bf16 values, rounded once
                exact = F.linear(x.float(), ww.float(), None if bias is None else bias.float()).bfloat16()
                torch.testing.assert_close(out, exact, atol=0, rtol=2 ** -7)  # at most one bf16 rounding step
    if packed is not None:
        assert len(packed) == 1 + packs_bf16  # the fp32 and the bf16 weight, each packed once for all its calls
        # a temporary weight (a dequantized one: its address is reused for the next) is never packed
        assert packed.get(torch.randn(48, 64)) is None and len(packed) == 1 + packs_bf16
        if packs_bf16:  # the capture step's record: the kinds `warm` runs, in the packed weights' dtype
            packed.recording = True
            with EagerLinears(native=True, packed=packed):
                F.linear(torch.randn(3, 64).bfloat16(), torch.nn.Parameter(w.bfloat16(), requires_grad=False), b.bfloat16())
            packed.recording = False
            dtypes = {dtype for _, dtype, _ in packed.kinds}
            assert dtypes == {torch.float32 if widen_bf16 else torch.bfloat16}
            assert packed.warm(16) > 0


def _onednn_packs_bf16() -> bool:
    import torch

    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 2)
    except RuntimeError:
        return False
    return True


def test_eager_prepack_is_used_in_batched_steps_and_can_be_turned_off(model_path):
    """The eager engine packs the weights its multi-row linears use at start-up, each once, and
    its batched greedy tokens match transformers; cpu_prepack=off keeps the dense weights only; a bad value
    (of it, cpu_bf16_linears or cpu_kv_prefault) is rejected with the values it takes. (The KV cache is
    prefaulted unless cpu_kv_prefault=off.)"""
    from portside.backends.cpu.eager_linears import prepack_unavailable_reason

    if prepack_unavailable_reason() is not None:
        pytest.skip(prepack_unavailable_reason())
    llm = _engine(model_path, "eager", attention="auto")
    packed = _runner(llm).packed_weights
    # packed at start-up (`capture`): qkv, o, gate_up and down of every layer, and the LM head
    expected = 4 * len(llm.engine.executor.runner.model.model.layers) + 1
    assert len(packed) == expected
    prompts = _prompts(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_path, prompt, MAX_TOKENS)
    assert len(packed) == expected  # nothing packed again
    off = LLM(model=str(model_path), device="cpu", dtype="float32", max_model_len=256, enable_prefix_caching=False,
              platform_options={"cpu_graph": "eager", "cpu_prepack": "off", "cpu_kv_prefault": "off"})
    assert _runner(off).packed_weights is None
    with pytest.raises(ValueError, match="cpu_prepack='sometimes': use one of"):
        LLM(model=str(model_path), device="cpu", platform_options={"cpu_prepack": "sometimes"})
    with pytest.raises(ValueError, match=r"cpu_bf16_linears='fp16': use one of \['auto', 'amx', 'native', 'widen'\]"):
        LLM(model=str(model_path), device="cpu", platform_options={"cpu_bf16_linears": "fp16"})
    # the KV cache: touched at start-up by default, lazily with cpu_kv_prefault=off
    assert llm.engine.executor.runner.attn_backend.prefault_host_cache
    assert not off.engine.executor.runner.attn_backend.prefault_host_cache
    with pytest.raises(ValueError, match=r"cpu_kv_prefault='yes': use one of \['on', 'off'\]"):
        LLM(model=str(model_path), device="cpu", platform_options={"cpu_kv_prefault": "yes"})
