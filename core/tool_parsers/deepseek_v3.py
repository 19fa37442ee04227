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

The section is read as `sections.SectionStreamer` reads one: text around it is content, and a
block whose body does not parse (no separator, no name, arguments that are not one JSON object)
is content, markers included. Each call is emitted when its block closes.
"""

from __future__ import annotations

from portside.tool_parsers.base import ToolCallStreamer, ToolParser, arguments_json, loads
from portside.tool_parsers.sections import SectionStreamer

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


class DeepSeekV3Streamer(SectionStreamer):
    calls_begin, calls_end, call_begin, call_end = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END

    def parse_block(self, body: str) -> tuple[str, str, str | None] | None:
        call = parse_block(body)
        return None if call is None else (*call, None)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    models = "DeepSeek-V3/R1, V3.1"
    needs_special_tokens = True  # the markers are added tokens: they must survive decoding

    def streamer(self) -> ToolCallStreamer:
        return DeepSeekV3Streamer(self)
