"""Qwen3-Coder format: XML-style calls whose parameter values are plain text.

    I'll look both up.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

(Qwen3-Coder's chat template writes past calls this way: each value between a newline after
`<parameter=NAME>` and one before `</parameter>`, objects and arrays as JSON, anything else as
its text.) A value is text, so it is converted by the type its parameter has in the request's
tools (`ToolParser.tools`): integer, number, boolean, null, object and array from their text
(objects and arrays as JSON, else as Python literals); a string stays the text; a value that
does not read as its type, or a parameter the tools do not describe, stays a string.

A `<tool_call>` block ends at `</tool_call>`, at the next `<tool_call>` (a forgotten closing
tag) or at the end of the output, and holds one or more `<function=...>...</function>`; a bare
`<function=...>...</function>` (the tags the model sometimes leaves out) is read too. A value
ends at the block's first `</parameter>` after it (with none, at the next `<parameter=` or
`</function>`). Anything
else in a block, or a function never closed, makes the whole block content, tags included.
Text around blocks is content. Calls are emitted when their block closes.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from portside.tool_parsers.base import ToolCallStreamer, ToolParser, is_json_value, loads

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

_INTEGER = re.compile(r"[-+]?\d+")
_NAME = re.compile(r"[^\s<>]+")


class Qwen3CoderStreamer(ToolCallStreamer):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._block: str | None = None  # OPEN or FUNCTION: the buffer starts with it

    def _step(self, final: bool) -> bool:
        if self._block is None:
            if not self._up_to((OPEN, FUNCTION), final):
                return False
            self._block = OPEN if self._buf.startswith(OPEN) else FUNCTION
            return True
        buf = self._buf
        if self._block == FUNCTION:
            close = buf.find(FUNCTION_END)
            if close < 0 and not final:
                return False
            body_end = block_end = len(buf) if close < 0 else close + len(FUNCTION_END)
        else:
            close, reopen = buf.find(CLOSE, len(OPEN)), buf.find(OPEN, len(OPEN))
            if close >= 0 and (reopen < 0 or close < reopen):
                body_end, block_end = close, close + len(CLOSE)
            elif reopen >= 0:
                body_end = block_end = reopen
            elif final:
                body_end = block_end = len(buf)
            else:
                return False  # the block is still open
        body = buf[len(OPEN) : body_end] if self._block == OPEN else buf[:body_end]
        calls = parse_functions(body, self._parser.tools)
        if calls is None:
            self._content(buf[:block_end])
        else:
            for name, arguments in calls:
                self._call(name, arguments)
        self._buf, self._block = buf[block_end:], None
        return True


def parse_functions(body: str, tools: list[dict[str, Any]] | None) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON) of each `<function=...>...</function>` in `body`, which must
    hold at least one and nothing else but whitespace; None otherwise."""
    calls: list[tuple[str, str]] = []
    pos = 0
    while True:
        pos = _skip_space(body, pos)
        if pos == len(body):
            return calls or None
        if not body.startswith(FUNCTION, pos):
            return None
        parsed = _parse_function(body, pos + len(FUNCTION), tools)
        if parsed is None:
            return None
        name, arguments, pos = parsed
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))


def _parse_function(text: str, pos: int, tools: list[dict[str, Any]] | None) -> tuple[str, dict[str, Any], int] | None:
    """The function whose name starts at `pos`: (name, arguments, the index past its end tag)."""
    name, pos = _tag_name(text, pos)
    if name is None:
        return None
    properties = _properties(tools, name)
    arguments: dict[str, Any] = {}
    while True:
        pos = _skip_space(text, pos)
        if text.startswith(FUNCTION_END, pos):
            return name, arguments, pos + len(FUNCTION_END)
        if not text.startswith(PARAMETER, pos):
            return None
        param, start = _tag_name(text, pos + len(PARAMETER))
        if param is None:
            return None
        end = text.find(PARAMETER_END, start)
        if end < 0:  # left open: up to the next parameter or the function's end
            ends = [i for i in (text.find(PARAMETER, start), text.find(FUNCTION_END, start)) if i >= 0]
            if not ends:
                return None
            end = min(ends)
        value = text[start:end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[param] = convert(value, properties.get(param))
        pos = end + len(PARAMETER_END) if text.startswith(PARAMETER_END, end) else end


def _tag_name(text: str, pos: int) -> tuple[str | None, int]:
    """The name in `<function=NAME>` / `<parameter=NAME>` starting at `pos`, and the index past ">"."""
    match = _NAME.match(text, pos)
    if match is None or not text.startswith(">", match.end()):
        return None, pos
    return match.group(), match.end() + 1


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """The `properties` of the parameters schema of the tool called `name` ({} when unknown)."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def schema_types(schema: Any) -> list[str]:
    """The JSON types a schema allows, in its order: from `type` (a name or a list), else its
    `anyOf` / `oneOf` branches, `enum` / `const` values, `properties` or `items`."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else ():
            types += [t for t in schema_types(branch) if t not in types]
    enum = schema.get("enum")
    values: list[Any] = enum if isinstance(enum, list) else [schema["const"]] if "const" in schema else []
    for v in values:
        t = _json_type(v)
        if t not in types:
            types.append(t)
    if not types and "properties" in schema:
        types.append("object")
    if not types and "items" in schema:
        types.append("array")
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


_NO_VALUE = object()


def convert(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type says; the text itself when it is a
    string, when the schema is unknown, or when the text does not read as any of its types."""
    try:
        return _convert(text, schema_types(schema))
    except RecursionError:  # nested past what json and ast read
        return text


def _convert(text: str, types: list[str]) -> Any:
    others = [t for t in types if t not in ("string", "null")]
    word = text.strip()
    if word in ("null", "None") and ("null" in types or (types and "string" not in types)):
        return None
    for t in others:
        value = _read(word, t)
        if value is not _NO_VALUE:
            return value
    return text


def _read(word: str, json_type: str) -> Any:
    """`word` read as a value of `json_type`, or _NO_VALUE."""
    if json_type in ("integer", "number") and _INTEGER.fullmatch(word):
        try:
            return int(word)
        except ValueError:  # past Python's limit on digits
            return _NO_VALUE
    if json_type == "number":
        try:
            number = float(word)
        except ValueError:
            return _NO_VALUE
        return number if math.isfinite(number) else _NO_VALUE
    if json_type == "boolean":
        return {"true": True, "false": False}.get(word.lower(), _NO_VALUE)
    if json_type in ("object", "array"):
        wanted = dict if json_type == "object" else list
        value = loads(word)
        if value is None:
            try:
                value = ast.literal_eval(word)  # a Python literal: {'a': True}
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return _NO_VALUE
        return value if isinstance(value, wanted) and is_json_value(value) else _NO_VALUE
    return _NO_VALUE


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    models = "Qwen3-Coder"

    def streamer(self) -> ToolCallStreamer:
        return Qwen3CoderStreamer(self)
