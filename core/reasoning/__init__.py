"""Reasoning parsers: split a model's output into `reasoning_content` and `content`.

Built in: `deepseek_r1` and `qwen3` (the `<think>...</think>` family, see `base`). A third-party
package adds one by declaring an entry point in the ``portside.reasoning_parsers`` group that
names a `ReasoningParser` subclass; it is imported only when asked for by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from portside.named_plugins import load_named
from portside.reasoning.base import ReasoningParser, ReasoningStreamer

__all__ = [
    "ENTRY_POINT_GROUP",
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStreamer",
    "get_reasoning_parser",
]

ENTRY_POINT_GROUP = "portside.reasoning_parsers"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: they think first, and their template usually appends
    "<think>\\n", so the output often has only the closing marker."""

    name = "deepseek_r1"

    def prompt_opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Also True when the prompt has neither marker: an R1 model starts by thinking."""
        if self.start_token_id not in prompt_token_ids and self.end_token_id not in prompt_token_ids:
            return True
        return super().prompt_opens_reasoning(prompt_token_ids)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (and QwQ): "<think>\\n...\\n</think>\\n\\nanswer"; with enable_thinking=False the
    template closes an empty think block in the prompt, so the output is all content."""

    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class for `--reasoning-parser name`: built in, else from an entry point."""
    return load_named(ENTRY_POINT_GROUP, name, ReasoningParser, REASONING_PARSERS, "reasoning parser")
