"""The fused native multi-row step (`FusedDecoder.rows` / `logits`, `LlamaDecoder.step_rows` in
`csrc/fused_decode.cpp`): one sequence's M = 2..16 rows (a speculative verification, a short
prefill chunk) against the model's own forward pass: hidden states, logits and the K/V rows
written, within the fp32 tolerance table, for M in {2, 3, 5, 8, 16}, prompts crossing block
boundaries and the 128-token attention splits, Llama (GQA), Qwen2 (qkv bias) and a tied LM head
with head_dim 32, on 1 and 2 threads; the same step of bf16 models (bf16 weights and KV cache)
against the fp32 model with their weights; which steps the runner routes to it; and greedy parity
with transformers through an engine speculating with ngram proposals (fp32, and bf16 up to
near-ties)."""

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

from portside.backends.cpu.attention import MAX_FUSED_ROWS, NativeAttentionBackend  # noqa: E402
from portside.backends.cpu.fused_decode import FusedDecoder  # noqa: E402

VARIANTS = {
    "llama": ("llama", {}),  # 4 query heads over 2 KV heads (GQA)
    "qwen2": ("qwen2", {}),  # qkv bias
    "tied-hd32": ("llama", {"tie_word_embeddings": True, "head_dim": 32, "num_attention_heads": 8,
                            "num_key_value_heads": 2}),
}  # fmt: skip
BLOCK_SIZE = 8
NUM_BLOCKS = 48


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory) -> Path:
    arch, overrides = VARIANTS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


@pytest.fixture(scope="module")
def model(variant):
    return load_model(ModelConfig(path=str(variant), max_model_len=512), torch.device("cpu"))


def _context(backend, caches, num_cached: int, num_new: int, table: list[int]) -> ForwardContext:
    md = backend.prepare(single_sequence_metadata(num_cached, num_new, table, BLOCK_SIZE))
    return ForwardContext(backend=backend, kv_caches=caches, metadata=md)


