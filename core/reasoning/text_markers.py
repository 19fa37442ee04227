"""Reasoning set apart by markers that are text, not single tokens (Granite's "Here is my thought
process:" ... "Here is my response:"), whole or streamed.

A format lists its `Markers`: alternative start phrases, alternative end phrases and, optionally,
tags that wrap the answer (Granite 3.3's `<response>...</response>`). The rules:

- The output opens reasoning when it starts (after whitespace) with a start marker, which is
  dropped and fixes the format's markers; else it is all content, markers included (or all
  reasoning up to an end marker, for an output that starts inside reasoning).
- Reasoning runs to the first end marker; the whitespace on both sides of the reasoning, and
  after the end marker, is dropped. Without an end marker, all of it is reasoning (verbatim from
  its first non-blank character): the thinking was cut short.
- After the end marker comes the content; a leading answer tag is dropped, and so is the
  closing tag (with the whitespace around it) when it ends the output.

`extract` is the streamer fed the whole text, and the streamer holds back only what may still
turn out to be a marker (or the whitespace before one), so streamed deltas add up to `extract`
for every split of the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from portside.reasoning.base import ReasoningParser, partial_marker_len


@dataclass(frozen=True)
class Markers:
    starts: tuple[str, ...]
    ends: tuple[str, ...]
    answer_open: str = ""
    answer_close: str = ""


class TextMarkerStreamer:
    """Incremental `TextMarkerReasoningParser.extract`: feed deltas, get (reasoning_delta,
    content_delta) pairs."""

    def __init__(self, formats: tuple[Markers, ...], starts_in_reasoning: bool) -> None:
        self._formats = formats
        self._default_reasoning = starts_in_reasoning
        self._state = "start"  # start -> after_start -> reasoning -> after_end -> content, or start -> content
        self._buf = ""
        self._format: Markers | None = None  # known from the start marker, or else the end marker
        self._opened = False  # the answer's opening tag was dropped: its closing one will be too

    def feed(self, delta: str) -> tuple[str, str]:
        """Take the next piece of decoded text; return what can be released now."""
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """End of output: release everything held back."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self._state == "start":
            rest = self._buf.lstrip()
            found = next(((f, m) for f in self._formats for m in f.starts if rest.startswith(m)), None)
            if found is not None:
                self._format, marker = found
                self._buf, self._state = rest[len(marker) :], "after_start"
            elif not final and any(m.startswith(rest) for f in self._formats for m in f.starts):
                return "", ""  # could still be a start marker
            else:
                self._state = "after_start" if self._default_reasoning else "content"
        if self._state == "after_start":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return "", ""
            self._state = "reasoning"
        if self._state == "reasoning":
            ends = self._format.ends if self._format is not None else tuple(m for f in self._formats for m in f.ends)
            found_end = min(((i, m) for m in ends if (i := self._buf.find(m)) >= 0), default=None)
            if found_end is None:
                cut = len(self._buf)
                if not final:  # hold back a partial end marker and the whitespace before it
                    cut = len(self._buf[: cut - partial_marker_len(self._buf, ends)].rstrip())
                reasoning, self._buf = self._buf[:cut], self._buf[cut:]
                return reasoning, ""
            i, marker = found_end
            if self._format is None:
                self._format = next(f for f in self._formats if marker in f.ends)
            reasoning, self._buf, self._state = self._buf[:i].rstrip(), self._buf[i + len(marker) :], "after_end"
        if self._state == "after_end":
            assert self._format is not None
            tag = self._format.answer_open
            self._buf = self._buf.lstrip()
            if tag and not self._opened and self._buf.startswith(tag):
                self._buf, self._opened = self._buf[len(tag) :].lstrip(), True
            undecided = not self._buf or (tag and not self._opened and tag.startswith(self._buf))
            if undecided and not final:
                return reasoning, ""
            self._state = "content"
        close = self._format.answer_close if self._opened and self._format is not None else ""
        if final:
            content = self._buf
            if close and content.rstrip().endswith(close):
                content = content.rstrip()[: -len(close)].rstrip()
            self._buf = ""
            return reasoning, content
        cut = _tail_start(self._buf, close) if close else len(self._buf)
        content, self._buf = self._buf[:cut], self._buf[cut:]
        return reasoning, content


def _tail_start(text: str, close: str) -> int:
    """Where the end of `text` that may still be the answer's closing tag begins: the whitespace
    before a whole or partial `close`, and after a whole one."""
    end = len(text.rstrip())
    if text[:end].endswith(close):
        start = end - len(close)
    elif end == len(text):
        start = end - partial_marker_len(text, close)
    else:
        start = end
    return len(text[:start].rstrip())


class TextMarkerReasoningParser(ReasoningParser):
    """A reasoning format with text markers. Subclasses set `name` and `formats`. The prompt
    never opens reasoning here (the markers are not tokens to look for), and structured output
    constrains the whole output (`start_token_id` / `end_token_id` are None)."""

    formats: ClassVar[tuple[Markers, ...]]

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.start_token_id = self.end_token_id = None

    def extract(self, text: str, starts_in_reasoning: bool) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; an empty part is None."""
        streamer = self.streamer(starts_in_reasoning)
        (r1, c1), (r2, c2) = streamer.feed(text), streamer.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def streamer(self, starts_in_reasoning: bool) -> TextMarkerStreamer:  # type: ignore[override]
        return TextMarkerStreamer(self.formats, starts_in_reasoning)
