"""Formats whose calls sit in one section of marker-delimited blocks (DeepSeek-V3, Kimi-K2):

    text<SECTION BEGIN><CALL BEGIN>...<CALL END><CALL BEGIN>...<CALL END><SECTION END>text

Text before the section, and after its end marker, is content. Inside the section, blocks may be
separated by whitespace; a block whose body the format does not accept is content, markers
included. Anything else in the section, and a block still open at the end of the output, ends
the section: from there to the next section, all is content (a section never closed keeps the
calls of its closed blocks).
Each call is emitted when its block closes. A format sets the four markers and `parse_block`.
"""

from __future__ import annotations

from typing import ClassVar

from portside.tool_parsers.base import ToolCallStreamer, ToolParser


class SectionStreamer(ToolCallStreamer):
    calls_begin: ClassVar[str]
    calls_end: ClassVar[str]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._in_section = False  # True: past the section's begin marker, between blocks
        self._opening = ""  # the section's begin marker while no block of it became a call

    def parse_block(self, body: str) -> tuple[str, str, str | None] | None:
        """(name, arguments JSON, call id or None) of one block's body (between its begin and
        end markers), or None when it is not a call."""
        raise NotImplementedError

    def _step(self, final: bool) -> bool:
        if not self._in_section:
            if not self._up_to(self.calls_begin, final):
                return False
            self._buf, self._in_section, self._opening = self._buf[len(self.calls_begin) :], True, self.calls_begin
            return True
        rest = self._buf.lstrip()
        if rest.startswith(self.calls_end):  # the section ends (an empty one leaves nothing)
            self._buf, self._in_section, self._opening = rest[len(self.calls_end) :], False, ""
            return True
        if rest.startswith(self.call_begin):
            end = rest.find(self.call_end, len(self.call_begin))
            if end < 0:
                return self._not_calls() if final else False
            call = self.parse_block(rest[len(self.call_begin) : end])
            if call is None:
                self._content(self._opening + self._buf[: len(self._buf) - len(rest) + end + len(self.call_end)])
            else:
                self._call(*call)
            self._opening, self._buf = "", rest[end + len(self.call_end) :]
            return True
        if not final and (not rest or self.call_begin.startswith(rest) or self.calls_end.startswith(rest)):
            return False  # whitespace, or a marker not yet whole
        return self._not_calls()

    def _not_calls(self) -> bool:
        """The rest of the section is not calls: its begin marker (when no block of it was a call)
        is content, and so is what follows, up to the next section."""
        self._content(self._opening)
        self._in_section, self._opening = False, ""
        return True
