"""Hermes format (Qwen2.5, Qwen3, NousResearch Hermes): calls in tagged blocks.

    Let me check both cities.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block ends at its `</tool_call>`, at the next `<tool_call>` (a forgotten closing tag) or at
the end of the output; its body must be one JSON call object, else the whole block, tags
included, is content. Text between blocks is content. A call is emitted when its block closes.
"""

from __future__ import annotations

from portside.tool_parsers.base import ToolCallStreamer, ToolParser, call_from_object, loads

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesStreamer(ToolCallStreamer):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._in_block = False  # when True, the buffer starts with OPEN

    def _step(self, final: bool) -> bool:
        if not self._in_block:
            self._in_block = self._up_to(OPEN, final)
            return self._in_block
        buf = self._buf
        close, reopen = buf.find(CLOSE, len(OPEN)), buf.find(OPEN, len(OPEN))
        if close >= 0 and (reopen < 0 or close < reopen):
            body_end, block_end = close, close + len(CLOSE)
        elif reopen >= 0:
            body_end = block_end = reopen
        elif final:
            body_end = block_end = len(buf)
        else:
            return False  # the block is still open
        call = call_from_object(loads(buf[len(OPEN) : body_end]))
        if call is None:
            self._content(buf[:block_end])
        else:
            self._call(*call)
        self._buf, self._in_block = buf[block_end:], False
        return True


class HermesToolParser(ToolParser):
    name = "hermes"
    models = "Qwen2.5, Qwen3, Hermes"

    def streamer(self) -> ToolCallStreamer:
        return HermesStreamer(self)
