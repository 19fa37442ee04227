"""Tool-call parsers: recorded-style hermes, llama3_json and mistral outputs give the calls and
the text around them; malformed ones come back as content without raising; streaming equals
batch for every split of the text; the registry finds built-in and entry-point parsers."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portside.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
)

HERMES_TWO_CALLS = """\
I'll check the weather in both cities.
<tool_call>
{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": "fahrenheit"}}
</tool_call>
<tool_call>
{"name": "get_current_weather", "arguments": {"location": "Tokyo, Japan", "unit": "celsius"}}
</tool_call>"""
HERMES_UNICODE_NESTED = (
    '<tool_call>\n{"name": "search_flights", "arguments": {"from": "São Paulo", "to": "東京", '
    '"filters": {"cabin": ["economy", "premium"], "stops": {"max": 1, "via": []}}, '
    '"note": "window seat \\"please\\" }{ 🙂"}}\n</tool_call>'
)
LLAMA3_PYTHON_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
LLAMA3_SEMICOLONS = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'
)
MISTRAL_PRE_V11 = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}, '
    '{"name": "get_current_time", "arguments": {}}]'
)
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Zurich"}'
MISTRAL_V13 = '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Lyon"}'

CALL_ID = re.compile(r"call_[0-9a-f]{24}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The project's tiny BPE with the formats' markers: plain added tokens, except Mistral's
    control tokens, which are special (dropped by skip_special_tokens=True)."""
    from portside.testing.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.add_tokens(["<tool_call>", "</tool_call>", "<|python_tag|>"])
    tok.add_tokens(["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"], special_tokens=True)
    return tok


@pytest.fixture(scope="module")
def hermes(tokenizer: Any) -> ToolParser:
    return HermesToolParser(tokenizer)


@pytest.fixture(scope="module")
def llama3(tokenizer: Any) -> ToolParser:
    return Llama3JsonToolParser(tokenizer)


@pytest.fixture(scope="module")
def mistral(tokenizer: Any) -> ToolParser:
    return MistralToolParser(tokenizer)


def calls(result: ExtractedToolCalls) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def stream(parser: ToolParser, pieces: list[str]) -> tuple[list[tuple[str, str]], str | None]:
    """(calls, content) from streaming `pieces`, checking the events are well formed."""
    streamer = parser.streamer()
    events = [e for p in pieces for e in streamer.feed(p)] + streamer.finish()
    for e in events:
        assert (e.content is None) != (e.call is None), e
        assert (e.index is None) == (e.call is None), e
    assert [e.index for e in events if e.call] == list(range(sum(1 for e in events if e.call)))
    content = "".join(e.content for e in events if e.content)
    return [(e.call.name, e.call.arguments) for e in events if e.call], content or None


def batch(parser: ToolParser, text: str) -> tuple[list[tuple[str, str]], str | None]:
    result = parser.extract(text)
    return [(c.name, c.arguments) for c in result.tool_calls], result.content


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# ---- hermes ------------------------------------------------------------------------------------


def test_hermes_two_parallel_calls_with_text(hermes: ToolParser) -> None:
    result = hermes.extract(HERMES_TWO_CALLS)
    assert result.tools_called
    assert calls(result) == [
        ("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"}),
        ("get_current_weather", {"location": "Tokyo, Japan", "unit": "celsius"}),
    ]
    assert result.content == "I'll check the weather in both cities.\n\n"
    assert all(CALL_ID.fullmatch(c.id) for c in result.tool_calls)
    assert len({c.id for c in result.tool_calls}) == 2


def test_hermes_unicode_and_nested_arguments(hermes: ToolParser) -> None:
    result = hermes.extract(HERMES_UNICODE_NESTED)
    (call,) = result.tool_calls
    assert '"São Paulo"' in call.arguments and '"東京"' in call.arguments  # not \\u-escaped
    assert json.loads(call.arguments)["filters"] == {"cabin": ["economy", "premium"], "stops": {"max": 1, "via": []}}
    assert json.loads(call.arguments)["note"] == 'window seat "please" }{ 🙂'
    assert result.content is None


def test_hermes_no_arguments_and_plain_text(hermes: ToolParser) -> None:
    result = hermes.extract('<tool_call>\n{"name": "list_files"}\n</tool_call>')
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("list_files", "{}")]
    plain = hermes.extract("The capital of France is Paris.")
    assert not plain.tools_called and plain.content == "The capital of France is Paris."


