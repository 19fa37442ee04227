"""Structured output in the engine: constraints compile (or fail with a message), every output
satisfies its constraint with a strict parser, greedy constrained decoding equals an oracle
(transformers' logits, the same grammar's mask, argmax), free rows in a mixed batch equal
transformers' greedy output, and preemption, prefix caching and n > 1 keep working.

The grammar engines run for real on a tiny random-weight model, whose unconstrained output is
noise: anything that parses, parses because of the mask.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from portside import LLM, SamplingParams
from portside.sample.bitmask import apply_token_bitmask
from portside.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from portside.structured.backend import allocate_bitmask
from portside.structured.manager import StructuredOutputManager
from portside.testing.tiny import QWEN_MARKERS, hf_greedy, hf_logits, make_tiny_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "nickname": {"type": ["string", "null"], "maxLength": 8},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}

BACKENDS = ["llguidance", pytest.param("xgrammar", marks=pytest.mark.xgrammar)]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    if request.param == "xgrammar":
        pytest.importorskip("xgrammar", reason="the xgrammar extra is not installed (the triton leg has it)")
    return request.param


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, backend: str) -> LLM:
    return LLM(str(tiny_llama), device="cpu", max_model_len=384, block_size=8, structured_outputs_backend=backend)


def _gen(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


# ---- parameters --------------------------------------------------------------------------


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="json is not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    old = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a"]))  # vLLM's older name
    assert old.structured_outputs == StructuredOutputsParams(choice=["a"]) and old.guided_decoding is None
    import portside

    assert portside.StructuredOutputsParams is StructuredOutputsParams and portside.GuidedDecodingParams is GuidedDecodingParams
    # the same constraint written two ways shares one compiled grammar
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key == StructuredOutputsParams(json='{"a": 2, "b": 1}').key


def test_reference_mask_matches_a_plain_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    for n, vocab, words, rows in [(4, 70, 3, [3, 1]), (2, 64, 1, [0]), (3, 40, 2, [0, 1, 2])]:
        logits = torch.randn(n, vocab, generator=gen)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
        want = logits.clone()
        for i, r in enumerate(rows):
            for t in range(vocab):
                word = int(bitmask[i, t // 32]) if t // 32 < words else 0
                if not (word >> (t % 32)) & 1:
                    want[r, t] = float("-inf")
        assert torch.equal(apply_token_bitmask(logits, bitmask, torch.tensor(rows)), want)


# ---- every output satisfies its constraint -------------------------------------------------


def test_json_schema_outputs_validate(llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=300, structured_outputs=StructuredOutputsParams(json=PERSON))
    outs = _gen(llm, ["Tell me about a person.", "Who is there?", "the harbour"], params)
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", f"did not close within 300 tokens: {c.text!r}"
            jsonschema.validate(json.loads(c.text), PERSON)  # json.loads is strict: no raw control characters
    assert_all_blocks_free(llm)


def test_json_object_choice_regex_and_grammar(llm: LLM) -> None:
    cases = [
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputsParams(choice=["Paris", "London", "Rome"]), lambda t: t in ("Paris", "London", "Rome")),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
         lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    ]  # fmt: skip
    for sp, ok in cases:
        params = SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=120, structured_outputs=sp)
        for o in _gen(llm, ["Answer:", "The town"], params):
            for c in o.outputs:
                assert c.finish_reason == "stop" and ok(c.text), f"{sp.kind}: {c.text!r}"
    assert_all_blocks_free(llm)


def test_invalid_constraints_are_value_errors_and_hold_nothing(llm: LLM) -> None:
    bad = [
        (StructuredOutputsParams(json={"type": "string", "minLength": 5, "maxLength": 2}), "minLength"),
        (StructuredOutputsParams(json={"type": "frobnicate"}), "frobnicate"),
        (StructuredOutputsParams(regex="(("), "regex"),
        (StructuredOutputsParams(regex=r"[^\s\S]"), "can never be satisfied"),
        (StructuredOutputsParams(grammar="root ::= missing_rule"), "grammar"),
        (StructuredOutputsParams(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(9000)}}), "larger than"),
    ]  # fmt: skip
    for sp, message in bad:
        with pytest.raises(ValueError, match=message):
            _gen(llm, ["x"], SamplingParams(max_tokens=4, structured_outputs=sp))
    assert_all_blocks_free(llm)


def test_deep_ref_chain_compiles_without_crashing(llm: LLM) -> None:
    """~900 nested $refs overflow an 8 MiB thread stack inside the grammar engine: compiles run on
    deep-stack threads instead of taking the process down."""
    defs = {"d0": {"type": "integer"}}
    for i in range(1, 900):
        defs[f"d{i}"] = {"anyOf": [{"type": "array", "items": {"$ref": f"#/$defs/d{i - 1}"}, "maxItems": 1}, {"type": "null"}]}
    schema = {"$defs": defs, "$ref": "#/$defs/d899"}
    (out,) = _gen(llm, ["x"], SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)))
    assert out.outputs[0].text  # parsed or cut at max_tokens: either way the engine is alive


# ---- greedy equals the oracle; the batch, preemption, prefix cache ------------------------


def oracle(path: Path, prompt: list[int], sp: StructuredOutputsParams, max_tokens: int, backend: str) -> list[int]:
    """Greedy decoding with transformers' fp32 logits under the same grammar's mask."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    vocab = hf_logits(path, prompt).shape[-1]
    manager = StructuredOutputManager(backend, tok, vocab, [tok.eos_token_id])
    state = manager.new_state(manager.compile(sp), prompt)
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        bitmask = allocate_bitmask(1, manager.vocab_size)
        state.matcher.fill_bitmask(bitmask, 0)
        logits = apply_token_bitmask(hf_logits(path, ids)[-1:], bitmask, torch.tensor([0]))
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
        if t == tok.eos_token_id or state.accept(t):
            break
    return out


