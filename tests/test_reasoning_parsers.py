"""Reasoning parsers: recorded-style Qwen3 and DeepSeek-R1 outputs split into reasoning and
answer, the prompt decides where generation starts, streaming equals batch for every split of
the text, and the registry finds built-in and entry-point parsers."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portside.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    get_reasoning_parser,
)

QWEN3_THINKING = (
    "<think>\nOkay, the user wants the capital of Australia. Many people guess Sydney, but the "
    "capital is Canberra. I'll answer briefly and mention the common mix-up.\n</think>\n\n"
    "The capital of Australia is **Canberra** (not Sydney, its largest city)."
)
# R1's template appends "<think>\n" to the prompt, so the output has only the closing marker.
R1_NO_OPENING_TAG = (
    "Let me compare 9.11 and 9.9. Write them with two decimals: 9.11 and 9.90. "
    "Since 90 > 11, 9.9 is larger.\n</think>\n\n**9.9** is larger than 9.11."
)
TRUNCATED = "<think>\nThe user asks for a proof. First, assume √2 = p/q in lowest terms, then p² = 2q², so p is"
UNICODE = "<think>\n用户问的是“你好”的意思。🙂\n</think>\n\n“你好”的意思是 hello。"

SAMPLES = [QWEN3_THINKING, R1_NO_OPENING_TAG, TRUNCATED, UNICODE, "Just an answer.", "", "<think></think>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The project's tiny BPE with Qwen3's think markers added as single tokens."""
    from portside.testing.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.add_tokens(["<think>", "</think>"])
    return tok


@pytest.fixture(scope="module")
def qwen3(tokenizer: Any) -> ReasoningParser:
    return Qwen3ReasoningParser(tokenizer)


@pytest.fixture(scope="module")
def r1(tokenizer: Any) -> ReasoningParser:
    return DeepSeekR1ReasoningParser(tokenizer)


def stream(parser: ReasoningParser, pieces: list[str], starts_in_reasoning: bool) -> tuple[str, str]:
    streamer = parser.streamer(starts_in_reasoning)
    outs = [streamer.feed(p) for p in pieces] + [streamer.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# ---- token ids and the prompt ------------------------------------------------------------------


def test_marker_ids_resolved(tokenizer: Any, qwen3: ReasoningParser) -> None:
    assert qwen3.start_token_id == tokenizer.convert_tokens_to_ids("<think>")
    assert qwen3.end_token_id == tokenizer.convert_tokens_to_ids("</think>")
    assert tokenizer.encode("<think>") == [qwen3.start_token_id]


def test_tokenizer_without_markers_is_refused(tmp_path: Path) -> None:
    from portside.testing.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path)
    tok.add_tokens(["<think>"])
    with pytest.raises(ValueError, match=r"--reasoning-parser qwen3 needs .*'<think>' and '</think>'.*'</think>'"):
        Qwen3ReasoningParser(tok)


def test_prompt_opens_reasoning(tokenizer: Any, qwen3: ReasoningParser, r1: ReasoningParser) -> None:
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text)

    thinking = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    no_think = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    plain = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    history = "<|im_start|>assistant\n<think>\nx\n</think>\n\nHello<|im_end|>\n<|im_start|>assistant\n"
    for parser in (qwen3, r1):
        assert parser.prompt_opens_reasoning(ids(thinking))
        assert not parser.prompt_opens_reasoning(ids(no_think))
        assert not parser.prompt_opens_reasoning(ids(history))
        assert parser.prompt_opens_reasoning(ids(history + "<think>\n"))
    assert not qwen3.prompt_opens_reasoning(ids(plain))
    assert r1.prompt_opens_reasoning(ids(plain))  # R1 models think first
    assert r1.prompt_opens_reasoning([])


# ---- whole outputs -----------------------------------------------------------------------------


def test_qwen3_thinking_then_answer(qwen3: ReasoningParser) -> None:
    reasoning, content = qwen3.extract(QWEN3_THINKING, starts_in_reasoning=False)
    assert reasoning is not None and reasoning.startswith("\nOkay, the user") and reasoning.endswith("mix-up.\n")
    assert content == "The capital of Australia is **Canberra** (not Sydney, its largest city)."


def test_r1_without_opening_tag(r1: ReasoningParser) -> None:
    reasoning, content = r1.extract(R1_NO_OPENING_TAG, starts_in_reasoning=True)
    assert reasoning == R1_NO_OPENING_TAG.split("</think>")[0]
    assert content == "**9.9** is larger than 9.11."
    # Started outside reasoning, the same text is all answer.
    assert r1.extract(R1_NO_OPENING_TAG, starts_in_reasoning=False) == (None, R1_NO_OPENING_TAG)


def test_opening_tag_in_output_and_prompt(r1: ReasoningParser) -> None:
    # Older R1 templates do not append <think>: the model writes it, after the prompt said "thinking".
    assert r1.extract("<think>\nhmm\n</think>\n\nYes.", True) == ("\nhmm\n", "Yes.")
    assert r1.extract("<think>\nhmm\n</think>\n\nYes.", False) == ("\nhmm\n", "Yes.")