def test_hermes_unclosed_blocks(hermes: ToolParser) -> None:
    # The last block's closing tag is missing (the model stopped at EOS): still a call.
    result = hermes.extract('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n')
    assert calls(result) == [("get_time", {"tz": "UTC"})] and result.content is None
    # A forgotten closing tag before the next block.
    result = hermes.extract(
        '<tool_call>\n{"name": "a", "arguments": {}}\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
    )
    assert calls(result) == [("a", {}), ("b", {"x": 1})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # truncated JSON
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',  # a string
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        '<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>',  # not an object
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",  # not JSON
        "Wrap each call in a <tool_call> tag, then close it with </tool_call>.",  # the marker in prose
        "<tool_call>",
    ],
)
def test_hermes_malformed_is_content(hermes: ToolParser, text: str) -> None:
    result = hermes.extract(text)
    assert not result.tools_called and result.content == text


def test_hermes_bad_block_between_good_ones(hermes: ToolParser) -> None:
    bad = '<tool_call>\n{"name": "b", "arguments": [1]}\n</tool_call>'
    text = f'<tool_call>\n{{"name": "a", "arguments": {{}}}}\n</tool_call>\n{bad}\nok'
    result = hermes.extract(text)
    assert calls(result) == [("a", {})]
    assert result.content == f"\n{bad}\nok"


# ---- llama3_json -------------------------------------------------------------------------------


def test_llama3_python_tag(llama3: ToolParser) -> None:
    result = llama3.extract(LLAMA3_PYTHON_TAG)
    assert calls(result) == [("get_weather", {"city": "Paris", "days": 3})] and result.content is None
    assert CALL_ID.fullmatch(result.tool_calls[0].id)


def test_llama3_semicolon_separated_calls(llama3: ToolParser) -> None:
    result = llama3.extract("\n\n" + LLAMA3_SEMICOLONS)
    assert calls(result) == [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]
    assert result.content is None


def test_llama3_unicode_nested(llama3: ToolParser) -> None:
    text = (
        '{"name": "translate", "parameters": {"text": "naïve café", "target": {"lang": "日本語", "tags": ["a{", "}"]}}}'
    )
    result = llama3.extract(text)
    assert calls(result) == [("translate", {"text": "naïve café", "target": {"lang": "日本語", "tags": ["a{", "}"]}})]
    assert "naïve café" in result.tool_calls[0].arguments


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",  # plain answer
        '{"answer": 42}',  # a JSON answer, not a call
        '{"name": "Ada Lovelace", "born": 1815}',  # has a name, but no parameters: an answer
        '{"name": "get_weather", "parameters": {"city": "Pa',  # truncated
        '{"name": "get_weather", "parameters": "Paris"}',  # not an object
        '<|python_tag|>brave_search.call(query="weather Paris")',  # a built-in tool, not JSON
        'Sure! {"name": "get_weather", "parameters": {}}',  # text first
        "<|python_tag|>",
    ],
)
def test_llama3_not_a_call_is_content(llama3: ToolParser, text: str) -> None:
    result = llama3.extract(text)
    assert not result.tools_called and result.content == text


def test_llama3_calls_then_unparseable_rest(llama3: ToolParser) -> None:
    result = llama3.extract('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": ')
    assert calls(result) == [("a", {})] and result.content == '{"name": "b", "parameters": {"x": '
    result = llama3.extract('{"name": "a", "parameters": {}}\n\nI have called the tool.')
    assert calls(result) == [("a", {})] and result.content == "I have called the tool."
    result = llama3.extract('{"name": "a", "parameters": {}};')  # a trailing separator
    assert calls(result) == [("a", {})] and result.content is None


# ---- mistral -----------------------------------------------------------------------------------


def test_mistral_pre_v11_array(mistral: ToolParser) -> None:
    result = mistral.extract("Let me look that up." + MISTRAL_PRE_V11)
    assert calls(result) == [
        ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
        ("get_current_time", {}),
    ]
    assert result.content == "Let me look that up."
    assert all(MISTRAL_ID.fullmatch(c.id) for c in result.tool_calls)


def test_mistral_v11_repeated(mistral: ToolParser) -> None:
    result = mistral.extract(MISTRAL_V11)
    assert calls(result) == [("get_weather", {"city": "Zürich"}), ("get_time", {"tz": "Europe/Zurich"})]
    assert '"Zürich"' in result.tool_calls[0].arguments and result.content is None
    assert all(MISTRAL_ID.fullmatch(c.id) for c in result.tool_calls)


