"""The fused native batch-1 decode step (`backends/cpu/fused_decode.py`, `csrc/fused_decode.cpp`):
one step against the model's own forward pass (hidden states, logits and the K/V rows it writes),
across the 128-token attention splits, for Llama, Qwen2 (qkv bias) and tied embeddings, on 1 and 2
threads; greedy parity with transformers through the engine, which must run every batch-1 decode
in it; the same for bf16 models (bf16 weights and KV cache) against the model and transformers in
bf16; and when it stays out of the way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portside import LLM, SamplingParams
from portside.config import ModelConfig
from portside.contract import ForwardContext
from portside.model.registry import load_model
from portside.testing.paged import single_sequence_metadata
from portside.testing.tiny import hf_greedy, make_tiny_model
from portside.testing.tolerances import assert_close

native_ops = pytest.importorskip("portside.backends.cpu.native_ops")
if native_ops.unavailable_reason() is not None:
    pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}", allow_module_level=True)

from portside.backends.cpu.attention import NativeAttentionBackend  # noqa: E402
from portside.backends.cpu.fused_decode import FusedDecoder, unsupported_reason  # noqa: E402

VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # qkv bias
    "tied-hd32": ("llama", {"tie_word_embeddings": True, "head_dim": 32, "num_attention_heads": 8,
                            "num_key_value_heads": 2}),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory) -> Path:
    arch, overrides = VARIANTS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


def _context(backend, caches, num_cached: int, num_new: int, table: list[int], block_size: int) -> ForwardContext:
    md = backend.prepare(single_sequence_metadata(num_cached, num_new, table, block_size))
    return ForwardContext(backend=backend, kv_caches=caches, metadata=md)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("context", [1, 9, 127, 128, 129, 300])
def test_fused_step_matches_the_model(variant, context, threads):
    """Prefill `context` tokens with the model, then decode one with the model and with the fused
    step on copies of the cache: same hidden states, logits and cache (the K/V row written)."""
    model = load_model(ModelConfig(path=str(variant), max_model_len=512), torch.device("cpu"))
    assert unsupported_reason(model) is None
    backend, block_size = NativeAttentionBackend(), 8
    spec = model.kv_cache_spec()
    num_blocks = 48
    shape = backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
    table = [(7 * i + 3) % num_blocks for i in range(num_blocks)]  # scattered blocks
    gen = torch.Generator().manual_seed(context)
    ids = torch.randint(0, model.config.vocab_size, (context + 1,), generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            model(ids[:context], torch.arange(context), _context(backend, caches, 0, context, table, block_size))
            fused_caches = [c.clone() for c in caches]
            step_ids, step_pos = ids[context:], torch.tensor([context])
            ctx = _context(backend, caches, context, 1, table, block_size)
            expected_hidden = model(step_ids, step_pos, ctx)
            expected_logits = model.compute_logits(expected_hidden)
            ctx = _context(backend, fused_caches, context, 1, table, block_size)
            hidden, logits = FusedDecoder(model)(step_ids, step_pos, ctx)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(hidden, expected_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    for got, want in zip(fused_caches, caches, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# Every variant through the eager runner; the inductor runner (whose graphs then compute only the
# prefill: the dispatch to the fused step is the runners' shared code) once, on the variant
# test_cpu_graph's inductor parity does not cover (tied LM head, head_dim 32): an inductor
# engine compiles its graphs for 10-20 s on the CI machine.
ENGINE_CASES = [*((v, "eager") for v in VARIANTS), ("tied-hd32", "inductor")]


@pytest.mark.parametrize(
    ("variant", "mode"),
    [pytest.param(v, m, marks=pytest.mark.slow) if m != "eager" else (v, m) for v, m in ENGINE_CASES],
    indirect=["variant"], ids=[f"{v}-{m}" for v, m in ENGINE_CASES],
)
def test_engine_runs_batch1_decodes_fused_with_greedy_parity(variant, mode, monkeypatch):
    """One request at a time through the engine: every decode step runs in the fused step (and
    nothing else does), and greedy tokens equal transformers', across blocks and splits."""
    calls: list[int] = []
    fused_call = FusedDecoder.__call__

    def counting(self, input_ids, positions, ctx):
        calls.append(int(positions[0]))
        return fused_call(self, input_ids, positions, ctx)

    monkeypatch.setattr(FusedDecoder, "__call__", counting)
    llm = LLM(model=str(variant), device="cpu", max_model_len=512, block_size=8, platform_options={"cpu_graph": mode})
    calls.clear()  # the inductor runner's warm-up step
    prompt = list(range(3, 3 + 120))
    n = 16  # the context crosses 128 tokens: one attention split, then two
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]  # fmt: skip
    assert out.outputs[0].token_ids == hf_greedy(variant, prompt, n)
    assert calls == list(range(len(prompt), len(prompt) + n - 1))  # every decode step, and only those


