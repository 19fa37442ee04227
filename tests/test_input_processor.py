"""portside.engine.processor: one validated `EngineRequest` per `add_request`, every refusal a
ValueError naming the field, and nothing left behind by a refused request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from portside.engine.llm_engine import LLMEngine
from portside.engine.processor import EosIds
from portside.sampling_params import SamplingParams
from portside.structured.params import StructuredOutputsParams

MAX_LEN = 32


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[LLMEngine]:
    eng = LLMEngine.from_args(model=str(tiny_llama), device="cpu", max_model_len=MAX_LEN, block_size=4, max_logprobs=5)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("prompt, params, field", [
    ([1, 2, 3], SamplingParams(logprobs=6), "logprobs: 6 requested, more than the 5 allowed"),
    ([1, 2, 3], SamplingParams(prompt_logprobs=9), "prompt_logprobs: 9 requested"),
    ([1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}), "logit_bias token id 1000000 is out of range"),
    ([1, 2, 3], SamplingParams(stop_token_ids=[-1]), "stop_token_ids entry -1 is out of range"),
    ([1, 10**6], SamplingParams(), "prompt token id 1000000 is out of range"),
    ([], SamplingParams(), "prompt must not be empty"),
    (list(range(1, MAX_LEN + 1)), SamplingParams(), f"prompt is {MAX_LEN} tokens, but max_model_len is {MAX_LEN}"),
    ({"text": "hi"}, SamplingParams(), "a prompt dict needs 'prompt' or 'prompt_token_ids'"),
    ({"prompt": "hi", "multi_modal_data": {"image": None}}, SamplingParams(), "does not take images"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, SamplingParams(), "'messages' or 'prompt'"),
    ({"messages": "hi"}, SamplingParams(), "messages must be a list"),
])
def test_each_refusal_names_its_field_and_leaves_nothing_behind(engine: LLMEngine, prompt, params, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests() and "bad" not in engine.outputs.groups
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=1))  # the id is free again
    while engine.has_unfinished_requests():
        engine.step()


def test_one_sequence_per_sample_with_its_own_state(engine: LLMEngine, tiny_llama: Path) -> None:
    params = SamplingParams(n=2, best_of=3, max_tokens=100, seed=7, stop_token_ids=[5])
    req = engine.processor.process("r", [1, 2, 3], params, priority=2)
    assert [s.request_id for s in req.sequences] == ["r#0", "r#1", "r#2"]
    assert [s.parent_id for s in req.sequences] == [None, "r#0", "r#0"]
    assert req.best_n == 2 and req.prompt is None and req.prompt_token_ids == [1, 2, 3]
    assert all(s.max_tokens == MAX_LEN - 3 and s.priority == 2 for s in req.sequences)  # never past max_model_len
    assert all(s.sampling_params.logprobs == 0 for s in req.sequences)  # best_of ranks by cumulative logprob
    assert len({id(s.output_token_ids) for s in req.sequences}) == 3  # nothing mutable shared
    assert len({s.sampling_params.seed for s in req.sequences}) == 3
    extra = EosIds.read(str(tiny_llama), engine.tokenizer).extra
    assert all(s.sampling_params.stop_token_ids == [5, *[t for t in extra if t != 5]] for s in req.sequences)


def test_eos_ids_from_generation_config(tmp_path: Path, engine: LLMEngine) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, engine.tokenizer.eos_token_id, 9]}))
    eos = EosIds.read(str(tmp_path), engine.tokenizer)
    assert eos.primary == engine.tokenizer.eos_token_id and eos.extra == [7, 9]
    assert eos.all == [engine.tokenizer.eos_token_id, 7, 9]


def test_messages_render_through_the_chat_template(engine: LLMEngine) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    rendered = engine.apply_chat_template(messages)
    text, ids, features = engine.processor.prompt({"messages": messages})
    assert (text, ids, features) == (rendered["prompt"], rendered["prompt_token_ids"], [])
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    outs = {}
    for rid, prompt in (("m", {"messages": messages}), ("p", rendered)):
        engine.add_request(rid, prompt, greedy)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["m"].outputs[0].token_ids == outs["p"].outputs[0].token_ids
    assert outs["m"].prompt == rendered["prompt"]


def test_structured_outputs_compile_into_one_state_per_sample(engine: LLMEngine) -> None:
    params = SamplingParams(n=2, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    req = engine.processor.process("s", [1, 2, 3], params)
    states = [s.structured for s in req.sequences]
    assert all(st is not None for st in states) and states[0] is not states[1]