def test_mistral_call_id_from_the_format(mistral: ToolParser) -> None:
    (call,) = mistral.extract(MISTRAL_V13).tool_calls
    assert (call.name, call.arguments, call.id) == ("get_weather", '{"city": "Lyon"}', "a1B2c3D4e")


def test_mistral_needs_special_tokens(tokenizer: Any, mistral: ToolParser) -> None:
    assert MistralToolParser.needs_special_tokens and not HermesToolParser.needs_special_tokens
    ids = tokenizer.encode(MISTRAL_V11)
    assert calls(mistral.extract(tokenizer.decode(ids, skip_special_tokens=False))) == calls(
        mistral.extract(MISTRAL_V11)
    )
    assert not mistral.extract(tokenizer.decode(ids, skip_special_tokens=True)).tools_called


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS] I'm sorry, I can't call tools for that.",  # garbage after the marker
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Par',  # truncated array
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": 3}]',  # one bad element
        "[TOOL_CALLS] []",
        "[TOOL_CALLS]get_weather[ARGS][1, 2]",  # v11 arguments not an object
        '[TOOL_CALLS]get_weather[ARGS]{"city": ',  # truncated v11
        "[TOOL_CALLS]get_weather",
        "The [TOOL_CALLS] token starts a call.",  # the marker in prose
    ],
)
def test_mistral_malformed_is_content(mistral: ToolParser, text: str) -> None:
    result = mistral.extract(text)
    assert not result.tools_called and result.content == text


# ---- streaming ---------------------------------------------------------------------------------


def test_content_streams_before_the_marker(hermes: ToolParser) -> None:
    streamer = hermes.streamer()
    assert streamer.feed("Checking ") == [ToolCallDelta(content="Checking ")]
    assert streamer.feed("now.\n<tool") == [ToolCallDelta(content="now.\n")]  # "<tool" held back
    assert streamer.feed('_call>\n{"name": "f", "arguments": {"a": 1}}\n') == []
    (event,) = streamer.feed("</tool_call>")
    assert event.index == 0 and event.call is not None and (event.call.name, event.call.arguments) == ("f", '{"a": 1}')
    assert streamer.feed(" and <tool box>") == [ToolCallDelta(content=" and <tool box>")]
    assert streamer.finish() == []


def test_llama3_call_emitted_when_its_json_closes(llama3: ToolParser) -> None:
    streamer = llama3.streamer()
    assert streamer.feed('<|python_tag|>{"name": "f", "parameters": {"a": {"b": 1}}') == []
    (event,) = streamer.feed("}; ")
    assert event.index == 0 and event.call is not None and event.call.name == "f"
    (event,) = streamer.feed('{"name": "g", "parameters": {}}')
    assert event.index == 1 and event.call is not None and event.call.name == "g"
    assert streamer.finish() == []


def test_mistral_streams_content_then_calls(mistral: ToolParser) -> None:
    streamer = mistral.streamer()
    assert streamer.feed("Sure.[TOOL_") == [ToolCallDelta(content="Sure.")]
    assert streamer.feed("CALLS]get_weather[AR") == []
    (event,) = streamer.feed('GS]{"city": "Nice"}[TOOL')
    assert event.index == 0 and event.call is not None and MISTRAL_ID.fullmatch(event.call.id)
    assert streamer.finish() == [ToolCallDelta(content="[TOOL")]


def test_unfinished_call_flushed_as_content(hermes: ToolParser) -> None:
    streamer = hermes.streamer()
    assert streamer.feed('<tool_call>\n{"name": "f", "argu') == []
    assert streamer.finish() == [ToolCallDelta(content='<tool_call>\n{"name": "f", "argu')]


SAMPLES: dict[str, list[str]] = {
    "hermes": [
        HERMES_TWO_CALLS,
        HERMES_UNICODE_NESTED,
        'text <tool_call>{"name": "a"}<tool_call>{"name": "b", "arguments": {"x": "</tool_call>"}}</tool_call> end',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu',
        "see <tool_call> and </tool_call> here",
        "  \n",
    ],
    "llama3_json": [
        LLAMA3_PYTHON_TAG,
        "  " + LLAMA3_SEMICOLONS,
        '{"name": "a", "parameters": {"s": "}{\\""}} ; {"name": "b", "parameters": {}}\nDone.',
        '{"name": "a", "parameters": {}}; {"x": 1}; {"name": "c", "parameters": {}}',
        '<|python_tag|>{"name": "a", "parameters": ',
        "<|python_tag|> hello",
        "Paris is the capital.",
    ],
    "mistral": [
        "Let me check." + MISTRAL_PRE_V11,
        MISTRAL_V11,
        MISTRAL_V13 + " thanks",
        '[TOOL_CALLS]bad name[ARGS]{}[TOOL_CALLS]{"name": "ok", "arguments": {"q": "[ARGS]"}}',
        '[TOOL_CALLS]f[CALL_ID]abc{"a": 1}',
        "no calls [TOOL here",
    ],
}
CASES = [(name, text) for name, texts in SAMPLES.items() for text in texts]


