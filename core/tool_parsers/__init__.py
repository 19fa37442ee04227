"""Tool-call parsers: find a model's own tool-call format in its text (`tool_choice: "auto"`).

Built in: `hermes`, `llama3_json` and `mistral`, one module each. A third-party package adds one
by declaring an entry point in the ``portside.tool_parsers`` group that names a `ToolParser`
subclass; it is imported only when asked for by name.
"""

from __future__ import annotations

from typing import Any

from portside.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
)
from portside.tool_parsers.hermes import HermesToolParser
from portside.tool_parsers.llama3_json import Llama3JsonToolParser
from portside.tool_parsers.mistral import MistralToolParser

__all__ = [
    "ENTRY_POINT_GROUP",
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
]

ENTRY_POINT_GROUP = "portside.tool_parsers"

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class for `--tool-call-parser name`: built in, else from an entry point."""
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]
    from stevedore import NamedExtensionManager

    errors: list[str] = []

    def on_load_failure(_manager: Any, entry_point: Any, exc: BaseException) -> None:
        errors.append(f"{entry_point.name} ({entry_point.value}): {type(exc).__name__}: {exc}")

    manager: NamedExtensionManager[Any] = NamedExtensionManager(
        namespace=ENTRY_POINT_GROUP,
        names=[name],
        on_load_failure_callback=on_load_failure,
        on_missing_entrypoints_callback=None,
    )
    if errors:
        raise ValueError(f"tool parser {name!r} failed to load: {errors[0]}")
    if name not in manager.names():
        known = sorted({*TOOL_PARSERS, *manager.entry_points_names()})
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(known)}")
    cls = manager[name].plugin
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise ValueError(f"tool parser {name!r} ({manager[name].entry_point.value}) is not a ToolParser")
    return cls