def test_truncated_thinking_is_all_reasoning(qwen3: ReasoningParser) -> None:
    assert qwen3.extract(TRUNCATED, False) == (TRUNCATED.removeprefix("<think>"), None)
    assert qwen3.extract("still thinking", True) == ("still thinking", None)


def test_no_markers_is_all_content(qwen3: ReasoningParser) -> None:
    assert qwen3.extract("The answer is 4.", False) == (None, "The answer is 4.")
    # An end marker outside reasoning is just text.
    assert qwen3.extract("a </think> b", False) == (None, "a </think> b")


def test_empty_parts_are_none(qwen3: ReasoningParser) -> None:
    assert qwen3.extract("", False) == (None, None)
    assert qwen3.extract("", True) == (None, None)
    assert qwen3.extract("<think></think>\n\n", False) == (None, None)
    assert qwen3.extract("</think>\n\nHi", True) == (None, "Hi")


def test_unicode(qwen3: ReasoningParser) -> None:
    assert qwen3.extract(UNICODE, False) == ("\n用户问的是“你好”的意思。🙂\n", "“你好”的意思是 hello。")


# ---- streaming ---------------------------------------------------------------------------------


def test_partial_marker_held_back(qwen3: ReasoningParser) -> None:
    streamer = qwen3.streamer(starts_in_reasoning=True)
    assert streamer.feed("so 2+2=4.\n</thi") == ("so 2+2=4.\n", "")
    assert streamer.feed("nk>\n") == ("", "")  # the whitespace after the marker is dropped
    assert streamer.feed("\nIt is 4.") == ("", "It is 4.")
    assert streamer.finish() == ("", "")


def test_false_partial_marker_is_released(qwen3: ReasoningParser) -> None:
    streamer = qwen3.streamer(starts_in_reasoning=False)
    assert streamer.feed("<th") == ("", "")  # might be the opening marker
    assert streamer.feed("e end>") == ("", "<the end>")
    streamer = qwen3.streamer(starts_in_reasoning=True)
    assert streamer.feed("x </th") == ("x ", "")
    assert streamer.finish() == ("</th", "")  # truncated: what was held is reasoning


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_equals_batch_every_two_way_split(
    qwen3: ReasoningParser, text: str, starts_in_reasoning: bool
) -> None:
    reasoning, content = qwen3.extract(text, starts_in_reasoning)
    expected = (reasoning or "", content or "")
    assert stream(qwen3, list(text), starts_in_reasoning) == expected
    for i in range(len(text) + 1):
        assert stream(qwen3, [text[:i], text[i:]], starts_in_reasoning) == expected, i


_FRAGMENTS = st.sampled_from(["<think>", "</think>", "<th", "</thi", "<", ">", "/", "\n", "\n\n", " ", "a", "é", "k>"])


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(_FRAGMENTS, max_size=12).map("".join),
    cuts=st.lists(st.integers(0, 80), max_size=8),
    starts_in_reasoning=st.booleans(),
)
def test_streaming_equals_batch_any_split(text: str, cuts: list[int], starts_in_reasoning: bool) -> None:
    parser = object.__new__(DeepSeekR1ReasoningParser)  # extract and streamer need no tokenizer
    reasoning, content = parser.extract(text, starts_in_reasoning)
    assert stream(parser, split(text, cuts), starts_in_reasoning) == (reasoning or "", content or "")


# ---- registry ----------------------------------------------------------------------------------


def test_builtin_parsers() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "granite", "qwen3"}
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser


def test_unknown_parser_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'nope'; known: deepseek_r1, granite, qwen3"):
        get_reasoning_parser("nope")


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake installed package declaring three entry points in portside.reasoning_parsers."""
    from stevedore import ExtensionManager

    (tmp_path / "fake_reasoning.py").write_text(
        textwrap.dedent(
            """
            from portside.reasoning import ReasoningParser

            class StepParser(ReasoningParser):
                name = "step"
                start_token, end_token = "<step>", "</step>"

            NOT_A_PARSER = 42
            """
        )
    )
    dist = tmp_path / "fake_reasoning-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-reasoning\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[portside.reasoning_parsers]\n"
        "step = fake_reasoning:StepParser\n"
        "number = fake_reasoning:NOT_A_PARSER\n"
        "broken = fake_reasoning_missing:Parser\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})


def test_third_party_parser_from_entry_point(third_party: None) -> None:
    cls = get_reasoning_parser("step")
    assert cls.__name__ == "StepParser" and issubclass(cls, ReasoningParser)
    parser = object.__new__(cls)
    assert parser.extract("<step>plan</step> go", False) == ("plan", "go")
    with pytest.raises(ValueError, match=r"'number' .*is not a ReasoningParser"):
        get_reasoning_parser("number")
    with pytest.raises(ValueError, match=r"'broken' failed to load: broken .*ModuleNotFoundError"):
        get_reasoning_parser("broken")
    with pytest.raises(ValueError, match=r"known: broken, deepseek_r1, granite, number, qwen3, step"):
        get_reasoning_parser("nope")
