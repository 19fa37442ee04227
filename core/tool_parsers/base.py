"""What every tool-call format shares: the call types, the streamer loop and JSON helpers.

A format is written once, as a `ToolCallStreamer` subclass that consumes its buffer step by
step; `ToolParser.extract` is that streamer fed the whole text at once, so batch and streamed
results agree by construction wherever the streamer's decisions do not depend on how the text
was split (which the tests check for every split).

Rules for every format: a call is emitted only once its text is complete and valid (a JSON
object with a string "name" and an object of arguments); anything else comes back unchanged
as content. Content that is whitespace only, in total, is dropped (content is then None).
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and 24 random lowercase hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text; "{}" when the model gave none
    id: str = field(default_factory=new_call_id)


@dataclass
class ExtractedToolCalls:
    tool_calls: list[ToolCall]
    content: str | None  # the text outside the calls; None when empty or whitespace only

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolCallDelta:
    """One streamed event: either plain text, or one complete tool call and its index."""

    content: str | None = None
    index: int | None = None
    call: ToolCall | None = None


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def arguments_json(obj: dict[str, Any], keys: tuple[str, ...] = ("arguments", "parameters")) -> str | None:
    """The arguments of a decoded call object as JSON text ("{}" when absent), or None when
    the value under the first present key of `keys` is not an object."""
    key = next((k for k in keys if k in obj), None)
    args = {} if key is None else obj[key]
    if not isinstance(args, dict):
        return None
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None


def call_from_object(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded `{"name": ..., "arguments": {...}}`, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = arguments_json(obj, keys)
    return None if args is None else (obj["name"], args)


def is_json_value(value: Any) -> bool:
    """Whether a Python value is made of JSON's types only (finite numbers, string keys, lists not
    tuples): what a call's arguments decoded from a model's own literal syntax may hold."""
    if value is None or isinstance(value, str | bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(is_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_value(v) for k, v in value.items())
    return False


def loads(text: str) -> Any:
    """`json.loads`, with None for anything that does not parse, nests too deep, or holds a
    number JSON cannot write back (NaN, Infinity, 1e999)."""
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except (ValueError, RecursionError):
        return None


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a double")
    return value


class JsonEnd:
    """Finds where the JSON object or array opening at `text[start]` closes, resuming where the
    last call stopped (the text may only grow in between). Brackets are counted outside strings
    only; whether the span is valid JSON is for `json.loads` to say."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def find(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while the value is still open."""
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i + 1
                    return i + 1
        self._pos = len(text)
        return None


class ToolCallStreamer:
    """Streams one output: `feed(delta)` and then `finish()`, each returning the events that
    are ready. Subclasses implement `_step`, which consumes the front of `self._buf`."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._buf = ""
        self._events: list[ToolCallDelta] = []
        self._num_calls = 0
        self._blank: str | None = ""  # leading whitespace-only content, held until real text follows

    def feed(self, delta: str) -> list[ToolCallDelta]:
        self._buf += delta
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> list[ToolCallDelta]:
        """End of output: flush what is left (an unfinished call comes back as content)."""
        while self._step(final=True):
            pass
        if self._buf:
            self._content(self._buf)
            self._buf = ""
        return self._take()

    def _step(self, final: bool) -> bool:
        """Consume what can be decided at the front of `self._buf`; return whether to go on.
        With `final`, nothing more will arrive: decide everything."""
        raise NotImplementedError

    def _up_to(self, marker: str | tuple[str, ...], final: bool) -> bool:
        """Outside a call: pass on the content before `marker` (or the earliest of several),
        holding back what may be the start of one unless `final`; True when the buffer now
        starts with a marker."""
        markers = (marker,) if isinstance(marker, str) else marker
        buf = self._buf
        found = [i for i in (buf.find(m) for m in markers) if i >= 0]
        if not found:
            keep = 0 if final else partial_marker_len(buf, markers)
            self._content(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        start = min(found)
        self._content(buf[:start])
        self._buf = buf[start:]
        return True

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._blank is not None:
            self._blank += text
            if self._blank.isspace():
                return
            text, self._blank = self._blank, None
        if self._events and self._events[-1].call is None:
            self._events[-1].content = (self._events[-1].content or "") + text
        else:
            self._events.append(ToolCallDelta(content=text))

    def _call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        call = ToolCall(name, arguments, call_id or self._parser.new_id())
        self._events.append(ToolCallDelta(index=self._num_calls, call=call))
        self._num_calls += 1

    def _take(self) -> list[ToolCallDelta]:
        events, self._events = self._events, []
        return events


class ToolParser:
    """A model's own tool-call format. Subclasses set `name` (the --tool-call-parser value) and
    implement `streamer`; `extract` comes for free.

    `tools` is the request's tools in OpenAI's shape (`{"type": "function", "function": {"name",
    "parameters", ...}}`), set by the server after construction (None: not known). Formats that
    write arguments as text (qwen3_coder) read the parameter types from it."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False  # True: decode with skip_special_tokens=False
    models: ClassVar[str] = ""  # the models that write this format, for --help
    tools: list[dict[str, Any]] | None = None

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def new_id(self) -> str:
        return new_call_id()

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output, and the text around them."""
        streamer = self.streamer()
        events = streamer.feed(text) + streamer.finish()
        content = "".join(e.content for e in events if e.content)
        return ExtractedToolCalls([e.call for e in events if e.call is not None], content or None)

    def streamer(self) -> ToolCallStreamer:
        raise NotImplementedError