# (cached tokens, new rows): from an empty cache (a whole short prompt), rows crossing a block
# boundary (block size 8), rows crossing the 128-token attention split, longer contexts
CASES = [(0, 2), (6, 3), (5, 5), (0, 16), (13, 8), (30, 16), (125, 5), (126, 8), (121, 16), (300, 2), (250, 5)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("context", "rows"), CASES, ids=[f"{c}+{m}" for c, m in CASES])
def test_rows_step_matches_the_model(model, context, rows, threads):
    """Prefill `context` tokens with the model, then run `rows` more with the model and with the
    fused multi-row step on copies of the cache: same hidden states, logits (every row) and cache."""
    backend = NativeAttentionBackend()
    spec = model.kv_cache_spec()
    shape = backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
    table = [(7 * i + 3) % NUM_BLOCKS for i in range(NUM_BLOCKS)]  # scattered blocks
    gen = torch.Generator().manual_seed(1000 * context + rows)
    ids = torch.randint(0, model.config.vocab_size, (context + rows,), generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            if context:
                model(ids[:context], torch.arange(context), _context(backend, caches, 0, context, table))
            fused_caches = [c.clone() for c in caches]
            step_ids, step_pos = ids[context:], torch.arange(context, context + rows)
            ctx = _context(backend, caches, context, rows, table)
            expected_hidden = model(step_ids, step_pos, ctx)
            expected_logits = model.compute_logits(expected_hidden)
            ctx = _context(backend, fused_caches, context, rows, table)
            fused = FusedDecoder(model)
            assert fused.covers_rows(step_ids, ctx) and not fused.covers(step_ids, ctx)
            hidden = fused.rows(step_ids, step_pos, ctx)
            logits = fused.logits(hidden)
            some = fused.logits(hidden[[rows - 1, 0]])  # the rows a runner samples, in its order
    finally:
        torch.set_num_threads(previous)
    # Hidden states at unit scale too: after the final norm they reach ~3, and the AVX-512 tile
    # (16-float accumulators) sums in another order than the model's GEMM: one of 320 values was
    # 1.33e-5 (absolute) from the model's in a Qwen2 case, 3.4e-6 of max|hidden|
    assert_close(hidden / expected_hidden.abs().max(), expected_hidden / expected_hidden.abs().max(),
                 context="hidden / max|hidden|")
    # Logits at unit scale: they reach ~8 here, and each is a dot product over the hidden size of
    # states that differ by summation order, so the table's absolute 1e-5 applies to logits / max|logits|
    # (both paths are ~1e-5 from a float64 forward of the model, in absolute terms).
    scale = expected_logits.abs().max()
    assert_close(logits / scale, expected_logits / scale, context="logits / max|logits|")
    assert_close(some / scale, expected_logits[[rows - 1, 0]] / scale, context="logits of some rows / max|logits|")
    # The new K/V rows are dot products over the hidden size as well: compared at unit scale too
    # (an AVX-512 CPU's summation order put one of 24576 fp32 values 1.09e-5 from the reference's).
    for layer, (got, want) in enumerate(zip(fused_caches, caches, strict=True)):
        unit = want.abs().max().clamp(min=1.0)
        assert_close(got / unit, want / unit, context=f"layer {layer}'s cache / max(1, max|cache|)")


BF16_CASES = [(0, 2), (5, 5), (121, 16), (250, 5)]


@pytest.mark.parametrize(("context", "rows"), BF16_CASES, ids=[f"{c}+{m}" for c, m in BF16_CASES])
def test_bf16_rows_step_matches_the_model(variant, context, rows):
    """A bf16 model's multi-row step (bf16 weights, fp32 activations, bf16 cache) against the fp32
    model holding the same bf16-rounded weights over an fp32 cache holding the same bf16-rounded
    prefix: hidden states and logits within the rounding of the new rows' K/V and hidden states,
    the K/V rows written (the first layer's within one bf16 step), nothing else written. 2 threads."""
    model = load_model(ModelConfig(path=str(variant), max_model_len=512, dtype=torch.bfloat16), torch.device("cpu"))
    ref = load_model(ModelConfig(path=str(variant), max_model_len=512), torch.device("cpu"))
    with torch.no_grad():
        for p32, p16 in zip(ref.parameters(), model.parameters(), strict=True):
            p32.copy_(p16.float())
    backend = NativeAttentionBackend()
    spec = model.kv_cache_spec()
    shape = backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
    table = [(7 * i + 3) % NUM_BLOCKS for i in range(NUM_BLOCKS)]
    ids = torch.randint(0, model.config.vocab_size, (context + rows,), generator=torch.Generator().manual_seed(context))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            if context:
                ref(ids[:context], torch.arange(context), _context(backend, caches, 0, context, table))
            for c in caches:  # the prefix as the bf16 cache holds it
                c.copy_(c.bfloat16().float())
            bf16_caches = [c.bfloat16() for c in caches]
            step_ids, step_pos = ids[context:], torch.arange(context, context + rows)
            expected_hidden = ref(step_ids, step_pos, _context(backend, caches, context, rows, table))
            expected_logits = ref.compute_logits(expected_hidden)
            ctx = _context(backend, bf16_caches, context, rows, table)
            fused = FusedDecoder(model)
            assert fused.covers_rows(step_ids, ctx) and not fused.covers(step_ids, ctx)
            hidden = fused.rows(step_ids, step_pos, ctx)
            logits = fused.logits(hidden)
    finally:
        torch.set_num_threads(previous)
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    # rows attend the step's earlier new rows, whose K/V are rounded to bf16 here and not in the
    # fp32 model: twice the bf16 table for the hidden states; the logits (of bf16-rounded hidden
    # states, as the model's own LM head takes them) within the model-level bf16 tolerance
    torch.testing.assert_close(hidden.float(), expected_hidden, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(logits, expected_logits, atol=0.15, rtol=0.05)
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context, context + rows)]
    for layer, (got, want) in enumerate(zip(bf16_caches, caches, strict=True)):
        got, want = got.clone().view(2, -1, *shape[3:]), want.bfloat16().view(2, -1, *shape[3:])
        tol = {"atol": 1e-3, "rtol": 2**-7} if layer == 0 else {"atol": 5e-2, "rtol": 2e-2}
        torch.testing.assert_close(got[:, slots].float(), want[:, slots].float(), **tol)
        got[:, slots] = want[:, slots]
        assert torch.equal(got, want)  # nothing else written


def test_which_steps_the_rows_step_covers(tiny_llama):
    """One sequence's 2..16 rows with an fp32 cache; not one row (the batch-1 step's), not 17 rows,
    not two sequences, not an 8-bit cache."""
    model = load_model(ModelConfig(path=str(tiny_llama), max_model_len=256), torch.device("cpu"))
    backend = NativeAttentionBackend()
    spec = model.kv_cache_spec()
    shape = backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
    table = list(range(NUM_BLOCKS))

    def covered(num_cached: int, num_new: int, caches=caches) -> bool:
        return FusedDecoder.covers_rows(torch.zeros(num_new, dtype=torch.long),
                                        _context(backend, caches, num_cached, num_new, table))

    assert covered(10, 2) and covered(10, 5) and covered(0, MAX_FUSED_ROWS)
    assert not covered(10, 1) and not covered(10, MAX_FUSED_ROWS + 1)
    q8 = [torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_size, torch.int8),
                      dtype=torch.int8) for _ in range(spec.num_layers)]  # fmt: skip
    assert not covered(10, 5, q8)
    # two sequences of 3 rows each: no one-sequence plan
    from portside.contract import AttentionMetadata

    md = AttentionMetadata(
        slot_mapping=torch.arange(6, dtype=torch.int64) + 40, query_start_loc=torch.tensor([0, 3, 6], dtype=torch.int32),
        seq_lens=torch.tensor([8, 8], dtype=torch.int32), block_tables=torch.tensor([[4, 5], [6, 7]], dtype=torch.int32),
        max_query_len=3, max_seq_len=8, block_size=BLOCK_SIZE, query_start_loc_cpu=[0, 3, 6], seq_lens_cpu=[8, 8],
    )  # fmt: skip
    ctx = ForwardContext(backend=backend, kv_caches=caches, metadata=backend.prepare(md))
    assert not FusedDecoder.covers_rows(torch.zeros(6, dtype=torch.long), ctx)


