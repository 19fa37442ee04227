"""Tool-call parsers: find a model's own tool-call format in its text (`tool_choice: "auto"`).

Built in, one module each: `hermes`, `llama3_json`, `mistral`, `deepseek_v3`, `qwen3_coder`,
`pythonic`, `kimi_k2` and `granite`. A third-party package adds one by declaring an entry point in
the ``portside.tool_parsers`` group that names a `ToolParser` subclass; it is imported only when
asked for by name.
"""

from __future__ import annotations

from portside.named_plugins import load_named
from portside.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
)
from portside.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from portside.tool_parsers.granite import GraniteToolParser
from portside.tool_parsers.hermes import HermesToolParser
from portside.tool_parsers.kimi_k2 import KimiK2ToolParser
from portside.tool_parsers.llama3_json import Llama3JsonToolParser
from portside.tool_parsers.mistral import MistralToolParser
from portside.tool_parsers.pythonic import PythonicToolParser
from portside.tool_parsers.qwen3_coder import Qwen3CoderToolParser

__all__ = [
    "ENTRY_POINT_GROUP",
    "TOOL_PARSERS",
    "DeepSeekV3ToolParser",
    "ExtractedToolCalls",
    "GraniteToolParser",
    "HermesToolParser",
    "KimiK2ToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamer",
    "ToolParser",
    "described",
    "get_tool_parser",
]

ENTRY_POINT_GROUP = "portside.tool_parsers"

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        DeepSeekV3ToolParser,
        Qwen3CoderToolParser,
        PythonicToolParser,
        KimiK2ToolParser,
        GraniteToolParser,
    )
}


def described() -> str:
    """The built-in names, each with the models that write its format (for --help)."""
    return ", ".join(f"{name} ({cls.models})" if cls.models else name for name, cls in TOOL_PARSERS.items())


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class for `--tool-call-parser name`: built in, else from an entry point."""
    return load_named(ENTRY_POINT_GROUP, name, ToolParser, TOOL_PARSERS, "tool parser")
