"""Pythonic format (Llama 3.2, Llama 4, ToolACE): the calls as a Python list of calls with
keyword arguments.

    [get_weather(city="Paris", days=3), get_time(timezone='Europe/Paris')]

Llama 3.2's template asks for exactly this as the whole reply; Llama 4 may wrap it in its
`<|python_start|>` / `<|python_end|>` special tokens, after some text. So a list is read at the
start of the output (after whitespace) and after each `<|python_start|>`; a `<|python_end|>`
right after it is dropped. The list is parsed with `ast`, never evaluated: every element must be
a call of a plain name with keyword arguments only, each a literal (strings, numbers, True /
False / None, and lists and dicts of them, dict keys strings); else the list, with its opening
marker, is content. Text around the lists is content. A list's calls are emitted when it closes.
"""

from __future__ import annotations

import ast
import json

from portside.tool_parsers.base import ToolCallStreamer, ToolParser, is_json_value

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


class PythonListEnd:
    """Finds where the Python list opening at `text[0]` closes, resuming where the last call
    stopped (the text may only grow in between). Brackets count outside strings and comments;
    a quote that may still become a triple quote waits for the next text. Whether the span is a
    valid list is for `ast` to say."""

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._quote: str | None = None  # the open string's quote: ', ", ''' or """
        self._escaped = False
        self._comment = False

    def find(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while the list is still open."""
        i = self._pos
        while i < len(text):
            c = text[i]
            if self._comment:
                self._comment = c != "\n"
            elif self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == self._quote[0]:
                    if len(self._quote) == 3 and len(text) - i < 3:
                        break  # two more quotes may follow
                    if text.startswith(self._quote, i):
                        i += len(self._quote) - 1
                        self._quote = None
            elif c in "'\"":
                if text.startswith(c * 3, i):
                    self._quote, i = c * 3, i + 2
                elif len(text) - i < 3 and text[i:] == c * (len(text) - i):
                    break  # "" or ' at the end: may be the start of a triple quote
                else:
                    self._quote = c
            elif c == "#":
                self._comment = True
            elif c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i + 1
                    return i + 1
            i += 1
        self._pos = i
        return None


def parse_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in the list `text`, or None when it is not a
    non-empty list of calls with literal keyword arguments."""
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                return None
            arguments = {}
            for keyword in call.keywords:
                value = ast.literal_eval(keyword.value)
                if keyword.arg is None or not is_json_value(value):
                    return None
                arguments[keyword.arg] = value
            calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


class PythonicStreamer(ToolCallStreamer):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        # start -> (opened ->) list -> after -> text -> opened -> ...; a failed list goes to text
        self._state = "start"
        self._opening = ""  # what opened the list (whitespace, <|python_start|>): content if it fails
        self._list: PythonListEnd | None = None

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "start":
            rest = buf.lstrip()
            if not final and (not rest or PYTHON_START.startswith(rest)):
                return False
            if rest.startswith(PYTHON_START):
                self._opening, self._buf = buf[: len(buf) - len(rest) + len(PYTHON_START)], rest[len(PYTHON_START) :]
                self._state = "opened"
            else:
                self._state = "opened" if rest.startswith("[") else "text"
            return True
        if self._state == "text":
            if not self._up_to(PYTHON_START, final):
                return False
            self._opening, self._buf, self._state = PYTHON_START, self._buf[len(PYTHON_START) :], "opened"
            return True
        if self._state == "opened":  # a list must open next
            rest = buf.lstrip()
            if not rest and not final:
                return False
            if not rest.startswith("["):
                return self._fail(0)
            self._opening += buf[: len(buf) - len(rest)]
            self._buf, self._list, self._state = rest, PythonListEnd(), "list"
            return True
        if self._state == "list":
            assert self._list is not None
            end = self._list.find(buf)
            if end is None:
                return self._fail(len(buf)) if final else False
            calls = parse_calls(buf[:end])
            if calls is None:
                return self._fail(end)
            for name, arguments in calls:
                self._call(name, arguments)
            self._buf, self._opening, self._list, self._state = buf[end:], "", None, "after"
            return True
        rest = buf.lstrip()  # after a list: its closing marker may follow
        if rest.startswith(PYTHON_END):
            self._buf, self._state = rest[len(PYTHON_END) :], "text"
            return True
        if not final and PYTHON_END.startswith(rest):
            return False
        self._state = "text"
        return True

    def _fail(self, end: int) -> bool:
        """The list up to `end` is not calls: it is content, with what opened it."""
        self._content(self._opening + self._buf[:end])
        self._buf, self._opening, self._list, self._state = self._buf[end:], "", None, "text"
        return True


class PythonicToolParser(ToolParser):
    name = "pythonic"
    models = "Llama 3.2/4 pythonic"
    needs_special_tokens = True  # Llama 4's <|python_start|> / <|python_end|> must survive decoding

    def streamer(self) -> ToolCallStreamer:
        return PythonicStreamer(self)
