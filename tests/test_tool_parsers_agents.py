"""The agent models' tool-call parsers: `qwen3_coder` (XML calls, values typed by the request's
tool schemas), `pythonic` (Llama 3.2 / 4 Python lists), `kimi_k2` (special-token sections whose
call ids are Kimi's own) and `granite` (a JSON array after `<|tool_call|>`). Outputs are written
the way the models' chat templates render past calls; each gives its calls and the text around
them, malformed or cut-off ones come back as content without raising, streaming equals batch for
every split (and token by token through a tokenizer holding the markers); the registry finds
them. (`qwen3_coder`'s value conversion and tolerated variants: test_tool_parsers_qwen3_coder.py.)"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portside.tool_parsers import (
    TOOL_PARSERS,
    GraniteToolParser,
    KimiK2ToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolParser,
    described,
    get_tool_parser,
)

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "threshold": {"type": "number"},
        "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "filters": {"type": "object"},
        "note": {"type": ["string", "null"]},
        "zip": {"type": "string"},
    },
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def qwen3_call(name: str, args: dict[str, Any]) -> str:
    """A call as Qwen3-Coder's chat template renders one: objects and arrays as JSON, the rest as text."""
    params = "".join(
        f"<parameter={k}>\n{json.dumps(v, ensure_ascii=False) if isinstance(v, dict | list) else v}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


QWEN3_TWO_CALLS = (
    "I'll look up the weather in both cities.\n"
    + qwen3_call("get_weather", {"city": "San Francisco, CA", "days": 3, "metric": True, "hours": [9, 12]})
    + "\n"
    + qwen3_call("get_weather", {"city": "東京", "threshold": 2.5, "filters": {"rain": {"min": 0.1}, "tags": ["a"]}})
)
SOURCE = 'def main():\n    print("héllo </tool> 🙂")\n\n\nif __name__ == "__main__":\n    main()\n'
QWEN3_MULTILINE = qwen3_call("write_file", {"path": "src/app.py", "content": SOURCE})
PYTHONIC_LLAMA32 = '[get_weather(city="San Francisco", metric="celsius"), get_time(timezone=\'America/Los_Angeles\')]'
PYTHONIC_LLAMA4 = (
    "Let me check.<|python_start|>[search(query='東京 weather', filters={'days': [1, 2], 'exact': True, "
    "'radius': -2.5, 'unit': None})]<|python_end|>"
)
KIMI_TWO_CALLS = (
    "I'll check the weather first."
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Zürich", "days": [1, 2]}<|tool_call_end|>'
    "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
)
GRANITE_TEMPLATE_STYLE = "<|tool_call|>" + json.dumps(
    [{"name": "get_current_weather", "arguments": {"location": "Boston, MA", "unit": "fahrenheit"}},
     {"name": "get_stock_price", "arguments": {"ticker": "IBM", "opts": {"currency": "€"}}}],
    indent=4, ensure_ascii=False,
)  # fmt: skip  (Granite's template writes past calls with tojson(indent=4))
GRANITE_30 = '<tool_call>[{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]'

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny BPE with the formats' markers as single tokens: Qwen's `<tool_call>` plain added
    tokens (as in Qwen3-Coder's tokenizer), Kimi's, Llama 4's and Granite's special ones."""
    from portside.testing.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), added_tokens=("<tool_call>", "</tool_call>"))
    tok.add_tokens([
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
        "<|tool_call_argument_begin|>", "<|python_start|>", "<|python_end|>", "<|tool_call|>",
    ], special_tokens=True)  # fmt: skip
    return tok


def qwen3(tools: list[dict[str, Any]] | None = TOOLS) -> ToolParser:
    parser = Qwen3CoderToolParser(None)
    parser.tools = tools
    return parser


def calls(parser: ToolParser, text: str) -> tuple[list[tuple[str, Any]], str | None]:
    out = parser.extract(text)
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls], out.content


def stream(parser: ToolParser, pieces: list[str]) -> tuple[list[tuple[str, str, str]], str | None]:
    """(calls as (name, arguments, id-or-"new"), content) from streaming `pieces`, checking the events."""
    streamer = parser.streamer()
    events = [e for p in pieces for e in streamer.feed(p)] + streamer.finish()
    for e in events:
        assert (e.content is None) != (e.call is None), e
        assert (e.index is None) == (e.call is None), e
    assert [e.index for e in events if e.call] == list(range(sum(1 for e in events if e.call)))
    content = "".join(e.content for e in events if e.content)
    return [(e.call.name, e.call.arguments, _id(e.call.id)) for e in events if e.call], content or None


def batch(parser: ToolParser, text: str) -> tuple[list[tuple[str, str, str]], str | None]:
    out = parser.extract(text)
    return [(c.name, c.arguments, _id(c.id)) for c in out.tool_calls], out.content


def _id(call_id: str) -> str:
    """Random ids compare as "new"; ids the format carries (Kimi's) as themselves."""
    return "new" if CALL_ID.fullmatch(call_id) else call_id


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# ---- qwen3_coder -------------------------------------------------------------------------------


def test_qwen3_coder_calls_typed_by_the_tool_schemas() -> None:
    found, content = calls(qwen3(), QWEN3_TWO_CALLS)
    assert found == [
        ("get_weather", {"city": "San Francisco, CA", "days": 3, "metric": True, "hours": [9, 12]}),
        ("get_weather", {"city": "東京", "threshold": 2.5, "filters": {"rain": {"min": 0.1}, "tags": ["a"]}}),
    ]
    assert content == "I'll look up the weather in both cities.\n\n"


def test_qwen3_coder_multiline_value_kept_verbatim() -> None:
    (call,), content = calls(qwen3(), "Writing it now." + QWEN3_MULTILINE + "\nDone.")
    assert call == ("write_file", {"path": "src/app.py", "content": SOURCE})
    assert content == "Writing it now.\nDone."


# ---- pythonic ----------------------------------------------------------------------------------


def test_pythonic_llama32_list() -> None:
    parser = PythonicToolParser(None)
    assert calls(parser, PYTHONIC_LLAMA32) == (
        [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
         ("get_time", {"timezone": "America/Los_Angeles"})], None)  # fmt: skip
    multiline = "\n[\n    get_weather(\n        city='Paris',  # the capital\n        days=3,\n    ),\n]\n"
    assert calls(parser, multiline) == ([("get_weather", {"city": "Paris", "days": 3})], None)


def test_pythonic_llama4_wrapped_after_text() -> None:
    found, content = calls(PythonicToolParser(None), PYTHONIC_LLAMA4 + " Anything else?")
    assert found == [("search", {"query": "東京 weather", "filters": {"days": [1, 2], "exact": True, "radius": -2.5, "unit": None}})]
    assert content == "Let me check. Anything else?"


def test_pythonic_strings_with_brackets_quotes_and_escapes() -> None:
    text = r'''[run(cmd="echo ']' \"[\" )", script="""a = [1,
(2)]""", pattern='\\d+\'')]'''
    assert calls(PythonicToolParser(None), text)[0] == [
        ("run", {"cmd": "echo ']' \"[\" )", "script": "a = [1,\n(2)]", "pattern": "\\d+'"})]


@pytest.mark.parametrize(
    "text",
    [
        "[get_weather('Paris')]",  # positional
        "[get_weather(city=paris)]",  # a name, not a literal
        "[get_weather(city=f'{x}')]",
        "[get_weather(city=open('/etc/passwd').read())]",
        "[get_weather(coords=(1, 2))]",  # a tuple is not JSON
        "[get_weather(tags={1, 2})]",
        "[get_weather(d={1: 'a'})]",  # a non-string key
        "[get_weather(x=1e999)]",
        "[get_weather(**opts)]",
        "[math.sqrt(x=4)]",
        "[get_weather(city='Paris'), 3]",
        "[get_weather(city='Paris')",  # cut off
        "[]",
        "[1, 2, 3] are the first numbers.",
        "[link](https://example.com) text",
        "The calls are [get_weather(city='Paris')].",  # not at the start, not after <|python_start|>
        "<|python_start|>print('hi')<|python_end|>",
        "<|python_sta",
    ],
)
def test_pythonic_not_calls_is_content(text: str) -> None:
    out = PythonicToolParser(None).extract(text)
    assert out.tool_calls == [] and out.content == text


# ---- kimi_k2 -----------------------------------------------------------------------------------


def test_kimi_k2_calls_keep_kimis_ids() -> None:
    out = KimiK2ToolParser(None).extract(KIMI_TWO_CALLS)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Zürich", "days": [1, 2]}),
        ("functions.get_time:1", "get_time", {}),
    ]
    assert out.content == "I'll check the weather first."
    spaced = ("<|tool_calls_section_begin|>\n<|tool_call_begin|> functions.search:2 <|tool_call_argument_begin|> "
              '{"q": "x"} <|tool_call_end|>\n<|tool_calls_section_end|>\nHere you go.')  # fmt: skip
    out = KimiK2ToolParser(None).extract(spaced)
    assert [(c.id, c.name) for c in out.tool_calls] == [("functions.search:2", "search")] and out.content == "\nHere you go."


@pytest.mark.parametrize(
    "text",
    [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather<|tool_call_argument_begin|>{}<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"a\": <|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{}<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\"",
        "<|tool_calls_section_begin|>I changed my mind.<|tool_calls_section_end|>",
        "<|tool_calls_sec",
    ],
)
def test_kimi_k2_malformed_is_content(text: str) -> None:
    out = KimiK2ToolParser(None).extract(text)
    assert out.tool_calls == [] and out.content == text


def test_kimi_k2_section_never_closed_keeps_its_closed_blocks() -> None:
    text = KIMI_TWO_CALLS.removesuffix("<|tool_calls_section_end|>")
    assert [c.id for c in KimiK2ToolParser(None).extract(text).tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]


# ---- granite -----------------------------------------------------------------------------------


def test_granite_template_style_array() -> None:
    assert calls(GraniteToolParser(None), GRANITE_TEMPLATE_STYLE) == (
        [("get_current_weather", {"location": "Boston, MA", "unit": "fahrenheit"}),
         ("get_stock_price", {"ticker": "IBM", "opts": {"currency": "€"}})], None)  # fmt: skip
    assert calls(GraniteToolParser(None), GRANITE_30) == ([("get_time", {"tz": "Asia/Tokyo"})], None)
    single = 'Sure! <|tool_call|>{"name": "get_time", "arguments": {}} Anything else?'
    assert calls(GraniteToolParser(None), single) == ([("get_time", {})], "Sure!  Anything else?")


@pytest.mark.parametrize(
    "text",
    [
        '<|tool_call|>[{"name": "get_time", "arguments": {}}, {"arguments": {}}]',  # an element without a name
        '<|tool_call|>[{"name": "get_time", "arguments": [1]}]',
        '<|tool_call|>[{"name": "get_time", "arguments": {"x": NaN}}]',  # not JSON's
        "<|tool_call|>[]",
        "<|tool_call|>I cannot call tools.",
        '<|tool_call|>[{"name": "get_time", "arguments": {',  # cut off
        '[{"name": "get_time", "arguments": {}}]',  # no marker
        "<|tool_ca",
    ],
)
def test_granite_malformed_is_content(text: str) -> None:
    out = GraniteToolParser(None).extract(text)
    assert out.tool_calls == [] and out.content == text


# ---- streaming ---------------------------------------------------------------------------------

SAMPLES: dict[str, list[str]] = {
    "qwen3_coder": [
        QWEN3_TWO_CALLS,
        QWEN3_MULTILINE + "\nDone.",
        "<function=get_time>\n</function> and <tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n",
        "<tool_call>\n<function=get_time>\noops\n</function>\n</tool_call>" + qwen3_call("get_time", {}),
        "Plain answer with <tool_ and </function> in it.",
    ],
    "pythonic": [
        PYTHONIC_LLAMA32,
        PYTHONIC_LLAMA4 + "\nDone.",
        "  [f(a='''x]'''), g(b=\"\\\"]\")]  <|python_end|>tail",
        "[1, 2] then <|python_start|>[f(x=1)]<|python_end|><|python_start|>[oops(]<|python_end|>",
        "[get_weather(city='Paris')",
    ],
    "kimi_k2": [
        KIMI_TWO_CALLS,
        KIMI_TWO_CALLS.removesuffix("<|tool_calls_section_end|>") + "<|tool_call_begin|>functions.x:2",
        "a<|tool_calls_section_begin|>junk<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>b",
    ],
    "granite": [
        GRANITE_TEMPLATE_STYLE,
        "Checking. " + GRANITE_30 + " Done.",
        '<|tool_call|>[{"name": "f", "arguments": {"s": "]}"}}, 1]<|tool_call|>{"name": "g"}',
        '<|tool_call|> oops <tool_call>[{"name": "f", "arguments": {',
    ],
}
CASES = [(name, text) for name, texts in SAMPLES.items() for text in texts]


def parser_for(name: str, tokenizer: Any = None) -> ToolParser:
    parser = TOOL_PARSERS[name](tokenizer)
    parser.tools = TOOLS
    return parser


@pytest.mark.parametrize(("name", "text"), CASES)
def test_streaming_equals_batch_every_two_way_split(name: str, text: str) -> None:
    parser = parser_for(name)
    expected = batch(parser, text)
    assert stream(parser, list(text)) == expected
    for i in range(len(text) + 1):
        assert stream(parser, [text[:i], text[i:]]) == expected, i


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_streaming_token_by_token(tokenizer: Any, name: str) -> None:
    """Deltas as the server makes them: incremental detokenization of the encoded output, with
    special tokens kept when the parser asks for them."""
    parser = parser_for(name, tokenizer)
    for text in SAMPLES[name]:
        ids = tokenizer.encode(text)
        pieces, done = [], ""
        for k in range(1, len(ids) + 1):
            so_far = tokenizer.decode(ids[:k], skip_special_tokens=not parser.needs_special_tokens)
            if not so_far.endswith("\ufffd"):
                pieces.append(so_far[len(done) :])
                done = so_far
        assert done == text
        assert stream(parser, pieces) == batch(parser, text)


def test_calls_are_emitted_as_soon_as_complete() -> None:
    streamer = parser_for("qwen3_coder").streamer()
    first, rest = QWEN3_TWO_CALLS.split("</tool_call>", 1)
    events = streamer.feed(first)
    assert [e.content for e in events] == ["I'll look up the weather in both cities.\n"]
    (event,) = streamer.feed("</tool_call>")
    assert event.call is not None and event.call.name == "get_weather" and event.index == 0
    streamer = parser_for("pythonic").streamer()
    assert streamer.feed("[get_weather(city='a'), get_time(") == []
    assert [e.call.name for e in streamer.feed(")]") if e.call] == ["get_weather", "get_time"]


# Whole calls, their pieces and near-misses, so that random texts hold calls as well as junk.
_FRAGMENTS = {
    "qwen3_coder": [
        qwen3_call("get_weather", {"days": 2}), "<tool_call>", "</tool_call>", "<function=f>", "</function>",
        "<parameter=days>", "</parameter>", "<tool_", "<parameter=", "\n", "7", " ", "x",
    ],
    "pythonic": [
        "[f(a=1)]", "[", "]", "f(", ")", "a='", "'", '"""', "=", ", ", "<|python_start|>", "<|python_end|>", "<|py",
        "#", "\n", "\\", " ", "x",
    ],
    "kimi_k2": [
        '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>',
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
        "<|tool_call_argument_begin|>", "<|tool_", "functions.f:1", "{}", " ", "x",
    ],
    "granite": [
        '<|tool_call|>[{"name": "f", "arguments": {"a": "]"}}]', "<|tool_call|>", "<tool_call>", "<|tool",
        '{"name": "f"', ', "arguments": {}', "}", "[", "]", " ", "x",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_FRAGMENTS))
def test_streaming_equals_batch_any_split(name: str) -> None:
    parser = parser_for(name)

    @settings(max_examples=300, deadline=None)
    @given(text=st.lists(st.sampled_from(_FRAGMENTS[name]), max_size=10).map("".join), data=st.data())
    def check(text: str, data: st.DataObject) -> None:
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=24))
        assert stream(parser, split(text, cuts)) == batch(parser, text)

    check()


@pytest.mark.parametrize("name", sorted(_FRAGMENTS))
@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_arbitrary_text_never_raises(name: str, text: str) -> None:
    parser = parser_for(name)
    out = parser.extract(text)
    if not out.tool_calls:  # nothing taken for a call: all of it comes back (whitespace-only text is dropped)
        assert out.content == (text if text.strip() else None)


# ---- registry and the server's tool plan -------------------------------------------------------


def test_registry_and_help() -> None:
    for name, cls in [("qwen3_coder", Qwen3CoderToolParser), ("pythonic", PythonicToolParser),
                      ("kimi_k2", KimiK2ToolParser), ("granite", GraniteToolParser)]:  # fmt: skip
        assert get_tool_parser(name) is cls and cls.name == name
    assert [cls.needs_special_tokens for cls in (Qwen3CoderToolParser, PythonicToolParser, KimiK2ToolParser, GraniteToolParser)] == [
        False, True, True, True]  # fmt: skip
    assert "qwen3_coder (Qwen3-Coder)" in described() and "granite (Granite 3.x)" in described()