# bf16: greedy tokens against transformers in bf16. Both round every bf16 operation but in other
# orders (the native kernels attend in fp32, the fused step keeps its activations in fp32), so two
# logits within bf16's rounding of each other may be ordered either way (measured on these tiny
# models: gaps of 0.03 and exact bf16 ties where the tokens first differ). Each token chosen must
# be transformers' greedy choice given the same prefix, up to such a near-tie.
BF16_MARGIN = {"atol": 0.06, "rtol": 0.01}
# Inductor's compiled bf16 prefill fuses operations and rounds less often than transformers (a
# first token 0.16 below transformers' argmax on the tiny Llama): the model-level bf16 logit
# tolerance of test_model_archs there.
BF16_MARGIN_INDUCTOR = {"atol": 0.15, "rtol": 0.05}
BF16_PROMPTS = [list(range(3, 3 + 120)), [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45]]  # the first crosses 128 tokens


def _hf_bf16(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()


def assert_bf16_greedy_parity(hf, prompt: list[int], tokens: list[int], margin: dict[str, float] = BF16_MARGIN) -> int:
    """Every token of `tokens` (a greedy continuation of `prompt`) is transformers' bf16 argmax given
    the same prefix, or within `margin` of it; returns how many were its exact argmax."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    exact = 0
    for i, (row, token) in enumerate(zip(logits, tokens, strict=True)):
        best = float(row.max())
        assert float(row[token]) >= best - margin["atol"] - margin["rtol"] * abs(best), (
            f"token {i}: {token} scores {float(row[token]):.4f}, transformers' bf16 argmax {int(row.argmax())} {best:.4f}")
        exact += int(row.argmax()) == token
    return exact


_BF16_INDUCTOR: dict[str, LLM] = {}


@pytest.fixture(scope="module", autouse=True)
def _shared_bf16_inductor_engines():
    yield
    for llm in _BF16_INDUCTOR.values():
        llm.shutdown()
    _BF16_INDUCTOR.clear()


def _bf16_inductor_engine(variant: Path) -> LLM:
    """The variant's bf16 engine in inductor mode with the fused step off (batch-1 decodes in the
    graphs), built on first use and shared by the two bf16 inductor cases below: compiling one
    takes 10-30 s on CI's 2 cores. The batched case's steps have several rows (its linears in the
    graphs' few-rows AMX kernel or oneDNN), which the fused step never takes."""
    if str(variant) not in _BF16_INDUCTOR:
        _BF16_INDUCTOR[str(variant)] = LLM(model=str(variant), device="cpu", dtype="bfloat16", max_model_len=512,
                                           block_size=8, platform_options={"cpu_fused_decode": "off",
                                                                           "cpu_graph": "inductor"})
    return _BF16_INDUCTOR[str(variant)]


@pytest.mark.parametrize("fused", ["on", "off", pytest.param("off-inductor", marks=pytest.mark.slow)])
def test_bf16_engine_greedy_parity(variant, fused, monkeypatch):
    """A bf16 model (bf16 KV cache) through the engine: every batch-1 decode runs in the fused step
    (`on`) or op by op with the native kernels attending (`off`; with `off-inductor` through the
    graphs' C++ attention operator; none falls back to the torch path), and greedy tokens are
    transformers' bf16 ones up to near-ties."""
    from portside.backends.cpu import attention

    def refuse(*args, **kwargs):
        raise AssertionError("a decode fell back to the torch path")

    calls: list[int] = []
    fused_call = FusedDecoder.__call__

    def counting(self, input_ids, positions, ctx):
        calls.append(int(positions[0]))
        return fused_call(self, input_ids, positions, ctx)

    monkeypatch.setattr(attention, "_decode", refuse)
    monkeypatch.setattr(FusedDecoder, "__call__", counting)
    mode = "inductor" if fused.endswith("inductor") else "eager"
    if mode == "inductor":  # built here, with the patches above in place; the batched test below reuses it
        llm = _bf16_inductor_engine(variant)
    else:
        llm = LLM(model=str(variant), device="cpu", dtype="bfloat16", max_model_len=512, block_size=8,
                  platform_options={"cpu_fused_decode": fused, "cpu_graph": mode})
    runner = llm.engine.executor.runner
    assert runner.attn_backend.name == "native-paged"
    assert (runner.graph_runner._fused is not None) == (fused == "on")
    hf, exact, total = _hf_bf16(variant), 0, 0
    for prompt in BF16_PROMPTS:
        calls.clear()
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]  # fmt: skip
        assert calls == (list(range(len(prompt), len(prompt) + 15)) if fused == "on" else [])
        exact += assert_bf16_greedy_parity(hf, prompt, list(out.outputs[0].token_ids),
                                           BF16_MARGIN_INDUCTOR if mode == "inductor" else BF16_MARGIN)
        total += 16
    assert exact >= total * 3 // 4  # near-ties are rare