def test_rows_step_checks_its_plan(tiny_llama):
    """Without a plan, with the batch-1 plan, or with positions that are not the sequence's last
    rows, the C++ step raises rather than reading or writing the wrong rows."""
    model = load_model(ModelConfig(path=str(tiny_llama), max_model_len=256), torch.device("cpu"))
    decoder = FusedDecoder(model)._decoder
    with pytest.raises(RuntimeError, match="decode plan"):
        decoder.step_rows(torch.tensor([1, 2]), torch.tensor([0, 1]))
    backend = NativeAttentionBackend()
    spec = model.kv_cache_spec()
    shape = backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_size)
    caches = [torch.zeros(shape) for _ in range(spec.num_layers)]
    ctx = _context(backend, caches, 10, 3, list(range(NUM_BLOCKS)))
    torch.ops.portside_cpu_native.set_decode_step(caches, *ctx.metadata.backend_data.native_rows)
    try:
        with pytest.raises(RuntimeError, match="positions"):
            decoder.step_rows(torch.tensor([1, 2, 3]), torch.tensor([9, 10, 11]))
        with pytest.raises(RuntimeError, match="decode plan"):  # the batch-1 step refuses a multi-row plan
            decoder.step(torch.tensor([1]), torch.tensor([12]))
    finally:
        torch.ops.portside_cpu_native.clear_decode_step()


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# every variant through the eager runner; the inductor runner (the dispatch is the runners' shared
# code) once, marked slow: its graphs compile for a while
ENGINE_CASES = [*((v, "eager") for v in VARIANTS), ("tied-hd32", "inductor")]


def count_rows_steps(monkeypatch) -> list[int]:
    """The row counts of the steps that run in the fused multi-row step, from now on."""
    calls: list[int] = []
    rows = FusedDecoder.rows

    def counting(self, input_ids, positions, ctx):
        calls.append(input_ids.shape[0])
        return rows(self, input_ids, positions, ctx)

    monkeypatch.setattr(FusedDecoder, "rows", counting)
    return calls


@pytest.mark.parametrize(
    ("variant", "mode"),
    [pytest.param(v, m, marks=pytest.mark.slow) if m != "eager" else (v, m) for v, m in ENGINE_CASES],
    indirect=["variant"], ids=[f"{v}-{m}" for v, m in ENGINE_CASES],
)
def test_engine_verifies_proposals_in_the_rows_step_with_greedy_parity(variant, mode, monkeypatch):
    """An engine speculating with ngram proposals on a repetitive prompt: its verification steps
    run in the fused multi-row step, and the greedy tokens equal transformers'."""
    calls = count_rows_steps(monkeypatch)
    llm = LLM(model=str(variant), device="cpu", max_model_len=512, block_size=BLOCK_SIZE, speculative_config=NGRAM,
              platform_options={"cpu_graph": mode})  # fmt: skip
    # a prompt repeating one phrase: the model's greedy continuation of a tiny random model tends to
    # loop too, so proposals are made and some accepted; 120 + 24 tokens cross the 128-token split
    prompt = (list(range(5, 25)) * 6)[:120]
    n = 24
    calls.clear()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]  # fmt: skip
    assert out.outputs[0].token_ids == hf_greedy(variant, prompt, n)
    assert calls and all(2 <= m <= 1 + NGRAM["num_speculative_tokens"] for m in calls)


def test_bf16_engine_verifies_proposals_in_the_rows_step(variant, monkeypatch):
    """A bf16 model speculating with ngram proposals: verification steps run in the fused
    multi-row step, and every greedy token is transformers' bf16 choice up to a near-tie
    (`test_cpu_fused_decode.assert_bf16_greedy_parity`)."""
    from test_cpu_fused_decode import _hf_bf16, assert_bf16_greedy_parity  # tests/backends is on sys.path

    calls = count_rows_steps(monkeypatch)
    llm = LLM(model=str(variant), device="cpu", dtype="bfloat16", max_model_len=512, block_size=BLOCK_SIZE,
              speculative_config=NGRAM)
    # almost every token of the vocabulary once: nearly every token generated has a 1-gram match in
    # the context, so proposals are made whatever the continuation (bf16's may leave fp32's loops)
    prompt = list(range(3, 393))
    n = 24
    calls.clear()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]  # fmt: skip
    exact = assert_bf16_greedy_parity(_hf_bf16(variant), prompt, list(out.outputs[0].token_ids))
    assert exact >= n * 3 // 4
    assert calls and all(2 <= m <= 1 + NGRAM["num_speculative_tokens"] for m in calls)
