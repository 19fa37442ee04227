"""The cpu backend's attention features (sliding window, logit soft-cap) and mixture-of-experts.

- every cpu attention path (torch, native C kernels, IPEX's feature fallback over its own cache
  layout, the graph's custom operators) against `reference.paged_attention` with the features:
  windows of 1 key, smaller than, equal to and larger than the sequences, across block
  boundaries and the native kernel's 128-token splits; decodes, prefill chunks over a cached
  prefix and mixed batches; fp32 and bf16. A windowed decode reads no key before its window;
- `CpuModelOps.moe_experts` against core's reference (2 and 8 experts, top-1/2, 1 and 37
  tokens, fp32/bf16, experts no token chose), eager and compiled;
- the fused batch-1 decode refuses models it does not compute exactly;
- models with features and with experts through the engine (eager and inductor) against
  transformers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cpu_attention import Case, make_case  # tests/backends is on sys.path (rootdir-relative)
from tolerances import assert_close

from portside.attention import reference
from portside.backends.cpu import kernels, native_ops
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.backends.cpu.ipex_attention import IpexAttentionBackend
from portside.backends.cpu.moe import CpuModelOps
from portside.contract import AttentionBackend, ForwardContext
from portside.ops.moe import moe_experts as reference_moe_experts
from portside.ops.moe import select_experts

BLOCK = 8
SCALE = 0.5  # scores of std ~4 for random q, k of head size 64: the soft-cap matters
BATCHES = {  # (q_lens, seq_lens), decodes first
    "decodes": ([1] * 6, [1, 7, 8, 9, 24, 300]),  # 300: three 128-token splits without a window
    "prefills": ([16, 9, 3], [16, 40, 3]),  # 9 new tokens over a cached prefix of 31
    "mixed": ([1, 1, 7, 12], [5, 33, 50, 12]),
}
FEATURES = [
    *({"sliding_window": w} for w in (1, 8, 13, 24, 200, 1000)),  # 8: a block; 24, 12 and 200: some seq_lens
    {"logit_softcap": 2.0},
    {"logit_softcap": 30.0},
    {"sliding_window": 13, "logit_softcap": 2.0},
]
FEATURE_IDS = ["-".join(f"{k.split('_')[-1]}{v}" for k, v in f.items()) for f in FEATURES]


def _native() -> AttentionBackend:
    reason = kernels.native_unavailable_reason()
    if reason:
        pytest.skip(f"native cpu kernels unavailable: {reason}")
    return NativeAttentionBackend()


class _TorchPagedAttention:
    """IPEX's `reshape_and_cache` in torch (IPEX's layout), so IPEX's feature path runs without IPEX."""

    @staticmethod
    def reshape_and_cache(key, value, k_cache, v_cache, slots):  # k_cache [num_blocks, KVH, block_size, D]
        bs = k_cache.shape[2]
        blocks, offsets = slots.long() // bs, slots.long() % bs
        k_cache[blocks, :, offsets] = key
        v_cache[blocks, :, offsets] = value


def _ipex_feature_path() -> AttentionBackend:
    backend = IpexAttentionBackend.__new__(IpexAttentionBackend)
    backend._pa, backend._head_mapping = _TorchPagedAttention(), {}
    return backend


BACKENDS = {"torch": CpuAttentionBackend, "native": _native, "ipex": _ipex_feature_path}


def _case(backend: AttentionBackend, batch: str, dtype: torch.dtype, seed: int = 0) -> Case:
    q_lens, seq_lens = BATCHES[batch]
    return make_case(backend, q_lens, seq_lens, 8, 2, 64, BLOCK, dtype=dtype, seed=seed)


