"""A harmony model's output tokens as OpenAI's chat fields, through openai_harmony's
`StreamableParser`, whole or token by token:

- the analysis channel is `reasoning_content`;
- the final channel (and commentary without a recipient: harmony's preambles) is `content`;
- a message to ``functions.NAME`` (commentary channel) is a tool call, its text the arguments.

The parser starts after the prompt's ``<|start|>assistant`` and first reads the prompt's prefill
(a forced channel or call header, `portside.server.harmony_plan`), so an output that begins inside
a message is read as that message. A message cut off by the end of the output counts as complete
(``max_tokens``, or a grammar that ended it); so does a next message's header cut off before its
text (it is dropped). Other tokens that are not harmony (text where a header belongs, a token the
parser refuses) come back as content, decoded, so no text the model wrote is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from portside.server.tools import new_call_id

FUNCTIONS = "functions."


@dataclass
class HarmonyParse:
    """A whole output: what `HarmonyStream` streamed, put together."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]


@dataclass
class HarmonyStream:
    """One choice's output: `feed(token_ids)` and `finish()` return OpenAI `delta` dicts
    ({"reasoning_content"}, {"content"} or {"tool_calls": [...]}) in order."""

    encoding: Any
    prefill: list[int] = field(default_factory=list)
    calls_allowed: bool = True  # tool_choice "none": messages to functions come back as content
    parallel: bool = True  # parallel_tool_calls: False keeps only the first call
    num_calls: int = 0
    _kind: str | None = None  # of the open message: "reasoning", "content", "call" or "dropped"
    _pending: list[int] = field(default_factory=list)  # tokens of a header not yet read into a message
    _raw: list[int] | None = None  # not harmony: every token from here on is content, decoded at the end
    _out: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        from openai_harmony import Role, StreamableParser

        self._parser = StreamableParser(self.encoding, role=Role.ASSISTANT, strict=False)
        self._start = self.encoding.encode("<|start|>", allowed_special="all")[0]
        self._out = self.feed(self.prefill, prefill=True)  # a forced call's header: the first feed sends it

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, token_ids: list[int] | tuple[int, ...], prefill: bool = False) -> list[dict[str, Any]]:
        from openai_harmony import StreamState

        for t in token_ids:
            if self._raw is not None:
                self._raw.append(t)
                continue
            try:
                self._parser.process(t)
            except Exception:  # openai_harmony.HarmonyError: not harmony any more
                self._raw = self._pending + [t]
                self._close()
                continue
            if self._parser.state != StreamState.CONTENT:
                if self._kind is not None:
                    self._close()
                if not prefill:
                    self._pending.append(t)
                if self._parser.state == StreamState.EXPECT_START:
                    self._pending = []  # the end of a message, not text
                continue
            if self._kind is None:
                self._open()
            self._pending = []
            delta = self._parser.last_content_delta
            if delta and not prefill:
                self._emit(delta)
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """End of output: a header never completed (or tokens past a parse error) is content."""
        leftover = self._raw if self._raw is not None else self._pending
        if self._raw is None and leftover[:1] == [self._start]:
            leftover = []  # the header of a next message, cut off: no text of it was written yet
        if leftover:
            text = self.encoding.decode(leftover)
            if text:
                self._add("content", text)
        self._raw, self._pending = None, []
        return self._take()

    def parse_all(self, token_ids: list[int] | tuple[int, ...]) -> HarmonyParse:
        """A whole output (a fresh stream's `feed` then `finish`), put together."""
        reasoning, content, calls = "", "", []
        for d in self.feed(token_ids) + self.finish():
            reasoning += d.get("reasoning_content", "")
            content += d.get("content", "")
            for c in d.get("tool_calls", ()):
                if "id" in c:
                    calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
                else:
                    calls[-1]["function"]["arguments"] += c["function"]["arguments"]
        return HarmonyParse(reasoning or None, content or None, calls)

    def _open(self) -> None:
        """The parser entered a message's content: what it is, from its header."""
        recipient = self._parser.current_recipient or ""
        channel = self._parser.current_channel
        if recipient.startswith(FUNCTIONS) and self.calls_allowed:
            if self.num_calls and not self.parallel:
                self._kind = "dropped"
                return
            self._kind = "call"
            self._out.append({"tool_calls": [{"index": self.num_calls, "id": new_call_id(), "type": "function",
                                              "function": {"name": recipient[len(FUNCTIONS):], "arguments": ""}}]})
            self.num_calls += 1
        elif channel == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _close(self) -> None:
        self._kind = None

    def _emit(self, text: str) -> None:
        kind = self._kind
        if kind == "reasoning":
            self._add("reasoning_content", text)
        elif kind == "content":
            self._add("content", text)
        elif kind == "call":
            last = self._out[-1] if self._out else None
            calls = last.get("tool_calls") if last else None
            if calls and calls[-1]["index"] == self.num_calls - 1 and "id" not in calls[-1]:
                calls[-1]["function"]["arguments"] += text
            else:
                self._out.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": text}}]})

    def _add(self, key: str, text: str) -> None:
        if self._out and set(self._out[-1]) == {key}:
            self._out[-1][key] += text
        else:
            self._out.append({key: text})

    def _take(self) -> list[dict[str, Any]]:
        out, self._out = self._out, []
        return out
