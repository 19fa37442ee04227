"""DeepSeek-V3 format (DeepSeek-V3, R1-0528 after its thinking): calls in one section of
special-token-delimited blocks, each naming its type and function, arguments in a JSON fence.

    Let me look that up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1's shorter block, ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
<｜tool▁call▁end｜>``, is read too (the text after the separator is then the arguments object).

Text before the section, and after its end marker, is content. Inside the section, blocks may be
separated by whitespace; a block whose body does not parse (no separator, no name, arguments that
are not one JSON object) is content, markers included, as is anything else the section holds. A
block or section still open at the end of the output is content. Each call is emitted when its
block closes.
"""

from __future__ import annotations

from portside.tool_parsers.base import ToolCallStreamer, ToolParser, arguments_json, loads

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json"
FENCE_CLOSE = "```"


def parse_block(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one block's body (between its begin and end markers), or None."""
    head, found, rest = body.partition(SEP)
    if not found:
        return None
    head = head.strip()
    if rest.lstrip().startswith("{"):  # V3.1: name<sep>{arguments}
        name, args_text = head, rest
    else:  # V3: type<sep>name\n```json\n{arguments}\n```
        name, newline, fenced = rest.partition("\n")
        fenced = fenced.strip()
        if not newline or not fenced.startswith(FENCE_OPEN) or not fenced.endswith(FENCE_CLOSE) or len(fenced) < len(FENCE_OPEN) + len(FENCE_CLOSE):
            return None
        name, args_text = name.strip(), fenced[len(FENCE_OPEN) : -len(FENCE_CLOSE)]
    args = loads(args_text.strip())
    if not name or not isinstance(args, dict) or any(c.isspace() for c in name):
        return None
    encoded = arguments_json({"arguments": args})
    return None if encoded is None else (name, encoded)


class DeepSeekV3Streamer(ToolCallStreamer):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._in_section = False  # True: past CALLS_BEGIN, between blocks
        self._opening = ""  # the section's begin marker while no block of it became a call

    def _step(self, final: bool) -> bool:
        if not self._in_section:
            if not self._up_to(CALLS_BEGIN, final):
                return False
            self._buf, self._in_section, self._opening = self._buf[len(CALLS_BEGIN) :], True, CALLS_BEGIN
            return True
        rest = self._buf.lstrip()
        if rest.startswith(CALLS_END):  # the section ends (an empty one leaves nothing)
            self._buf, self._in_section, self._opening = rest[len(CALLS_END) :], False, ""
            return True
        if rest.startswith(CALL_BEGIN):
            end = rest.find(CALL_END, len(CALL_BEGIN))
            if end < 0:
                return self._not_calls() if final else False
            call = parse_block(rest[len(CALL_BEGIN) : end])
            if call is None:
                self._content(self._opening + self._buf[: len(self._buf) - len(rest) + end + len(CALL_END)])
            else:
                self._call(*call)
            self._opening, self._buf = "", rest[end + len(CALL_END) :]
            return True
        if not final and (not rest or CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
            return False  # whitespace, or a marker not yet whole
        return self._not_calls()

    def _not_calls(self) -> bool:
        """The rest of the section is not calls: content from here on, its begin marker included
        when no block of it was a call."""
        self._content(self._opening + self._buf)
        self._buf, self._in_section, self._opening = "", False, ""
        return True


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    needs_special_tokens = True  # the markers are added tokens: they must survive decoding

    def streamer(self) -> ToolCallStreamer:
        return DeepSeekV3Streamer(self)
