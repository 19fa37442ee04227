"""Reasoning parsers: split a model's output into `reasoning_content` and `content`.

Built in: `deepseek_r1` and `qwen3` (the `<think>...</think>` family, see `base`), and `granite`
(text markers, see `text_markers`). A third-party package adds one by declaring an entry point in
the ``portside.reasoning_parsers`` group that names a `ReasoningParser` subclass; it is imported
only when asked for by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from portside.named_plugins import load_named
from portside.reasoning.base import ReasoningParser, ReasoningStreamer
from portside.reasoning.text_markers import Markers, TextMarkerReasoningParser, TextMarkerStreamer

__all__ = [
    "ENTRY_POINT_GROUP",
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "GraniteReasoningParser",
    "Markers",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStreamer",
    "TextMarkerReasoningParser",
    "TextMarkerStreamer",
    "described",
    "get_reasoning_parser",
]

ENTRY_POINT_GROUP = "portside.reasoning_parsers"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: they think first, and their template usually appends
    "<think>\\n", so the output often has only the closing marker."""

    name = "deepseek_r1"
    models = "DeepSeek-R1"

    def prompt_opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Also True when the prompt has neither marker: an R1 model starts by thinking."""
        if self.start_token_id not in prompt_token_ids and self.end_token_id not in prompt_token_ids:
            return True
        return super().prompt_opens_reasoning(prompt_token_ids)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (and QwQ): "<think>\\n...\\n</think>\\n\\nanswer"; with enable_thinking=False the
    template closes an empty think block in the prompt, so the output is all content."""

    name = "qwen3"
    models = "Qwen3, QwQ"


class GraniteReasoningParser(TextMarkerReasoningParser):
    """Granite 3.2 / 3.3 with `thinking=True` in chat_template_kwargs (their templates then ask for
    thoughts and a response in these forms); without it the output is all content. Granite 3.2:
    "Here is my thought process:\n...\n\nHere is my response:\n..." ("Here's" also seen from
    quantized models); Granite 3.3: "<think>...</think>\n<response>...</response>"."""

    name = "granite"
    models = "Granite 3.2/3.3, thinking=True"
    formats = (
        Markers(("Here is my thought process:", "Here's my thought process:", "Here’s my thought process:"),
                ("Here is my response:", "Here's my response:", "Here’s my response:")),
        Markers(("<think>",), ("</think>",), "<response>", "</response>"),
    )  # fmt: skip


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GraniteReasoningParser)
}


def described() -> str:
    """The built-in names, each with the models that write its format (for --help)."""
    return ", ".join(f"{name} ({cls.models})" if cls.models else name for name, cls in REASONING_PARSERS.items())


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class for `--reasoning-parser name`: built in, else from an entry point."""
    return load_named(ENTRY_POINT_GROUP, name, ReasoningParser, REASONING_PARSERS, "reasoning parser")
