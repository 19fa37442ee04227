"""`portside serve` on a tiny random-weight gpt-oss model with the real o200k_harmony tokenizer,
asked with the `openai` client: harmony is picked from the model type, reasoning and tool calls
come back in OpenAI's schema (validated against shared/openai-openapi), a random-weight model is
forced into a tool call through tool_choice, streaming agrees with the whole response, and bad
input gets OpenAI-style 400s.

A random-weight model writes no harmony by itself: where a test needs channels it constrains the
output with a grammar over harmony's special tokens (the request's own `structured_outputs`), and
the server's parser is what splits it."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import post, sse_events
from openai_schemas import validate
from server_process import ServerProcess

from portside.server.harmony import VOCAB_ENV

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}, "hours": {"type": "integer", "minimum": 0,
                                                                                                   "maximum": 9}},
    "required": ["tz", "hours"]}}}  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
USER = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
# analysis then final, the texts free within a small alphabet (the server's parser splits them)
CHANNELS = ('start: <|channel|> "analysis" <|message|> /[a-z ]{1,20}/ <|end|> <|start|> "assistant" <|channel|> "final" '
            "<|message|> /[A-Z]{1,8}/")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from portside.testing.harmony_tokenizer import harmony_tokenizer_dir
    from portside.testing.tiny_gpt_oss import make_tiny_gpt_oss

    return make_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), tokenizer_dir=harmony_tokenizer_dir())


@pytest.fixture(scope="module")
def server(gpt_oss: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from portside.testing.harmony_tokenizer import o200k_vocab_dir

    old = os.environ.get(VOCAB_ENV)
    os.environ[VOCAB_ENV] = str(o200k_vocab_dir())  # the server process inherits it: no download
    proc = ServerProcess(gpt_oss, tmp_path_factory.mktemp("harmony") / "server.log", "--max-model-len", "1024",
                         "--block-size", "16", "--num-kv-blocks", "400")
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()
        if old is None:
            os.environ.pop(VOCAB_ENV, None)
        else:
            os.environ[VOCAB_ENV] = old


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client: Any, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """The parsed response and its raw body, validated against OpenAI's schema."""
    raw = client.chat.completions.with_raw_response.create(model="tiny", temperature=0, **kw)
    body = raw.http_response.json()
    validate("CreateChatCompletionResponse", body)
    return raw.parse(), body


def stream(server: ServerProcess, **body: Any) -> list[dict[str, Any]]:
    events = sse_events(server, "/v1/chat/completions", {"model": "tiny", "temperature": 0, "stream": True, **body})
    for e in events:
        validate("CreateChatCompletionStreamResponse", e)
    return events


def joined(events: list[dict[str, Any]], key: str) -> str:
    return "".join(e["choices"][0]["delta"].get(key) or "" for e in events if e["choices"])


def test_reasoning_and_content(client: Any, server: ServerProcess) -> None:
    r, body = create(client, messages=USER, max_tokens=80, extra_body={"structured_outputs": {"grammar": CHANNELS}})
    msg = body["choices"][0]["message"]
    assert re.fullmatch(r"[a-z ]{1,20}", msg["reasoning_content"]), msg
    assert re.fullmatch(r"[A-Z]{1,8}", msg["content"]), msg
    assert r.choices[0].finish_reason == "stop" and "tool_calls" not in msg
    events = stream(server, messages=USER, max_tokens=80, structured_outputs={"grammar": CHANNELS})
    assert joined(events, "reasoning_content") == msg["reasoning_content"]
    assert joined(events, "content") == msg["content"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"


def test_free_output_is_schema_valid(client: Any) -> None:
    """Whatever a random model writes (no harmony at all, mostly) comes back as a valid response."""
    r, body = create(client, messages=USER, max_tokens=12, tools=[WEATHER, CLOCK])
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.usage.completion_tokens <= 12


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_tool_choice_forces_the_call(client: Any, server: ServerProcess, name: str) -> None:
    choice = {"type": "function", "function": {"name": name}}
    r, body = create(client, messages=USER, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == name and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
    assert r.choices[0].finish_reason == "stop"  # a named function's call ends with "stop", as OpenAI's does
    events = stream(server, messages=USER, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=60)
    calls = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls") or ()]
    assert calls[0]["function"]["name"] == name and calls[0]["id"]
    assert "".join(c["function"]["arguments"] for c in calls) == call.function.arguments


def test_required_tool_choice_forces_a_call(client: Any, server: ServerProcess) -> None:
    r, body = create(client, messages=USER, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    events = stream(server, messages=USER, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=60)
    calls = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls") or ()]
    assert calls[0]["function"]["name"] == call.function.name
    assert "".join(c["function"]["arguments"] for c in calls) == call.function.arguments
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"


def test_conversation_with_tool_results(client: Any, server: ServerProcess) -> None:
    """A prior call and its result are rendered as harmony renders them: the prompt the server
    counts is openai_harmony's, token for token."""
    from portside.server.harmony import load_encoding, render_harmony
    from portside.server.protocol.bodies import ChatCompletionRequest

    messages = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "use the tool",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]  # fmt: skip
    r, _ = create(client, messages=messages, tools=[WEATHER], reasoning_effort="low", max_tokens=4)
    req = ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages, "tools": [WEATHER]})
    expected = render_harmony(load_encoding(), req.messages, [WEATHER], "low")
    assert r.usage.prompt_tokens == len(expected)
    tokenized = post(server, "/tokenize", {"model": "tiny", "messages": messages, "add_special_tokens": False}).json()
    assert tokenized["tokens"] == render_harmony(load_encoding(), req.messages, None, None)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages[0].content"),
    ({"messages": USER + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages[1].tool_call_id"),
    ({"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"messages": USER, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"messages": USER, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])  # fmt: skip
def test_bad_input_is_400(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    r = post(server, "/v1/chat/completions", {"model": "tiny", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param, r.json()