def _expected(case: Case, features: dict) -> torch.Tensor:
    md = case.metadata
    reference.write_kv(case.ref_cache, case.key, case.value, md.slot_mapping)
    return reference.paged_attention(case.query, case.ref_cache, md.query_start_loc_cpu, md.seq_lens_cpu,
                                     md.block_tables, SCALE, **features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("features", FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", list(BACKENDS))
def test_attention_features_match_the_reference(name, batch, features, dtype):
    backend = BACKENDS[name]()
    assert set(features) <= backend.features
    case = _case(backend, batch, dtype)
    expected = _expected(case, features)
    md = backend.prepare(case.metadata)
    out = backend.forward(case.query, case.key, case.value, case.cache, md, SCALE, **features)
    assert_close(out, expected, dtype, f"{name} {batch} {features}")
    k, v = backend.read_kv(case.cache, md.slot_mapping)
    assert_close(k, case.key, dtype)
    assert_close(v, case.value, dtype)


def test_features_change_the_result():
    """The cases above are not vacuous: each feature changes the reference's output."""
    case = _case(CpuAttentionBackend(), "mixed", torch.float32)
    plain = _expected(case, {})
    for features in ({"sliding_window": 13}, {"logit_softcap": 2.0}):
        assert (_expected(case, features) - plain).abs().max() > 0.1, features


@pytest.mark.parametrize("window", [1, 13, 200])
@pytest.mark.parametrize("name", ["torch", "native"])
def test_windowed_decode_reads_no_key_before_its_window(name, window):
    """Cache rows before a decode's window are never read: NaN there leaves the output exact (the
    native kernel skips every key before the window, the torch path every block before it)."""
    backend = BACKENDS[name]()
    case = _case(backend, "decodes", torch.float32, seed=1)
    expected = _expected(case, {"sliding_window": window})
    md = case.metadata
    for i, seq_len in enumerate(md.seq_lens_cpu):
        first = max(0, seq_len - window)  # the first key the decode sees
        if name == "torch":
            first = first // BLOCK * BLOCK  # it gathers whole blocks
        for p in range(first):
            case.cache[:, int(md.block_tables[i, p // BLOCK]), p % BLOCK] = float("nan")
    out = backend.forward(case.query, case.key, case.value, case.cache, backend.prepare(md), SCALE,
                          sliding_window=window)
    assert_close(out, expected)


# ---- the graph's custom operators --------------------------------------------------------------


def _native_ops_or_skip() -> None:
    if native_ops.unavailable_reason() is not None:
        pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}")


@pytest.mark.parametrize("features", [{}, *FEATURES[2:4], *FEATURES[-3:]], ids=["none", *FEATURE_IDS[2:4], *FEATURE_IDS[-3:]])
@pytest.mark.parametrize("batch", ["decodes", "mixed"])
@pytest.mark.parametrize("op", ["python", "native"])
def test_attention_ops_carry_the_features(op, batch, features):
    """`portside_cpu::attention` and its C++ front `portside_cpu_native::attention` (what the
    inductor graph calls) with a layer's features as their trailing arguments."""
    _native_ops_or_skip()
    from portside.backends.cpu import attention_op

    backend = _native()
    case = _case(backend, batch, torch.float32, seed=2)
    expected = _expected(case, features)
    md = backend.prepare(case.metadata)
    fn = torch.ops.portside_cpu_native.attention if op == "native" else torch.ops.portside_cpu.attention
    with attention_op.forward_context(ForwardContext(backend, [case.cache], md), native=op == "native"):
        out = fn(case.query, case.key, case.value, 0, SCALE, *attention_op.feature_args(features))
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_attention_op_attends_decodes_with_features_in_cpp(dtype):
    """In a decode-only step the C++ operator attends itself (no forward context: a call back
    into Python would raise), features included; a bf16 model's queries go in as bf16."""
    _native_ops_or_skip()
    backend = _native()
    case = _case(backend, "decodes", dtype, seed=3)
    features = {"sliding_window": 13, "logit_softcap": 2.0}
    expected = _expected(case, features)
    step = backend.prepare(case.metadata).backend_data.native_step
    torch.ops.portside_cpu_native.set_decode_step([case.cache], *step.tensors)
    try:
        out = torch.ops.portside_cpu_native.attention(case.query, case.key, case.value, 0, SCALE, 13, 2.0)
    finally:
        torch.ops.portside_cpu_native.clear_decode_step()
    assert out.dtype == dtype
    assert_close(out, expected, dtype)


def test_feature_args_reject_unknown_features():
    from portside.backends.cpu.attention_op import feature_args

    assert feature_args({"sliding_window": None, "logit_softcap": None}) == (0, 0.0)
    assert feature_args({"sliding_window": 8, "logit_softcap": 50}) == (8, 50.0)
    with pytest.raises(ValueError, match="alibi"):
        feature_args({"alibi": 1})


# ---- mixture-of-experts ------------------------------------------------------------------------


def _moe_inputs(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, idle: int = 0,
                hidden: int = 48, inter: int = 40):
    """x, w13, w2, weights, ids; with `idle`, the last `idle` experts receive no token."""
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts * 10 + top_k)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=gen)).to(dtype)
    w2 = (0.2 * torch.randn(num_experts, hidden, inter, generator=gen)).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if idle:
        logits[:, num_experts - idle :] = -1e9
    weights, ids = select_experts(logits, top_k, renormalize=top_k > 1)
    return x, w13, w2, weights, ids


MOE_PATHS = {  # CpuModelOps (fp32: the native operator when it builds), and the torch operator
    "ops": CpuModelOps().moe_experts,
    "torch-op": lambda *args: torch.ops.portside_cpu.moe_experts(*args),
}


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("num_experts,top_k,idle", [(2, 1, 0), (2, 2, 0), (8, 1, 3), (8, 2, 3), (8, 2, 0)])
@pytest.mark.parametrize("path", list(MOE_PATHS))
def test_moe_experts_match_the_reference(path, num_experts, top_k, idle, num_tokens, dtype, activation):
    """(2 experts, top-2, 37 tokens: 37 rows per expert, where the native operator runs a GEMM.)"""
    x, w13, w2, weights, ids = _moe_inputs(num_tokens, num_experts, top_k, dtype, idle)
    if idle:
        assert int(ids.max()) < num_experts - idle
    expected = reference_moe_experts(x, w13, w2, weights, ids, activation)
    out = MOE_PATHS[path](x, w13, w2, weights, ids, activation)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("num_tokens", [1, 3, 6, 200])
def test_native_moe_experts_odd_sizes(num_tokens):
    """Widths that are no multiple of the kernel's 8 lanes, an odd down-row count, and 1-6 token
    rows per expert (its 4-row blocks and their remainders) or many (GEMMs), on 1 and 2 threads."""
    _native_ops_or_skip()
    x, w13, w2, weights, ids = _moe_inputs(num_tokens, 8, 2, torch.float32, hidden=51, inter=27)
    expected = reference_moe_experts(x, w13, w2, weights, ids)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert_close(torch.ops.portside_cpu_native.moe_experts(x, w13, w2, weights, ids), expected)
    finally:
        torch.set_num_threads(previous)


def test_native_moe_experts_rejects_bad_expert_ids():
    _native_ops_or_skip()
    x, w13, w2, weights, ids = _moe_inputs(3, 8, 2, torch.float32)
    ids[1, 0] = 8
    with pytest.raises(RuntimeError, match="expert id 8 outside"):
        torch.ops.portside_cpu_native.moe_experts(x, w13, w2, weights, ids)


def test_fused_moe_routes_as_the_reference():
    x, w13, w2, _, _ = _moe_inputs(37, 8, 2, torch.float32)
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(1))
    weights, ids = select_experts(logits, 2, renormalize=True)
    expected = reference_moe_experts(x, w13, w2, weights, ids)
    assert_close(CpuModelOps().fused_moe(x, logits, w13, w2, 2, True), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.slow
def test_moe_experts_compile_as_one_operator(dtype):
    """Its data-dependent grouping is an opaque operator: a compiled graph holds it whole
    (fullgraph) and serves every token count."""
    ops = CpuModelOps()
    x, w13, w2, _, _ = _moe_inputs(5, 8, 2, dtype)
    compiled = torch.compile(lambda t, w, i: ops.moe_experts(t, w13, w2, w, i), fullgraph=True, dynamic=True)
    for num_tokens in (5, 37, 2):
        x, _, _, weights, ids = _moe_inputs(num_tokens, 8, 2, dtype)
        assert_close(compiled(x, weights, ids), reference_moe_experts(x, w13, w2, weights, ids), dtype)


def test_cpu_platform_supplies_the_grouped_moe():
    from portside.backends.cpu.platform import CpuPlatform

    assert isinstance(CpuPlatform.model_ops(None), CpuModelOps)


# ---- the fused batch-1 decode only takes what it computes ------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_model(tiny_llama):
    from portside.config import ModelConfig
    from portside.model.registry import load_model

    return load_model(ModelConfig(path=str(tiny_llama), dtype=torch.float32, max_model_len=128), torch.device("cpu"))


def test_fused_decode_refuses_models_it_does_not_compute(tiny_llama_model, monkeypatch):
    from portside.backends.cpu.fused_decode import unsupported_reason

    _native_ops_or_skip()
    model = tiny_llama_model
    assert unsupported_reason(model) is None
    features = model.attention_features(1)
    monkeypatch.setitem(features, "sliding_window", 8)
    assert "layer 1 uses attention features" in unsupported_reason(model)
    monkeypatch.setitem(features, "sliding_window", None)
    monkeypatch.setitem(features, "logit_softcap", 30.0)
    assert "attention features" in unsupported_reason(model)
    monkeypatch.setitem(features, "logit_softcap", None)
    assert unsupported_reason(model) is None

    for arch in ("Qwen2MoeForCausalLM", "Gemma2ForCausalLM"):  # the Llama class serves Qwen2-MoE too
        monkeypatch.setattr(model, "config", dataclasses.replace(model.config, architecture=arch))
        assert "architecture" in unsupported_reason(model)
    monkeypatch.undo()
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, hidden_act="gelu"))
    assert "hidden_act" in unsupported_reason(model)
    monkeypatch.undo()

    class LlamaForCausalLM(type(model)):  # a subclass, even of the same name, may change a layer
        pass

    monkeypatch.setattr(model, "__class__", LlamaForCausalLM)
    assert "is not a Llama-family model class" in unsupported_reason(model)


