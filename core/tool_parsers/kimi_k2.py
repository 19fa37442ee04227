"""Kimi-K2 format: calls in one section of special-token blocks, each opening with the call's
id, `functions.NAME:INDEX`, then the arguments object.

    Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>
    functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>

(one line in the output; whitespace around the id and the arguments is allowed). The id is the
call's id, as Kimi's chat template writes it back (`## Return of functions.get_weather:0`); the
name is the id's part before the colon, after the last dot. The section is read as
`sections.SectionStreamer` reads one: text around it is content, and a block without an id of
that shape, or whose arguments are not one JSON object, is content, markers included.
"""

from __future__ import annotations

import re

from portside.tool_parsers.base import ToolCallStreamer, ToolParser, arguments_json, loads
from portside.tool_parsers.sections import SectionStreamer

CALLS_BEGIN = "<|tool_calls_section_begin|>"
CALLS_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
CALL_END = "<|tool_call_end|>"
ARGS = "<|tool_call_argument_begin|>"

_CALL_ID = re.compile(r"(?:[\w-]+\.)*(?P<name>[\w-]+):\d+")


def parse_block(body: str) -> tuple[str, str, str] | None:
    """(name, arguments JSON, call id) of one block's body, or None."""
    head, found, rest = body.partition(ARGS)
    call_id = head.strip()
    match = _CALL_ID.fullmatch(call_id)
    args = loads(rest.strip())
    if not found or match is None or not isinstance(args, dict):
        return None
    encoded = arguments_json({"arguments": args})
    return None if encoded is None else (match["name"], encoded, call_id)


class KimiK2Streamer(SectionStreamer):
    calls_begin, calls_end, call_begin, call_end = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END

    def parse_block(self, body: str) -> tuple[str, str, str | None] | None:
        return parse_block(body)


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    models = "Kimi-K2"
    needs_special_tokens = True  # the markers are special tokens: they must survive decoding

    def streamer(self) -> ToolCallStreamer:
        return KimiK2Streamer(self)
