"""Granite 3.x format: a JSON array of call objects after a tool-call marker.

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Granite 3.1 to 3.3 write the `<|tool_call|>` special token (their chat template renders past
calls as `<|tool_call|>` and the calls' JSON, indented); Granite 3.0 writes the text
`<tool_call>`. A single call object after the marker is read too. Every element must be a call
(a string "name", and an "arguments" object or none), else the group, marker included, is content; text
before, between and after groups is content. A group's calls are emitted when its JSON closes.
"""

from __future__ import annotations

from portside.tool_parsers.base import JsonEnd, ToolCallStreamer, ToolParser, call_from_object, loads

MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteStreamer(ToolCallStreamer):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._in_group = False  # when True, the buffer starts with a marker
        self._json: JsonEnd | None = None  # the group's JSON, once it opens

    def _step(self, final: bool) -> bool:
        if not self._in_group:
            self._in_group = self._up_to(MARKERS, final)
            return self._in_group
        buf = self._buf
        if self._json is None:
            marker = next(m for m in MARKERS if buf.startswith(m))
            start = len(buf) - len(buf[len(marker) :].lstrip())
            if start == len(buf):
                return self._fail(len(buf)) if final else False
            if buf[start] not in "[{":
                return self._fail(start)
            self._json = JsonEnd(start)
        end = self._json.find(buf)
        if end is None:
            return self._fail(len(buf)) if final else False
        value = loads(buf[self._json.start : end])
        found = [call_from_object(v) for v in (value if isinstance(value, list) else [value])]
        if not found or None in found:
            return self._fail(end)
        for call in found:
            assert call is not None
            self._call(*call)
        self._buf, self._in_group, self._json = buf[end:], False, None
        return True

    def _fail(self, end: int) -> bool:
        """The group up to `end` is not calls: it is content."""
        self._content(self._buf[:end])
        self._buf, self._in_group, self._json = self._buf[end:], False, None
        return True


class GraniteToolParser(ToolParser):
    name = "granite"
    models = "Granite 3.x"
    needs_special_tokens = True  # <|tool_call|> is a special token: it must survive decoding

    def streamer(self) -> ToolCallStreamer:
        return GraniteStreamer(self)