# ---- through the engine ----------------------------------------------------------------------


MODELS = {
    "gemma2": ("gemma2", {}),  # windows of 8 on every other layer, soft-capped scores and logits
    "mixtral-window": ("mixtral", {"sliding_window": 8}),  # experts and a window of 8
}


@pytest.fixture(scope="module", params=list(MODELS))
def feature_model(request, tmp_path_factory):
    from portside.testing.tiny import make_tiny_model

    arch, overrides = MODELS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


@pytest.mark.parametrize("mode", ["eager", pytest.param("inductor", marks=pytest.mark.slow), pytest.param("openvino", marks=pytest.mark.slow)])
def test_feature_and_moe_models_match_transformers(feature_model, mode):
    """Greedy tokens equal transformers' for prompts longer than the window, batched (steps mix
    decodes and prefill chunks) and alone (batch-1 decodes: the native kernel, or in inductor
    mode the C++ operator, with the features; the fused step refuses these models)."""
    from portside import LLM, SamplingParams
    from portside.testing.tiny import hf_greedy

    if mode == "openvino":
        pytest.importorskip("openvino", reason="openvino is not installed (pip install 'portside[openvino]')")
        if "mixtral" in str(feature_model):
            with pytest.raises(ValueError, match="openvino' does not support mixture-of-experts"):
                LLM(model=str(feature_model), device="cpu", platform_options={"cpu_graph": mode})
            return
    llm = LLM(model=str(feature_model), device="cpu", dtype="float32", max_model_len=128, block_size=8,
              max_num_batched_tokens=24, platform_options={"cpu_graph": mode})
    runner = llm.engine.executor.runner
    assert getattr(runner.graph_runner, "_fused", None) is None
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    text = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun " * 3
    base = llm.get_tokenizer().encode(text)
    prompts = [base[2 * i : 2 * i + n] for i, n in enumerate([3, 11, 20, 30])]
    for batch in (prompts, prompts[2:3]):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        for prompt, out in zip(batch, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(feature_model, prompt, 8), f"prompt of {len(prompt)}"
