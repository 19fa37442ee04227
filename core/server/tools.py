"""Tool calling for chat completions: what `tool_choice` asks of the output, and turning the
output (whole, or delta by delta when streaming) into OpenAI `tool_calls`.

- "none": plain content (the tools are still shown to the model's template);
- "auto": the model's own tool-call format, parsed by `--tool-call-parser`;
- "required": the output is grammar-constrained to a JSON array of `{"name", "parameters"}`
  objects, one schema per tool, so every call names a tool and its arguments validate;
- a named function: the output is constrained to that function's parameters schema: it is the
  call's arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from portside.server.errors import bad_request
from portside.server.protocol.bodies import ChatCompletionRequest
from portside.server.protocol.messages import NamedToolChoice
from portside.structured.params import StructuredOutputsParams
from portside.tool_parsers import TOOL_PARSERS

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    choice: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None  # for the chat template, in OpenAI's format
    name: str | None = None  # the named function
    parser: Any = None  # "auto": a portside.tool_parsers.ToolParser
    constraint: StructuredOutputsParams | None = None  # "required" / "named"
    parallel: bool = True  # parallel_tool_calls: False keeps only the first call the model made

    @property
    def skip_special_tokens(self) -> bool | None:
        """False when the parser's markers are special tokens (they must survive decoding)."""
        return False if self.parser is not None and self.parser.needs_special_tokens else None


def plan_tools(req: ChatCompletionRequest, parser_cls: Any, tokenizer: Any) -> ToolPlan:
    """What the request's `tools` and `tool_choice` ask for; 400 for what cannot be honoured."""
    choice = req.effective_tool_choice
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if choice == "none" or not req.tools:
        return ToolPlan("none", tools)
    # arguments go to code: objects without `additionalProperties` get none (as in OpenAI's strict mode)
    params = {t.function.name: t.function.parameters or _NO_PARAMETERS for t in req.tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        return ToolPlan("named", tools, name=name,
                        constraint=StructuredOutputsParams(json=params[name], disable_additional_properties=True))
    if choice == "required":
        call = [
            {"type": "object", "properties": {"name": {"const": n}, "parameters": p}, "required": ["name", "parameters"],
             "additionalProperties": False}
            for n, p in params.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, constraint=StructuredOutputsParams(json=schema, disable_additional_properties=True))
    if parser_cls is None:
        raise bad_request(
            'tool_choice: "auto" tool choice needs the server started with --enable-auto-tool-choice and '
            f"--tool-call-parser ({', '.join(TOOL_PARSERS)}); or use tool_choice \"required\" or a named function",
            "tool_choice",
        )
    parser = parser_cls(tokenizer)
    parser.tools = tools  # formats that write arguments as text read their types from the tools' schemas
    return ToolPlan("auto", tools, parser=parser, parallel=req.parallel_tool_calls)


def _call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output. Output that does not parse (cut off by
    max_tokens, or a model that did not follow its format) stays content."""
    if plan.choice == "named":
        assert plan.name is not None
        return (None, [_call(plan.name, text)]) if _is_json(text) else (text, [])
    if plan.choice == "required":
        calls = _required_calls(text)
        return (None, calls) if calls else (text, [])
    if plan.choice == "auto":
        out = plan.parser.extract(text)
        calls = [_call(c.name, c.arguments, c.id) for c in out.tool_calls]
        return out.content, calls if plan.parallel else calls[:1]
    return text, []


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _required_calls(text: str) -> list[dict[str, Any]]:
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
        return []
    return [_call(i["name"], i.get("parameters", {})) for i in items]


@dataclass
class ToolStream:
    """One choice's streamed deltas: `feed(text)` and `finish()` return OpenAI `delta` dicts
    ({"content": ...} or {"tool_calls": [...]}) in order."""

    plan: ToolPlan
    buffer: str = ""
    num_calls: int = 0
    _streamer: Any = None
    _call_id: str = field(default_factory=new_call_id)
    _pos: int = 0  # "required": where the next array element starts

    def __post_init__(self) -> None:
        if self.plan.choice == "auto":
            self._streamer = self.plan.parser.streamer()

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        choice = self.plan.choice
        if choice == "none":
            return [{"content": text}]
        if choice == "auto":
            return self._from_parser(self._streamer.feed(text))
        if choice == "named":  # the whole output is the arguments, streamed as they come
            out = []
            if self.num_calls == 0:
                self.num_calls = 1
                out.append({"tool_calls": [{"index": 0, "id": self._call_id, "type": "function",
                                            "function": {"name": self.plan.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        self.buffer += text
        return self._required_elements()

    def finish(self) -> list[dict[str, Any]]:
        if self.plan.choice == "auto":
            return self._from_parser(self._streamer.finish())
        if self.plan.choice == "required" and self.num_calls == 0 and self.buffer:
            text, self.buffer = self.buffer, ""
            return [{"content": text}]  # never became a call: hand the text back as content
        return []

    def _from_parser(self, deltas: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if d.call is not None:
                if self.num_calls and not self.plan.parallel:
                    continue
                self.num_calls += 1
                call = _call(d.call.name, d.call.arguments, d.call.id)
                out.append({"tool_calls": [{"index": d.index} | call]})
            elif d.content:
                out.append({"content": d.content})
        return out

    def _required_elements(self) -> list[dict[str, Any]]:
        """Each element of the JSON array as soon as it is complete (the grammar guarantees the
        compact `[{...},{...}]` shape)."""
        out: list[dict[str, Any]] = []
        decoder = json.JSONDecoder()
        while True:
            start = self._pos if self._pos else 1  # past the "["
            if len(self.buffer) <= start:
                return out
            try:
                item, end = decoder.raw_decode(self.buffer, start)
            except ValueError:
                return out
            if isinstance(item, dict) and "name" in item:
                out.append({"tool_calls": [{"index": self.num_calls} | _call(item["name"], item.get("parameters", {}))]})
                self.num_calls += 1
            self._pos = end + 1  # past the "," or "]"


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: tool-call arguments as objects."""
    out = []
    for m in req.messages:
        content = m.content or (m.refusal if m.role == "assistant" else None) or m.content or ""
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _maybe_json(c.function.arguments)}}
                for c in m.tool_calls
            ]
        out.append(msg)
    return out


def _maybe_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
