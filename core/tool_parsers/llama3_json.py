"""Llama 3.1 / 3.2 JSON format: the whole output is the call, or several joined by ";".

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The output must start (after whitespace and an optional `<|python_tag|>`) with a call object,
one with a "name" and a "parameters" (or "arguments") object: a bare `{"name": "Bob"}` is
more likely a JSON answer than a call, so it is content. If the first object is not a call,
the whole output is content; after a call, the first thing that is not another call ends the
calls and comes back, with the rest of the output, as content. Each call is emitted as soon
as its closing brace arrives.
"""

from __future__ import annotations

from portside.tool_parsers.base import JsonEnd, ToolCallStreamer, ToolParser, call_from_object, loads

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStreamer(ToolCallStreamer):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._state = "start"  # start -> object <-> between, and any of them -> content
        self._object: JsonEnd | None = None  # the object being read, from where it opens

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "content":
            self._content(buf)
            self._buf = ""
            return False
        if self._state in ("start", "between"):
            rest = buf.lstrip()
            if self._state == "start" and rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG) :].lstrip()
            elif self._state == "between" and rest.startswith(";"):
                rest = rest[1:].lstrip()
            undecided = not rest or (self._state == "start" and PYTHON_TAG.startswith(rest))
            if undecided and not final:
                return False
            if rest.startswith("{"):
                self._object, self._state = JsonEnd(len(buf) - len(rest)), "object"
                return True
            if self._state == "between":  # the separators after the last call are dropped
                self._buf = rest
            self._state = "content"
            return True
        assert self._object is not None
        start, end = self._object.start, self._object.find(buf)
        if end is None and not final:
            return False
        call = None if end is None else _call(buf[start:end])
        if call is None:
            if self._num_calls:  # else the whole output, tag and all, is content
                self._buf = buf[start:]
            self._state = "content"
            return True
        self._call(*call)
        self._buf, self._state = buf[end:], "between"
        return True


def _call(text: str) -> tuple[str, str] | None:
    """(name, arguments) of a call object that names its arguments, else None."""
    obj = loads(text)
    if not isinstance(obj, dict) or not ("parameters" in obj or "arguments" in obj):
        return None
    return call_from_object(obj, ("parameters", "arguments"))


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    models = "Llama 3.1+ JSON"

    def streamer(self) -> ToolCallStreamer:
        return Llama3JsonStreamer(self)
