"""Splitting `<think>...</think>` output into reasoning and answer, whole or streamed.

The rules, shared by `ReasoningParser.extract` and `ReasoningStreamer`:

- A leading start marker is dropped and opens reasoning, whatever the prompt said.
- In reasoning, everything up to the first end marker is reasoning (kept verbatim); after it
  comes the content, with the whitespace run that follows the marker (Qwen3's "</think>\\n\\n")
  dropped. Without an end marker, all of it is reasoning: the thinking was cut short.
- Not in reasoning, everything is content, markers included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar


def partial_marker_len(text: str, marker: str | tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (or of one of several)."""
    markers = (marker,) if isinstance(marker, str) else marker
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ReasoningStreamer:
    """Incremental `extract`: feed deltas, get (reasoning_delta, content_delta) pairs.

    Holds back only what might still turn out to be a marker: a buffer that could be the start
    of a leading start marker, a partial end marker at the buffer's end, and whitespace right
    after the end marker (dropped if the answer follows).
    """

    def __init__(self, start_token: str, end_token: str, starts_in_reasoning: bool) -> None:
        self._start = start_token
        self._end = end_token
        self._default_reasoning = starts_in_reasoning
        self._state = "start"  # start -> reasoning -> after_end -> content, or start -> content
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """Take the next piece of decoded text; return what can be released now."""
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """End of output: release everything held back."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._state == "start":
            if self._buf.startswith(self._start):
                self._buf = self._buf[len(self._start) :]
                self._state = "reasoning"
            elif self._start.startswith(self._buf) and not final:
                return "", ""  # could still be the start marker
            else:
                self._state = "reasoning" if self._default_reasoning else "content"
        if self._state == "reasoning":
            end = self._buf.find(self._end)
            if end < 0:
                keep = 0 if final else partial_marker_len(self._buf, self._end)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                return reasoning, ""
            reasoning, self._buf = self._buf[:end], self._buf[end + len(self._end) :]
            self._state = "after_end"
        if self._state == "after_end":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return reasoning, ""
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content


class ReasoningParser:
    """A `<think>`-family reasoning format. Subclasses set `name` (the --reasoning-parser value)
    and, when their markers differ, `start_token` / `end_token`. (Formats whose markers are text,
    not single tokens, derive from `text_markers.TextMarkerReasoningParser`.)"""

    name: ClassVar[str]
    models: ClassVar[str] = ""  # the models that write this format, for --help
    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    # the markers' token ids, which structured output watches; None: the markers are not single tokens
    start_token_id: int | None
    end_token_id: int | None

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        ids = {}
        for token in (self.start_token, self.end_token):
            token_id = vocab.get(token)
            if token_id is None:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
                    raise ValueError(
                        f"--reasoning-parser {self.name} needs a tokenizer with {self.start_token!r} and "
                        f"{self.end_token!r} tokens; {token!r} is not a single token of this tokenizer"
                    )
            ids[token] = token_id
        self.start_token_id = ids[self.start_token]
        self.end_token_id = ids[self.end_token]

    def prompt_opens_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether generation starts inside a think block: the prompt's last start marker comes
        after its last end marker (a chat template that appends "<think>\\n")."""
        return self._last(prompt_token_ids, self.start_token_id) > self._last(prompt_token_ids, self.end_token_id)

    @staticmethod
    def _last(token_ids: Sequence[int], token_id: int | None) -> int:
        for i in range(len(token_ids) - 1, -1, -1):
            if token_ids[i] == token_id:
                return i
        return -1

    def extract(self, text: str, starts_in_reasoning: bool) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; an empty part is None."""
        in_reasoning = starts_in_reasoning
        if text.startswith(self.start_token):
            text, in_reasoning = text[len(self.start_token) :], True
        reasoning, content = "", text
        if in_reasoning:
            reasoning, found, content = text.partition(self.end_token)
            content = content.lstrip() if found else ""
        return reasoning or None, content or None

    def streamer(self, starts_in_reasoning: bool) -> ReasoningStreamer:
        """A streamer whose concatenated deltas equal `extract` of the concatenated text."""
        return ReasoningStreamer(self.start_token, self.end_token, starts_in_reasoning)
