"""The `granite` reasoning parser: Granite 3.2's "Here is my thought process:" / "Here is my
response:" phrases and Granite 3.3's `<think>` / `<response>` tags, which are text rather than
single tokens, split an output into reasoning and answer; streaming equals batch for every split.
Thinking is switched on by the template's `thinking` variable through `chat_template_kwargs`; and
Qwen3's `enable_thinking: false` (the template closes an empty think block in the prompt) leaves
an output that is all answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portside.chat_template import render_chat
from portside.reasoning import (
    REASONING_PARSERS,
    GraniteReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    TextMarkerReasoningParser,
    described,
    get_reasoning_parser,
)
from portside.server.protocol import ChatCompletionRequest
from portside.server.tools import template_messages

# Granite 3.2 with thinking=True, as its template asks: thoughts after "Here is my thought process:",
# the answer after "Here is my response:".
GRANITE_32 = (
    "Here is my thought process:\n"
    "1. The user wants the sum of the first 10 positive integers.\n"
    "2. Gauss's formula: n(n+1)/2 = 10 * 11 / 2 = 55.\n\n"
    "Here is my response:\n\n"
    "The sum of the first 10 positive integers is **55**."
)
GRANITE_32_HERES = "Here's my thought process:\nQuick check: 7 × 6 = 42.\nHere's my response:\n42"
# Granite 3.3: "Write your thoughts between <think></think> and write your response between <response></response>"
GRANITE_33 = "<think>The user greets me in Japanese; answer in kind.</think>\n<response>こんにちは！🙂</response>"
TRUNCATED = "Here is my thought process:\nFirst, factor 391 = 17 × 23, so"
PLAIN = "Here are three ideas: a walk, a book, a nap."

SAMPLES = [GRANITE_32, GRANITE_32_HERES, GRANITE_33, TRUNCATED, PLAIN, "", "  \n",
           "Here is my response: no thoughts first", "<think>unfinished", "<think>a</think><response>b</response> tail",
           "Here is my thought process: a Here is my response: b Here is my response: c"]  # fmt: skip


@pytest.fixture(scope="module")
def granite() -> ReasoningParser:
    return GraniteReasoningParser(None)


def stream(parser: ReasoningParser, pieces: list[str], starts_in_reasoning: bool = False) -> tuple[str, str]:
    streamer = parser.streamer(starts_in_reasoning)
    outs = [streamer.feed(p) for p in pieces] + [streamer.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# ---- whole outputs -----------------------------------------------------------------------------


def test_granite_32_thought_process_and_response(granite: ReasoningParser) -> None:
    assert granite.extract(GRANITE_32, False) == (
        "1. The user wants the sum of the first 10 positive integers.\n2. Gauss's formula: n(n+1)/2 = 10 * 11 / 2 = 55.",
        "The sum of the first 10 positive integers is **55**.",
    )
    assert granite.extract(GRANITE_32_HERES, False) == ("Quick check: 7 × 6 = 42.", "42")
    assert granite.extract("\n " + GRANITE_32_HERES.replace("'", "’"), False) == ("Quick check: 7 × 6 = 42.", "42")


def test_granite_33_tags(granite: ReasoningParser) -> None:
    assert granite.extract(GRANITE_33, False) == ("The user greets me in Japanese; answer in kind.", "こんにちは！🙂")
    # the closing tag is dropped only where it ends the output; text after it stays, and so does the tag
    assert granite.extract("<think>a</think><response>b</response> tail", False) == ("a", "b</response> tail")
    assert granite.extract("<think>a</think> b", False) == ("a", "b")
    # the two formats' markers do not mix
    assert granite.extract("<think>a Here is my response: b</think>c", False) == ("a Here is my response: b", "c")


def test_no_thinking_is_all_content(granite: ReasoningParser) -> None:
    assert granite.extract(PLAIN, False) == (None, PLAIN)
    assert granite.extract("Here is my response: no thoughts first", False) == (None, "Here is my response: no thoughts first")
    assert granite.extract("The answer. Here is my thought process: x", False) == (None, "The answer. Here is my thought process: x")
    assert granite.extract("", False) == (None, None)


def test_truncated_thinking_is_all_reasoning(granite: ReasoningParser) -> None:
    assert granite.extract(TRUNCATED, False) == ("First, factor 391 = 17 × 23, so", None)
    assert granite.extract(TRUNCATED + "\n\nHere is my resp", False) == ("First, factor 391 = 17 × 23, so\n\nHere is my resp", None)
    assert granite.extract("Here is my thought process:", False) == (None, None)


def test_only_the_first_response_marker_ends_reasoning(granite: ReasoningParser) -> None:
    text = "Here is my thought process: a Here is my response: b Here is my response: c"
    assert granite.extract(text, False) == ("a", "b Here is my response: c")


def test_starting_inside_reasoning(granite: ReasoningParser) -> None:
    assert granite.extract("\nstill thinking\nHere is my response: done", True) == ("still thinking", "done")
    assert granite.extract("thinking</think><response>x</response>", True) == ("thinking", "x")
    assert granite.extract("no end", True) == ("no end", None)


# ---- the prompt, tokens and structured output --------------------------------------------------


def test_text_markers_need_no_tokens_and_never_open_in_the_prompt(tmp_path: Path) -> None:
    from portside.testing.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path)  # no marker is a single token: fine for text markers
    parser = get_reasoning_parser("granite")(tok)
    assert isinstance(parser, TextMarkerReasoningParser)
    assert parser.start_token_id is None and parser.end_token_id is None  # structured output constrains all of it
    assert not parser.prompt_opens_reasoning(tok.encode("Here is my thought process:"))


GRANITE_LIKE_TEMPLATE = (
    "{%- if thinking %}{{ '<|start_of_role|>system<|end_of_role|>You are a helpful AI assistant. Respond to every user "
    "query in a comprehensive and detailed way. You can write down your thoughts and reasoning process before "
    "responding. Write your thoughts after \\'Here is my thought process:\\' and write your response after \\'Here is "
    "my response:\\' for each user query.<|end_of_text|>\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|start_of_role|>' + m['role'] + '<|end_of_role|>' + m['content'] + '<|end_of_text|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)  # Granite 3.2's thinking branch, cut down to what the parser depends on


def test_thinking_comes_from_chat_template_kwargs(tmp_path: Path, granite: ReasoningParser) -> None:
    from portside.testing.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path, chat_template=GRANITE_LIKE_TEMPLATE)
    body = {"model": "m", "messages": [{"role": "user", "content": "Sum 1..10?"}]}
    for thinking in (True, False):
        req = ChatCompletionRequest.model_validate(body | {"chat_template_kwargs": {"thinking": thinking}})
        text, ids = render_chat(tok, template_messages(req), template_kwargs=req.chat_template_kwargs)
        assert ("Write your thoughts after 'Here is my thought process:'" in text) is thinking
        assert not granite.prompt_opens_reasoning(ids)  # the model writes the markers itself
    assert granite.extract(GRANITE_32, False)[0] is not None  # thinking on: split
    assert granite.extract("The sum is 55.", False) == (None, "The sum is 55.")  # thinking off: all answer


def test_qwen3_enable_thinking_false_closes_the_think_block_in_the_prompt(tmp_path: Path) -> None:
    """Qwen3's template (HERMES_TOOLS_TEMPLATE does the same on this point) writes an empty
    `<think>\\n\\n</think>\\n\\n` into the prompt with enable_thinking false: the output is all answer,
    whole and streamed. With it true (the default), the model opens its own think block."""
    from portside.testing.tiny import HERMES_TOOLS_TEMPLATE, make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path, added_tokens=("<think>", "</think>"), chat_template=HERMES_TOOLS_TEMPLATE)
    qwen3 = Qwen3ReasoningParser(tok)
    body = {"model": "m", "messages": [{"role": "user", "content": "Capital of Peru?"}]}
    for kwargs, closed in (({"enable_thinking": False}, True), ({"enable_thinking": True}, False), (None, False)):
        req = ChatCompletionRequest.model_validate(body | ({"chat_template_kwargs": kwargs} if kwargs else {}))
        text, ids = render_chat(tok, template_messages(req), template_kwargs=req.chat_template_kwargs)
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") is closed
        assert not qwen3.prompt_opens_reasoning(ids)
    answer = "Lima is the capital of Peru."
    assert qwen3.extract(answer, starts_in_reasoning=False) == (None, answer)
    assert stream(qwen3, list(answer)) == ("", answer)
    thought = "<think>\nPeru's capital is Lima.\n</think>\n\n" + answer  # enable_thinking on: the model's own block
    assert qwen3.extract(thought, starts_in_reasoning=False) == ("\nPeru's capital is Lima.\n", answer)


# ---- streaming ---------------------------------------------------------------------------------


def test_partial_markers_held_back(granite: ReasoningParser) -> None:
    streamer = granite.streamer(False)
    assert streamer.feed("Here is my") == ("", "")  # could still be the start marker
    assert streamer.feed(" thought process:\n") == ("", "")
    assert streamer.feed("a + b.\n\nHere is my resp") == ("a + b.", "")  # the whitespace may come before the marker
    assert streamer.feed("onse:\n") == ("", "")
    assert streamer.feed("Done.") == ("", "Done.")
    assert streamer.finish() == ("", "")
    streamer = granite.streamer(False)
    assert streamer.feed("Here") == ("", "")
    assert streamer.feed(" are") == ("", "Here are")  # not a marker after all
    streamer = granite.streamer(False)
    assert streamer.feed("<think>x</think><response>y</resp") == ("x", "y")
    assert streamer.feed("onse>\n") == ("", "")
    assert streamer.finish() == ("", "")


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_equals_batch_every_two_way_split(granite: ReasoningParser, text: str, starts_in_reasoning: bool) -> None:
    reasoning, content = granite.extract(text, starts_in_reasoning)
    expected = (reasoning or "", content or "")
    assert stream(granite, list(text), starts_in_reasoning) == expected
    for i in range(len(text) + 1):
        assert stream(granite, [text[:i], text[i:]], starts_in_reasoning) == expected, i


_FRAGMENTS = st.sampled_from([
    "Here is my thought process:", "Here's my response:", "Here is my response:", "Here is my", "Here", "'s", " my ",
    "<think>", "</think>", "<response>", "</response>", "</resp", "<th", "\n", " ", "a", "é",
])  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(text=st.lists(_FRAGMENTS, max_size=12).map("".join), cuts=st.lists(st.integers(0, 120), max_size=8),
       starts_in_reasoning=st.booleans())  # fmt: skip
def test_streaming_equals_batch_any_split(text: str, cuts: list[int], starts_in_reasoning: bool) -> None:
    parser = GraniteReasoningParser(None)
    reasoning, content = parser.extract(text, starts_in_reasoning)
    assert stream(parser, split(text, cuts), starts_in_reasoning) == (reasoning or "", content or "")


# ---- registry ----------------------------------------------------------------------------------


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "granite"}
    assert get_reasoning_parser("granite") is GraniteReasoningParser
    assert "granite (Granite 3.2/3.3, thinking=True)" in described()


def test_text_marker_parser_for_a_third_party_format() -> None:
    from portside.reasoning import Markers

    class Plan(TextMarkerReasoningParser):
        name = "plan"
        formats = (Markers(("PLAN:",), ("ANSWER:",)),)

    parser: Any = Plan(None)
    assert parser.extract("PLAN: look it up\nANSWER: 4", False) == ("look it up", "4")


@pytest.mark.slow  # builds a tiny model and generates on the CPU
def test_structured_output_with_text_markers_constrains_from_the_first_token(tmp_path: Path) -> None:
    """With `--reasoning-parser granite` the engine has no marker token to wait for: a constraint
    holds from the first token, and the constrained answer comes back as content."""
    from portside import LLM, SamplingParams
    from portside.sampling_params import StructuredOutputsParams
    from portside.testing.tiny import make_tiny_model

    llm = LLM(str(make_tiny_model(tmp_path / "m", "llama")), device="cpu", max_model_len=128, reasoning_parser="granite")
    parser = llm.engine.reasoning_parser
    assert isinstance(parser, GraniteReasoningParser)
    params = SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["Here is my response:", "no"]))  # fmt: skip
    (out,) = llm.generate(["Here is my thought process:"], params, use_tqdm=False)
    for c in out.outputs:
        assert c.text in ("Here is my response:", "no")
        assert parser.extract(c.text, parser.prompt_opens_reasoning(out.prompt_token_ids)) == (None, c.text)