@pytest.mark.slow
def test_greedy_constrained_equals_oracle_in_a_mixed_batch(tiny_llama: Path, backend: str) -> None:
    """Constrained and free rows in one batch, prompts crossing block boundaries, a token budget
    that chunks the long prompt, a pool small enough to preempt, then a prefix-cache hit."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
              "required": ["city", "n"], "additionalProperties": False}  # fmt: skip
    constraints = [StructuredOutputsParams(json=schema), None, StructuredOutputsParams(regex="(ab|c){2,5}d"), None]
    llm = LLM(str(tiny_llama), device="cpu", max_model_len=96, block_size=4, num_kv_blocks=26,
              max_num_batched_tokens=32, structured_outputs_backend=backend)  # fmt: skip
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("Where is it?", "The harbour town woke early and the bakers lit their ovens",
                                       "Count:", "A ship arrived from the south")]  # fmt: skip
    max_tokens = 40
    expected = []
    for p, sp in zip(prompts, constraints):
        expected.append(hf_greedy(tiny_llama, p, max_tokens) if sp is None else oracle(tiny_llama, p, sp, max_tokens, backend))
    for attempt in range(2):  # the second run hits the prefix cache
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=sp is None, structured_outputs=sp)
                  for sp in constraints]  # fmt: skip
        outs = _gen(llm, [{"prompt_token_ids": p} for p in prompts], params)
        for o, want, sp in zip(outs, expected, constraints):
            got = o.outputs[0].token_ids
            assert got == want, f"{sp.kind if sp else 'free'} row, run {attempt}: {got} != {want}"
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the pool was meant to force a preemption"
    assert stats.prefix_cache_hits > 0
    assert_all_blocks_free(llm)


def test_stop_strings_and_seeded_samples(llm: LLM) -> None:
    sp = StructuredOutputsParams(regex="[a-c]{2,30}z")
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=60, stop=["ba"], structured_outputs=sp)
    first = _gen(llm, ["go"], params)[0]
    again = _gen(llm, ["go"], params)[0]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]  # seeds reproduce under a grammar
    for c in first.outputs:
        assert "ba" not in c.text and re.fullmatch("[a-c]*z?", c.text), c.text
        assert c.finish_reason == "stop"
    assert_all_blocks_free(llm)


# ---- reasoning: the grammar applies to the answer after </think> ----------------------------


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_markers"), "qwen3", added_tokens=QWEN_MARKERS)


def test_reasoning_is_free_and_the_answer_constrained(thinking_model: Path) -> None:
    llm = LLM(str(thinking_model), device="cpu", max_model_len=256, reasoning_parser="qwen3")
    tok = llm.get_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    prompt = tok.encode("Question: yes or no?\n<think>\n")  # the prompt opens the reasoning
    sp = StructuredOutputsParams(choice=["yes", "no"])
    # </think> is made likely, but only the reasoning may emit it: the grammar forbids it after
    params = SamplingParams(temperature=0.8, seed=2, n=4, max_tokens=60, logit_bias={end: 6.0}, structured_outputs=sp)
    parser = llm.engine.reasoning_parser
    (out,) = _gen(llm, [{"prompt_token_ids": prompt}], params)
    for c in out.outputs:
        assert c.token_ids.count(end) == 1, c.text
        reasoning, answer = parser.extract(c.text, True)
        assert answer in ("yes", "no"), (reasoning, answer)
    # without an opened think block the first token may open one (and only the first), or the
    # answer starts at once
    start = tok.convert_tokens_to_ids("<think>")
    plain = tok.encode("Question: yes or no?\n")
    for bias, thinks in (({start: -100.0}, False), ({start: 12.0, end: 14.0}, True)):
        params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=60, logit_bias=bias, structured_outputs=sp)
        (out,) = _gen(llm, [{"prompt_token_ids": plain}], params)
        for c in out.outputs:
            assert (c.token_ids[0] == start) == thinks, c.text
            reasoning, answer = parser.extract(c.text, False)
            assert answer in ("yes", "no") and (thinks or reasoning is None), c.text