@pytest.mark.parametrize(("name", "text"), CASES)
def test_streaming_equals_batch_every_two_way_split(name: str, text: str) -> None:
    parser = TOOL_PARSERS[name](None)
    expected = batch(parser, text)
    assert stream(parser, list(text)) == expected
    for i in range(len(text) + 1):
        assert stream(parser, [text[:i], text[i:]]) == expected, i


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_streaming_token_by_token(tokenizer: Any, name: str) -> None:
    """Deltas as the server makes them: incremental detokenization of the encoded output."""
    parser = TOOL_PARSERS[name](tokenizer)
    for text in SAMPLES[name]:
        ids = tokenizer.encode(text)
        skip = not parser.needs_special_tokens
        pieces, done = [], ""
        for k in range(1, len(ids) + 1):
            so_far = tokenizer.decode(ids[:k], skip_special_tokens=skip)
            if not so_far.endswith("\ufffd"):
                pieces.append(so_far[len(done) :])
                done = so_far
        assert done == text
        assert stream(parser, pieces) == batch(parser, text)


# Whole calls, their pieces and near-misses, so that random texts hold calls as well as junk.
_FRAGMENTS = {
    "hermes": [
        '<tool_call>\n{"name": "f", "arguments": {"a": "}"}}\n</tool_call>',
        "<tool_call>", "</tool_call>", "<tool_", "</tool", '{"name": "f"', ', "arguments": {"a": 1}', "}", "\n", "x",
    ],
    "llama3_json": [
        '{"name": "f", "parameters": {"a": "}"}}', "<|python_tag|>", "<|py", '{"name": "f"', ', "parameters": {}',
        ', "arguments": [1]', "}", ";", " ", "x",
    ],
    "mistral": [
        '[TOOL_CALLS]f[ARGS]{"a": "]"}', '[TOOL_CALLS][{"name": "f", "arguments": {}}]', "[TOOL_CALLS]", "[TOOL",
        "f", "[ARGS]", "[CALL_ID]", "id1", "[AR", '{"a": 1}', '[{"name": "f"}]', " ", "x",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_FRAGMENTS))
def test_streaming_equals_batch_any_split(name: str) -> None:
    parser = TOOL_PARSERS[name](None)

    @settings(max_examples=150, deadline=None)
    @given(text=st.lists(st.sampled_from(_FRAGMENTS[name]), max_size=8).map("".join), data=st.data())
    def check(text: str, data: st.DataObject) -> None:
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=24))
        assert stream(parser, split(text, cuts)) == batch(parser, text)

    check()


# ---- registry ----------------------------------------------------------------------------------


def test_builtin_parsers() -> None:
    assert set(TOOL_PARSERS) == {"deepseek_v3", "granite", "hermes", "kimi_k2", "llama3_json", "mistral", "pythonic", "qwen3_coder"}
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match=r"unknown tool parser 'nope'; known: deepseek_v3, granite, hermes, kimi_k2, llama3_json, mistral, pythonic, qwen3_coder"):
        get_tool_parser("nope")


def test_third_party_parser_from_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stevedore import ExtensionManager

    (tmp_path / "fake_tools.py").write_text(
        textwrap.dedent(
            """
            from portside.tool_parsers.hermes import HermesToolParser

            class XmlToolParser(HermesToolParser):
                name = "xml"

            NOT_A_PARSER = "xml"
            """
        )
    )
    dist = tmp_path / "fake_tools-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-tools\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[portside.tool_parsers]\nxml = fake_tools:XmlToolParser\nnot_a_class = fake_tools:NOT_A_PARSER\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
    cls = get_tool_parser("xml")
    assert cls.__name__ == "XmlToolParser" and cls(None).extract('<tool_call>{"name": "f"}</tool_call>').tools_called
    with pytest.raises(ValueError, match=r"'not_a_class' .*is not a ToolParser"):
        get_tool_parser("not_a_class")
    with pytest.raises(ValueError, match=r"known: deepseek_v3, granite, hermes, kimi_k2, llama3_json, mistral, not_a_class, pythonic, qwen3_coder, xml"):
        get_tool_parser("nope")
