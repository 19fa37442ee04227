"""Mistral format: calls follow the `[TOOL_CALLS]` special token, in one of two shapes.

    Before tokenizer v11:  [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    v11 and later:         [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

A v11 call may carry its id (`name[CALL_ID]id[ARGS]{...}`, v13); a pre-v11 group may also be
a single object. Calls are emitted when their JSON closes (all of a pre-v11 array at once:
it is one JSON value, and a bad element spoils it). A group that does not parse is content,
marker included; text before, between and after the groups is content.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable

from portside.tool_parsers.base import (
    JsonEnd,
    ToolCallStreamer,
    ToolParser,
    call_from_object,
    loads,
)

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_ALPHANUMERIC = string.ascii_letters + string.digits


def _is_name_char(c: str) -> bool:
    return c.isalnum() or c in "_-."


def _run_end(text: str, i: int, ok: Callable[[str], bool]) -> int:
    """The end of the run of characters from `text[i]` on that satisfy `ok`."""
    while i < len(text) and ok(text[i]):
        i += 1
    return i


class MistralStreamer(ToolCallStreamer):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._in_group = False  # when True, the buffer starts with MARKER
        self._object: JsonEnd | None = None  # the group's JSON, once its header is read
        self._name: str | None = None  # v11: the call's name (None: a pre-v11 group)
        self._call_id: str | None = None

    def _step(self, final: bool) -> bool:
        if not self._in_group:
            self._in_group = self._up_to(MARKER, final)
            return self._in_group
        buf = self._buf
        if self._object is None:
            header = self._header(buf)
            if header is None:  # not decided yet
                if not final:
                    return False
                return self._fail(len(buf))
            if isinstance(header, int):
                return self._fail(header)
            self._object = JsonEnd(header[0])
            self._name, self._call_id = header[1], header[2]
        end = self._object.find(buf)
        if end is None:
            return self._fail(len(buf)) if final else False
        value = loads(buf[self._object.start : end])
        if self._name is not None:
            calls = [(self._name, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else []
        else:
            found = [call_from_object(v) for v in (value if isinstance(value, list) else [value])]
            calls = [c for c in found if c is not None] if None not in found else []
        if not calls:
            return self._fail(end)
        for name, arguments in calls:
            self._call(name, arguments, self._call_id)
        self._end_group(end)
        return True

    def _header(self, buf: str) -> tuple[int, str | None, str | None] | int | None:
        """Where the group's JSON starts, with the v11 name and id (None before v11); an int:
        the position where the header went wrong; None: more text is needed to tell."""
        i = _run_end(buf, len(MARKER), str.isspace)
        if i == len(buf):
            return None
        if buf[i] in "[{":
            return i, None, None
        j = _run_end(buf, i, _is_name_char)
        if j == len(buf):
            return None
        if j == i:
            return i
        name, call_id = buf[i:j], None
        if buf.startswith(CALL_ID, j):
            k = _run_end(buf, j + len(CALL_ID), str.isalnum)
            if k == len(buf):
                return None
            call_id, j = buf[j + len(CALL_ID) : k], k
        if buf.startswith(ARGS, j):
            j = _run_end(buf, j + len(ARGS), str.isspace)
            if j == len(buf):
                return None
        elif ARGS.startswith(buf[j:]) or (call_id is None and CALL_ID.startswith(buf[j:])):
            return None
        elif call_id is not None:  # an id is always followed by [ARGS]
            return j
        return (j, name, call_id or None) if buf[j] == "{" else j

    def _fail(self, end: int) -> bool:
        """The group up to `end` is not a call: it is content."""
        self._content(self._buf[:end])
        self._end_group(end)
        return True

    def _end_group(self, end: int) -> None:
        self._buf = self._buf[end:]
        self._in_group, self._object, self._name, self._call_id = False, None, None, None


class MistralToolParser(ToolParser):
    name = "mistral"
    models = "Mistral"
    needs_special_tokens = True

    def new_id(self) -> str:
        """Nine random alphanumeric characters, as Mistral's API gives."""
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def streamer(self) -> ToolCallStreamer:
        return MistralStreamer(self)
