"""Structured output, tool calls and reasoning through the official `openai` client against a
real `portside serve` (tiny random-weight Qwen3-style model with <think> / <tool_call> tokens
and a hermes tools template; `--enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3`). The model's free output is noise, so whatever parses does because of
the grammar. Every body and chunk is also checked against OpenAI's published schemas."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from helpers import post, sse_events
from openai_schemas import validate, validate_completion_chunk
from server_process import ServerProcess

from portside.testing.tiny import HERMES_TOOLS_TEMPLATE, QWEN_MARKERS, make_tiny_model

pytestmark = pytest.mark.slow  # its own server with tool and reasoning parsers (CI runs it)

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MSG = [{"role": "user", "content": "Describe a city."}]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**7},
        "area": {"type": "number", "minimum": 1, "exclusiveMaximum": 1000},
        "kind": {"enum": ["town", "city", "village"]},
        "districts": {"type": "array", "items": {"type": "object", "properties": {"d": {"type": "string", "maxLength": 5}},
                                                  "required": ["d"], "additionalProperties": False}, "maxItems": 2},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "population", "kind", "districts"],
    "additionalProperties": False,
}  # fmt: skip
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}},
                                                                          "required": ["tz"]}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_tools"), "qwen3", added_tokens=QWEN_MARKERS,
                           chat_template=HERMES_TOOLS_TEMPLATE)  # fmt: skip


@pytest.fixture(scope="module")
def tok(model: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def srv(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(model, tmp_path_factory.mktemp("srv") / "server.log", "--max-model-len", "1024",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(srv: ServerProcess, body: dict) -> dict:
    r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 200} | body)
    assert r.status_code == 200, r.text
    validate("CreateChatCompletionResponse", r.json())
    return r.json()


def chat_stream(srv: ServerProcess, body: dict) -> list[dict]:
    events = sse_events(srv, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 200, "stream": True} | body)
    for e in events:
        validate("CreateChatCompletionStreamResponse", e)
    return events


def assembled(events: list[dict], n: int) -> list[dict]:
    """Per choice: content, reasoning, tool calls (joined by index) and finish reason, as a client rebuilds them."""
    out = [{"content": "", "reasoning": "", "calls": {}, "finish": None} for _ in range(n)]
    for e in events:
        for ch in e["choices"]:
            o, d = out[ch["index"]], ch["delta"]
            o["content"] += d.get("content") or ""
            o["reasoning"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                call = o["calls"].setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                call["name"] += (tc.get("function") or {}).get("name") or ""
                call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            o["finish"] = ch["finish_reason"] or o["finish"]
    return out


def test_json_schema_streamed_and_not(srv: ServerProcess, client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=MSG, response_format=rf, n=2, temperature=1.0, seed=1,
                                       max_tokens=300, extra_body=NO_THINK)  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), CITY)
    body = chat(srv, {"response_format": rf, "n": 2, "temperature": 1.0, "seed": 2, "max_tokens": 300} | NO_THINK)
    for c in body["choices"]:
        jsonschema.validate(json.loads(c["message"]["content"]), CITY)
    for o in assembled(chat_stream(srv, {"response_format": rf, "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 300} | NO_THINK), 2):
        assert o["finish"] == "stop"
        jsonschema.validate(json.loads(o["content"]), CITY)
    srv.wait_idle()


def test_choice_regex_json_object_and_completions(srv: ServerProcess, client: openai.OpenAI, tok) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model="tiny", messages=MSG, n=2, temperature=1.0, max_tokens=20,
                                       extra_body={"structured_outputs": {"choice": ["north", "south"]}} | NO_THINK)  # fmt: skip
    assert {c.message.content for c in r.choices} <= {"north", "south"}
    quote = tok.convert_tokens_to_ids('"')  # a random model's strings run long: make closing them likely
    r = client.chat.completions.create(model="tiny", messages=MSG, response_format={"type": "json_object"}, max_tokens=400,
                                       temperature=0.7, seed=4, logit_bias={str(quote): 5.0}, extra_body=NO_THINK)  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for stream in (False, True):
        rx = r"[A-Z][a-z]{1,6} [0-9]{2}"
        cmpl = client.completions.create(model="tiny", prompt="Name and age:", n=2, max_tokens=30, temperature=1.0,
                                         stream=stream, extra_body={"guided_regex": rx})  # fmt: skip
        texts = ["", ""]
        for chunk in cmpl if stream else [cmpl]:
            for c in chunk.choices:
                texts[c.index] += c.text
        assert all(re.fullmatch(rx, t) for t in texts), texts
    body = {"model": "tiny", "prompt": "Pick:", "n": 2, "max_tokens": 20, "structured_outputs": {"choice": ["up", "down"]}}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    validate("CreateCompletionResponse", r.json())
    assert {c["text"] for c in r.json()["choices"]} <= {"up", "down"}
    texts = ["", ""]
    for e in sse_events(srv, "/v1/completions", body | {"stream": True}):
        validate_completion_chunk(e)
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert set(texts) <= {"up", "down"}, texts
    srv.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(srv: ServerProcess, stream: bool) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = {"tools": TOOLS, "tool_choice": choice, "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 250} | NO_THINK
        if stream:
            results = [(o["finish"], list(o["calls"].values())) for o in assembled(chat_stream(srv, body), 2)]
        else:
            results = [(c["finish_reason"], [c2["function"] | {"id": c2["id"]} for c2 in c["message"]["tool_calls"]])
                       for c in chat(srv, body)["choices"]]  # fmt: skip
        for finish, calls in results:
            assert calls, "no tool call came back"
            assert finish == ("tool_calls" if choice == "required" else "stop")
            for call in calls:
                assert call["id"].startswith("call_")
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
                if choice != "required":
                    assert call["name"] == "get_time"
    srv.wait_idle()


def test_auto_parses_hermes_calls(srv: ServerProcess, client: openai.OpenAI) -> None:
    """tool_choice "auto": the model's own <tool_call> format, parsed (the regex stands in for a
    trained model that chose to call)."""
    rx = r'I will check\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "c"\}\}\n</tool_call>'
    extra = {"guided_regex": rx} | NO_THINK
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=80, extra_body=extra)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "I will check."
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    (o,) = assembled(chat_stream(srv, {"tools": TOOLS, "max_tokens": 80} | extra), 1)
    assert o["finish"] == "tool_calls" and o["content"] == "I will check."
    assert [c["name"] for c in o["calls"].values()] == ["get_weather"]
    # a tool result goes back through the template
    history = MSG + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]  # fmt: skip
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=5, extra_body=NO_THINK)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    srv.wait_idle()


def test_reasoning_content_and_an_answer_under_a_grammar(srv: ServerProcess, tok) -> None:  # type: ignore[no-untyped-def]
    """Thinking on: the model opens <think> (made likely here), reasons freely, and the answer
    after </think> follows the grammar; reasoning_content comes apart, streamed and not."""
    bias = {str(tok.convert_tokens_to_ids("<think>")): 12.0, str(tok.convert_tokens_to_ids("</think>")): 14.0}
    body = {"structured_outputs": {"choice": ["yes", "no"]}, "logit_bias": bias, "n": 2, "temperature": 0.8, "seed": 6, "max_tokens": 60}
    for c in chat(srv, body)["choices"]:
        assert c["message"]["content"] in ("yes", "no"), c
        assert "reasoning_content" in c["message"] and "<think>" not in (c["message"]["reasoning_content"] or "")
    for o in assembled(chat_stream(srv, body), 2):
        assert o["content"] in ("yes", "no") and "</think>" not in o["reasoning"], o
    srv.wait_idle()


def test_bad_constraints_are_400s_and_leave_nothing_behind(srv: ServerProcess) -> None:
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 20} for i in range(4000)}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": huge}}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
        ({"structured_outputs": {"grammar": 'root ::= "a" undefined'}}, "structured_outputs"),
    ]
    for extra, param in cases:
        r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 5} | extra)
        assert r.status_code == 400, r.text
        validate("ErrorResponse", r.json())
        assert r.json()["error"]["param"] == param, r.json()
    assert post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 3}).status_code == 200
    srv.wait_idle()