@pytest.mark.parametrize("mode", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_bf16_batched_engine_greedy_parity_amx_linears(variant, mode):
    """A batch of bf16 sequences: prefills and decode steps of several rows, whose bf16 linears run
    on AMX tiles where the CPU has AMX-BF16 (`cpu_bf16_linears` auto; in Inductor's few-rows graphs)
    and in oneDNN elsewhere; greedy tokens are transformers' bf16 ones up to near-ties."""
    from portside.backends.cpu.eager_linears import AMX_MAX_ROWS, amx_unavailable_reason

    amx = amx_unavailable_reason() is None
    if mode == "inductor":
        llm = _bf16_inductor_engine(variant)
    else:
        llm = LLM(model=str(variant), device="cpu", dtype="bfloat16", max_model_len=512, block_size=8,
                  platform_options={"cpu_graph": mode})
    runner = llm.engine.executor.runner.graph_runner
    assert (runner._few_rows == AMX_MAX_ROWS if amx else runner._few_rows == 0) if mode == "inductor" else runner._amx == amx
    prompts = [*BF16_PROMPTS, [7, 8, 9, 10], list(range(200, 260))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    hf, exact = _hf_bf16(variant), 0
    for prompt, out in zip(prompts, outs):
        exact += assert_bf16_greedy_parity(hf, prompt, list(out.outputs[0].token_ids),
                                           BF16_MARGIN_INDUCTOR if mode == "inductor" else BF16_MARGIN)
    assert exact >= 12 * len(prompts) * 3 // 4


@pytest.mark.parametrize("context", [1, 9, 128, 129, 300])
def test_bf16_fused_step_matches_the_model(variant, context):
    """A bf16 model's fused step computes the model with its bf16 weights in fp32 (activations and
    sums) over a bf16 cache: against the fp32 model holding the same (bf16-rounded) weights over
    an fp32 cache holding the same (bf16-rounded) prefix, the hidden states and logits differ only
    by the new K/V rows' bf16 rounding and the order of the sums, and the K/V rows written are
    that model's rounded to bf16 (the first layer's to
    within one bf16 step: the sums run in another order); nothing else in the cache is written.
    2 threads."""
    model = load_model(ModelConfig(path=str(variant), max_model_len=512, dtype=torch.bfloat16), torch.device("cpu"))
    assert unsupported_reason(model) is None
    ref = load_model(ModelConfig(path=str(variant), max_model_len=512), torch.device("cpu"))
    with torch.no_grad():
        for p32, p16 in zip(ref.parameters(), model.parameters(), strict=True):
            p32.copy_(p16.float())
    backend, block_size, num_blocks = NativeAttentionBackend(), 8, 48
    spec = model.kv_cache_spec()
    shape = backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
    table = [(7 * i + 3) % num_blocks for i in range(num_blocks)]
    ids = torch.randint(0, model.config.vocab_size, (context + 1,), generator=torch.Generator().manual_seed(context))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            ref(ids[:context], torch.arange(context), _context(backend, caches, 0, context, table, block_size))
            for c in caches:  # the prefix as the bf16 cache holds it
                c.copy_(c.bfloat16().float())
            bf16_caches = [c.bfloat16() for c in caches]
            step_ids, step_pos = ids[context:], torch.tensor([context])
            expected_hidden = ref(step_ids, step_pos, _context(backend, caches, context, 1, table, block_size))
            expected_logits = ref.compute_logits(expected_hidden)
            hidden, logits = FusedDecoder(model)(step_ids, step_pos,
                                                 _context(backend, bf16_caches, context, 1, table, block_size))
    finally:
        torch.set_num_threads(previous)
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert_close(hidden, expected_hidden.bfloat16(), torch.bfloat16)
    # with a one-token prefix the new (rounded) K/V row is half of what is attended: the model-level
    # bf16 tolerance (test_model_archs') there
    torch.testing.assert_close(logits, expected_logits, **({"atol": 3e-2, "rtol": 1e-2} if context > 8 else
                                                           {"atol": 0.15, "rtol": 0.05}))
    slot = table[context // block_size] * block_size + context % block_size
    for layer, (got, want) in enumerate(zip(bf16_caches, caches, strict=True)):
        got, want = got.clone().view(2, -1, *shape[3:]), want.bfloat16().view(2, -1, *shape[3:])
        # layer 0's row depends on the weights alone; later rows carry the attention over the bf16 prefix
        tol = {"atol": 1e-3, "rtol": 2**-7} if layer == 0 else {"atol": 5e-2, "rtol": 2e-2}
        torch.testing.assert_close(got[:, slot].float(), want[:, slot].float(), **tol)
        got[:, slot] = want[:, slot]
        assert torch.equal(got, want)  # nothing else written


def test_fused_decode_can_be_turned_off_and_checks_its_option(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=64, platform_options={"cpu_fused_decode": "off"})
    assert llm.engine.executor.runner.graph_runner._fused is None
    with pytest.raises(ValueError, match="cpu_fused_decode"):
        LLM(model=str(tiny_llama), device="cpu", max_model_len=64, platform_options={"cpu_fused_decode": "yes"})


def test_models_the_step_does_not_cover(tiny_llama):
    model = load_model(ModelConfig(path=str(tiny_llama), dtype=torch.float16), torch.device("cpu"))
    assert "dtype" in unsupported_reason(model)
    bf16 = load_model(ModelConfig(path=str(tiny_llama), dtype=torch.bfloat16), torch.device("cpu"))
    assert unsupported_reason(bf16) is None
    assert "not a Llama-family model" in unsupported_reason(torch.nn.Linear(2, 2))


def test_step_without_a_decode_plan_is_an_error(tiny_llama):
    """Called outside a decode step (no plan installed) the C++ step raises, it does not read
    stale or missing tables."""
    model = load_model(ModelConfig(path=str(tiny_llama)), torch.device("cpu"))
    decoder = FusedDecoder(model)._decoder
    with pytest.raises(RuntimeError, match="decode plan"):
        decoder.step(torch.tensor([1]), torch.tensor([0]))
