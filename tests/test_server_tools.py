"""Tool calling's request side and output side without a server: what `tool_choice` turns into,
how outputs (whole or in deltas split anywhere) become `tool_calls`, and what templates see."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from portside.server.protocol import ChatCompletionRequest
from portside.server.tools import ToolStream, parse_output, plan_tools, template_messages
from portside.testing.tiny import make_tiny_tokenizer
from portside.tool_parsers import get_tool_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]  # fmt: skip


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), added_tokens=("<tool_call>", "</tool_call>"))


def streamed(plan, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    stream, out = ToolStream(plan), []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for p in pieces:
        out += stream.feed(p)
    out += stream.finish()
    content = "".join(d.get("content", "") for d in out)
    calls: dict[int, dict] = {}
    for d in out:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            c["name"] += tc.get("function", {}).get("name") or ""
            c["arguments"] += tc.get("function", {}).get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def test_required_is_an_array_of_closed_calls_and_streams_each_when_complete() -> None:
    plan = plan_tools(request(tools=TOOLS, tool_choice="required"), None, None)
    schema = plan.constraint.schema()
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert {b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]} == {"get_weather", "ping"}
    assert all(b["properties"]["parameters"].get("additionalProperties") is False for b in schema["items"]["anyOf"])
    single = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None, None)
    assert single.constraint.schema()["maxItems"] == 1
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"ping","parameters":{}}]'
    content, calls = parse_output(plan, text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    for cuts in ([], [1], [30, 31], list(range(1, len(text)))):
        got_content, got = streamed(plan, text, cuts)
        assert got_content == "" and [c["name"] for c in got] == ["get_weather", "ping"], cuts
        assert [json.loads(c["arguments"]) for c in got] == [{"city": "Oslo"}, {}]
    # cut off by max_tokens: no call, the text comes back as content
    assert parse_output(plan, text[:20]) == (text[:20], [])
    assert streamed(plan, text[:20], [7]) == (text[:20], [])


def test_named_function_streams_its_arguments() -> None:
    plan = plan_tools(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}), None, None)
    assert plan.constraint.schema()["additionalProperties"] is False
    text = '{"city":"Lima"}'
    content, (call,) = parse_output(plan, text)
    assert content is None and call["function"] == {"name": "get_weather", "arguments": text}
    assert streamed(plan, text, [3, 9]) == ("", [{"name": "get_weather", "arguments": text}])


def test_auto_uses_the_parser_and_parallel_false_keeps_the_first_call(tokenizer) -> None:  # type: ignore[no-untyped-def]
    hermes = get_tool_parser("hermes")
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    for parallel, names in ((True, ["get_weather", "ping"]), (False, ["get_weather"])):
        plan = plan_tools(request(tools=TOOLS, parallel_tool_calls=parallel), hermes, tokenizer)
        content, calls = parse_output(plan, text)
        assert content == "Sure." and [c["function"]["name"] for c in calls] == names
        got_content, got = streamed(plan, text, [4, 20, 70])
        assert got_content == "Sure." and [c["name"] for c in got] == names
    with pytest.raises(Exception, match="--enable-auto-tool-choice"):
        plan_tools(request(tools=TOOLS), None, tokenizer)


def test_template_messages_and_request_validation() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    req = request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None, "annotations": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C"},
        {"role": "assistant", "content": None, "refusal": "I cannot help with that."},
    ])  # fmt: skip
    msgs = template_messages(req)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # templates want objects
    assert msgs[2] == {"role": "tool", "content": "3 C", "tool_call_id": "call_1"}
    assert msgs[3]["content"] == "I cannot help with that."
    bad = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]}, "audio"),
        ({"tools": TOOLS + TOOLS[:1]}, "unique"),
    ]
    for fields, needle in bad:
        with pytest.raises(ValidationError, match=needle):
            request(**fields)
