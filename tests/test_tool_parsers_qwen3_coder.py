"""The `qwen3_coder` tool parser's reading of values and of imperfect output: parameter text
converted by the type its schema gives (as vLLM does), values kept as text where the tools say
nothing or the text does not read as its type, the variants Qwen3-Coder is seen to write (a bare
`<function=...>`, an unclosed `<tool_call>` or value), malformed blocks as content; and the
server's tool plan handing the request's tools to the parser, third-party parsers included."""

from __future__ import annotations

import json
from typing import Any

import pytest

from portside.tool_parsers import Qwen3CoderToolParser, ToolParser
from portside.tool_parsers.qwen3_coder import convert

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def qwen3_call(name: str, args: dict[str, Any]) -> str:
    """A call as Qwen3-Coder's chat template renders one."""
    params = "".join(
        f"<parameter={k}>\n{json.dumps(v, ensure_ascii=False) if isinstance(v, dict | list) else v}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def qwen3(tools: list[dict[str, Any]] | None = TOOLS) -> ToolParser:
    parser = Qwen3CoderToolParser(None)
    parser.tools = tools
    return parser


def calls(parser: ToolParser, text: str) -> tuple[list[tuple[str, Any]], str | None]:
    out = parser.extract(text)
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls], out.content


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        ("-7", {"type": "integer"}, -7),
        ("4.5", {"type": "integer"}, "4.5"),  # not an integer: stays text
        ("3", {"type": "number"}, 3),
        ("2.5e3", {"type": "number"}, 2500.0),
        ("nan", {"type": "number"}, "nan"),
        ("1e999", {"type": "number"}, "1e999"),
        ("True", {"type": "boolean"}, True),  # Jinja's `string` filter writes Python's True
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("null", {"type": "integer"}, None),
        ("None", {"type": ["string", "null"]}, None),
        ("null", {"type": "string"}, "null"),  # a string stays the text
        ("123", {"type": "string"}, "123"),
        (" padded ", {"type": "string"}, " padded "),
        ('{"a": [1, {"b": null}]}', {"type": "object"}, {"a": [1, {"b": None}]}),
        ("{'a': True, 'b': None}", {"type": "object"}, {"a": True, "b": None}),  # a Python literal
        ("[1, 2]", {"type": "object"}, "[1, 2]"),  # an array is not an object
        ('["x", 2]', {"type": "array"}, ["x", 2]),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a set is not JSON
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("7", {"type": ["integer", "string"]}, 7),
        ("seven", {"type": ["integer", "string"]}, "seven"),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),
        ("2", {"enum": [1, 2, 3]}, 2),
        ("b", {"enum": ["a", "b"]}, "b"),
        ('{"k": 1}', {"properties": {"k": {}}}, {"k": 1}),
        ("12", None, "12"),  # a parameter the tools do not describe
        ("12", {"anyOf": 12, "type": 3}, "12"),  # a schema that is not one
        ("12", "integer", "12"),
        ("1" * 5000, {"type": "integer"}, "1" * 5000),  # past Python's digit limit: stays text
        ("[" * 5000 + "]" * 5000, {"type": "array"}, "[" * 5000 + "]" * 5000),  # nested too deep to read
    ],
)
def test_qwen3_coder_value_conversion(text: str, schema: Any, value: Any) -> None:
    assert convert(text, schema) == value
    assert type(convert(text, schema)) is type(value)


def test_qwen3_coder_without_tools_or_for_an_unknown_tool_values_are_strings() -> None:
    text = qwen3_call("get_weather", {"city": "Oslo", "days": 2})
    assert calls(qwen3(None), text)[0] == [("get_weather", {"city": "Oslo", "days": "2"})]
    assert calls(qwen3(), qwen3_call("unknown", {"days": 2}))[0] == [("unknown", {"days": "2"})]


def test_qwen3_coder_tolerated_variants() -> None:
    parser = qwen3()
    # a bare function (the model left out <tool_call>), and a <tool_call> never closed at the end
    bare = "<function=get_time>\n</function>"
    assert calls(parser, "Checking. " + bare + " ok") == ([("get_time", {})], "Checking.  ok")
    assert calls(parser, "<tool_call>\n<function=get_weather>\n<parameter=days>\n5\n</parameter>\n</function>\n") == (
        [("get_weather", {"days": 5})], None)  # fmt: skip
    # a value left open ends at the next parameter or the function's end
    open_value = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n1\n</function>\n</tool_call>"
    assert calls(parser, open_value)[0] == [("get_weather", {"city": "Rome", "days": 1})]
    # two functions in one block
    two = "<tool_call>\n<function=get_time>\n</function>\n<function=get_time>\n</function>\n</tool_call>"
    assert calls(parser, two)[0] == [("get_time", {}), ("get_time", {})]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",  # cut off: never closed
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis",
        "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>",  # not this format
        "<tool_call>\nnote <function=get_time>\n</function>\n</tool_call>",  # text inside the block
        "<tool_call>\n<function=get time>\n</function>\n</tool_call>",  # a name with a space
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>",
        "Use <function=name> tags to call.",
        "<tool_",
    ],
)
def test_qwen3_coder_malformed_is_content(text: str) -> None:
    out = qwen3().extract(text)
    assert out.tool_calls == [] and out.content == text


def test_qwen3_coder_bad_block_between_good_ones() -> None:
    good = qwen3_call("get_time", {})
    bad = "<tool_call>\n<function=get_time>\noops\n</function>\n</tool_call>"
    found, content = calls(qwen3(), good + bad + good)
    assert found == [("get_time", {}), ("get_time", {})] and content == bad


def test_plan_tools_gives_the_parser_the_requests_tools() -> None:
    from portside.server.protocol import ChatCompletionRequest
    from portside.server.tools import ToolStream, parse_output, plan_tools

    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    plan = plan_tools(req, Qwen3CoderToolParser, None)
    assert plan.parser.tools == TOOLS
    text = "Sure." + qwen3_call("get_weather", {"city": "Lima", "days": 4, "metric": False})
    content, (call,) = parse_output(plan, text)
    assert content == "Sure." and json.loads(call["function"]["arguments"]) == {"city": "Lima", "days": 4, "metric": False}
    stream_ = ToolStream(plan)
    deltas = stream_.feed(text[:40]) + stream_.feed(text[40:]) + stream_.finish()
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d] == [call["function"]["arguments"]]

    class OnlyTokenizer(ToolParser):  # a third-party parser whose constructor takes the tokenizer alone
        name = "only_tokenizer"

        def __init__(self, tokenizer: Any) -> None:
            self.tok = tokenizer

    assert plan_tools(req, OnlyTokenizer, "tok").parser.tools == TOOLS
    with pytest.raises(Exception, match=r"--tool-call-parser \(hermes, .*qwen3_coder, pythonic, kimi_k2, granite\)"):
        plan_tools(req, None, None)
