"""The `deepseek_v3` tool parser: DeepSeek-V3's call section (and V3.1's shorter blocks) gives the
calls and the text around them; malformed blocks come back as content; streaming equals batch for
every split and token by token through a tokenizer whose markers are added tokens; with the
`deepseek_r1` reasoning parser, an R1-0528 output splits into reasoning, content and calls."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portside.reasoning import DeepSeekR1ReasoningParser
from portside.tool_parsers import TOOL_PARSERS, DeepSeekV3ToolParser, get_tool_parser
from portside.tool_parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)


def v3_block(name: str, args: str, kind: str = "function") -> str:
    return f"{CALL_BEGIN}{kind}{SEP}{name}\n```json\n{args}\n```{CALL_END}"


TWO_CALLS = (
    "I'll check both."
    + CALLS_BEGIN
    + v3_block("get_weather", '{"city": "Zürich", "days": [1, 2]}')
    + "\n"
    + v3_block("get_time", "{}")
    + CALLS_END
)
V31 = f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "東京"}}{CALL_END}{CALLS_END}'
SAMPLES = [
    TWO_CALLS,
    V31,
    "Just an answer, no tools.",
    CALLS_BEGIN + v3_block("get_weather", '{"city": ') + CALLS_END,  # arguments not JSON
    CALLS_BEGIN + v3_block("get_weather", '{"city": "Oslo"}'),  # section never closed: the call stands
    "text " + CALLS_BEGIN + "not a block" + CALLS_END + " tail",
    CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_weather\n```json\n{}",  # cut off inside a block
]


@pytest.fixture(scope="module")
def parser() -> DeepSeekV3ToolParser:
    return DeepSeekV3ToolParser(None)


def calls(parser: DeepSeekV3ToolParser, text: str) -> tuple[list[tuple[str, Any]], str | None]:
    out = parser.extract(text)
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls], out.content


def streamed(parser: DeepSeekV3ToolParser, pieces: list[str]) -> tuple[list[tuple[str, str]], str | None]:
    s = parser.streamer()
    events = [e for p in pieces for e in s.feed(p)] + s.finish()
    for e in events:
        assert (e.content is None) != (e.call is None), e
    assert [e.index for e in events if e.call] == list(range(sum(1 for e in events if e.call)))
    content = "".join(e.content for e in events if e.content)
    return [(e.call.name, e.call.arguments) for e in events if e.call], content or None


def batch(parser: DeepSeekV3ToolParser, text: str) -> tuple[list[tuple[str, str]], str | None]:
    out = parser.extract(text)
    return [(c.name, c.arguments) for c in out.tool_calls], out.content


def test_two_calls_with_text(parser: DeepSeekV3ToolParser) -> None:
    assert calls(parser, TWO_CALLS) == ([("get_weather", {"city": "Zürich", "days": [1, 2]}), ("get_time", {})], "I'll check both.")
    out = parser.extract(TWO_CALLS)
    assert all(c.id.startswith("call_") for c in out.tool_calls) and out.tools_called


def test_v31_blocks(parser: DeepSeekV3ToolParser) -> None:
    assert calls(parser, V31) == ([("get_weather", {"city": "東京"})], None)


def test_no_calls_is_content(parser: DeepSeekV3ToolParser) -> None:
    assert calls(parser, "Just an answer, no tools.") == ([], "Just an answer, no tools.")


@pytest.mark.parametrize("block", [
    v3_block("get_weather", '{"city": '),  # arguments cut
    v3_block("get_weather", '["Paris"]'),  # not an object
    v3_block("", "{}"),  # no name
    f"{CALL_BEGIN}function get_weather\n```json\n{{}}\n```{CALL_END}",  # no separator
    f"{CALL_BEGIN}function{SEP}get_weather\n{{}}{CALL_END}",  # no fence
])  # fmt: skip
def test_malformed_block_is_content(parser: DeepSeekV3ToolParser, block: str) -> None:
    good = v3_block("get_time", '{"tz": "UTC"}')
    got, content = calls(parser, CALLS_BEGIN + block + good + CALLS_END)
    assert got == [("get_time", {"tz": "UTC"})]
    assert content == CALLS_BEGIN + block


def test_unclosed_section_and_text_after(parser: DeepSeekV3ToolParser) -> None:
    assert calls(parser, CALLS_BEGIN + v3_block("f", '{"a": 1}')) == ([("f", {"a": 1})], None)
    assert calls(parser, "a" + CALLS_BEGIN + v3_block("f", "{}") + CALLS_END + " after") == ([("f", {})], "a after")
    cut = CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "f\n```json\n{}"
    assert calls(parser, cut) == ([], cut)
    assert calls(parser, "x" + CALLS_BEGIN + "prose" + CALLS_END) == ([], "x" + CALLS_BEGIN + "prose" + CALLS_END)


@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_equals_batch_every_two_way_split(parser: DeepSeekV3ToolParser, text: str) -> None:
    expected = batch(parser, text)
    assert streamed(parser, list(text)) == expected
    for i in range(len(text) + 1):
        assert streamed(parser, [text[:i], text[i:]]) == expected, i


_FRAGMENTS = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, "function", "get_weather", "\n", "```json", "```",
              '{"a": 1}', "{", "}", " ", "hi", "<｜", "｜>"]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(_FRAGMENTS), max_size=10).map("".join), data=st.data())
def test_streaming_equals_batch_any_split(text: str, data: st.DataObject) -> None:
    parser = DeepSeekV3ToolParser(None)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=24))
    bounds = [0, *sorted(set(cuts)), len(text)]
    assert streamed(parser, [text[a:b] for a, b in zip(bounds, bounds[1:])]) == batch(parser, text)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny BPE with DeepSeek's markers and R1's think tags as added tokens, as DeepSeek's
    tokenizers have them."""
    from portside.testing.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.add_tokens(["<think>", "</think>", *MARKERS])
    return tok


def test_streaming_token_by_token(parser: DeepSeekV3ToolParser, tokenizer: Any) -> None:
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        pieces, done = [], ""
        for k in range(1, len(ids) + 1):
            so_far = tokenizer.decode(ids[:k], skip_special_tokens=not parser.needs_special_tokens)
            if not so_far.endswith("\ufffd"):
                pieces.append(so_far[len(done) :])
                done = so_far
        assert done == text
        assert streamed(parser, pieces) == batch(parser, text)


def test_r1_reasoning_then_calls(tokenizer: Any) -> None:
    """DeepSeek-R1-0528: its template opens the think block, the output closes it, then answers
    with text and a call section."""
    r1 = DeepSeekR1ReasoningParser(tokenizer)
    prompt = tokenizer.encode("<｜User｜>Weather?<｜Assistant｜><think>\n")
    assert r1.prompt_opens_reasoning(prompt)
    output = "The user wants the weather.\n</think>\n\nChecking." + CALLS_BEGIN + v3_block("get_weather", '{"city": "Paris"}') + CALLS_END
    reasoning, content = r1.extract(output, True)
    assert reasoning == "The user wants the weather.\n"
    out = DeepSeekV3ToolParser(tokenizer).extract(content or "")
    assert out.content == "Checking." and [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    r_stream = r1.streamer(True)
    pieces = [r_stream.feed(output[i : i + 3]) for i in range(0, len(output), 3)] + [r_stream.finish()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (reasoning, content)


def test_registered() -> None:
    assert TOOL_PARSERS["deepseek_v3"] is DeepSeekV3ToolParser
    assert get_tool_parser("deepseek_v3") is DeepSeekV3ToolParser
