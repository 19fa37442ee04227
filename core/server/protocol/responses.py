"""The request body of OpenAI's Responses API (`POST /v1/responses`) and its input items.

Validated as strictly as the other bodies: a field portside does not act on is a 400 naming it
(`tools[1].type`, `input[2].content[0].type`, `truncation`), never silently ignored. The input
is normalized to a list of items (a string is one user message), each checked against its own
model so that an error names the item: messages (roles user, system, developer, assistant; text,
`input_image` and, for the assistant, `output_text` and `refusal` parts), `function_call`,
`function_call_output` and `reasoning` items, in the shapes both the API's input and its own
output use (a client sends a response's output items back as input).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from portside.server.protocol.common import OpenAIModel

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
EFFORTS = ("low", "medium", "high")  # what a template's (or harmony's) reasoning_effort takes
INCLUDES = (
    "message.output_text.logprobs",  # logprobs on output_text (as top_logprobs alone also asks)
    "reasoning.encrypted_content",  # accepted: reasoning comes back as plain text (its content), never encrypted
    "message.input_image.image_url",  # accepted: stored input items keep their image URLs anyway
)
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]


class FunctionTool(OpenAIModel):
    """A function tool, flat as the Responses API writes it (chat's nests it under `function`)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    """`text.format`: plain text, any JSON object, or JSON valid for a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> TextFormat:
        if self.type == "json_schema":
            for name, value in (("name", self.name), ("schema", self.schema_)):
                if value is None:
                    raise ValueError(f"{name}: required when type is 'json_schema'")
        else:
            extra = sorted(f for f in ("name", "description", "schema_", "strict") if getattr(self, f) is not None)
            if extra:
                raise ValueError(f"{extra[0].rstrip('_')}: only allowed when type is 'json_schema'")
        return self


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ReasoningConfig(OpenAIModel):
    """`reasoning`: `effort` goes to the model's template (`reasoning_effort`; harmony's system
    message for gpt-oss). Summaries are not written: reasoning comes back whole, as the
    reasoning item's content, its `summary` empty."""

    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of summary

    @model_validator(mode="after")
    def _check(self) -> ReasoningConfig:
        if self.effort is not None and self.effort not in EFFORTS:
            raise ValueError(f"effort: portside passes {', '.join(EFFORTS)} to the model (its template's reasoning_effort); "
                             f"got {self.effort!r}")
        return self


class StreamOptions(OpenAIModel):
    include_obfuscation: bool | None = None  # accepted; portside adds no obfuscation padding


# input items: each has an optional id and status (what the API's own output items carry)
class _Item(OpenAIModel):
    id: str | None = None
    status: ITEM_STATUS | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=64)
    output: str | list[dict[str, Any]]


class SummaryText(OpenAIModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # portside returns reasoning as plain text; it cannot read another server's


class TextPart(OpenAIModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text sent back: its annotations and logprobs are the model's, not input
    logprobs: list[Any] | None = None


class ImagePart(OpenAIModel):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: None = None  # OpenAI's Files API: not served by portside
    detail: Literal["auto", "low", "high"] | None = None


class RefusalPart(OpenAIModel):
    type: Literal["refusal"]
    refusal: str


ITEMS: dict[str, type[_Item]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}  # fmt: skip
PARTS: dict[str, type[OpenAIModel]] = {"input_text": TextPart, "output_text": TextPart, "input_image": ImagePart, "refusal": RefusalPart}


def _path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a field path relative to its model ("[0].text", ".call_id")."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif isinstance(item, str) and item.isidentifier():
            out += f".{item}"
        else:  # a union member's tag: the path so far names the field
            break
    return out


def validated(model: type[BaseModel], value: Any, where: str) -> Any:
    """`value` as `model`, or a ValueError whose message starts with the failing field's path
    under `where` (the body's error then names it)."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        kind, path = first.get("type", ""), where + _path(first.get("loc", ()))
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind == "missing":
            raise ValueError(f"{path}: is required") from None
        if kind == "extra_forbidden":
            raise ValueError(f"{path}: unrecognized field; portside does not support it") from None
        if path.endswith(".file_id"):
            msg = "OpenAI's Files API is not served by portside; send the image as image_url (a data: URL)"
        elif path.endswith(".encrypted_content"):
            msg = ("portside cannot read encrypted reasoning; send the reasoning as content "
                   "[{'type': 'reasoning_text', 'text': ...}] (as portside returns it), or leave the item out")
        raise ValueError(f"{path}: {msg}") from None


def _check_parts(role: str, parts: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A message's content parts, each checked (type, fields, and which roles may send it)."""
    out = []
    for j, part in enumerate(parts):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        model = PARTS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ValueError(f"{at}.type: unsupported content part {kind!r}; portside takes input_text, input_image "
                             "(user messages) and, in assistant messages, output_text and refusal")
        if kind == "input_image" and role != "user":
            raise ValueError(f"{at}.type: images are accepted in user messages only, not in a {role!r} message")
        if kind == "refusal" and role != "assistant":
            raise ValueError(f"{at}.type: a refusal part belongs to an assistant message, not a {role!r} one")
        checked = validated(model, part, at).model_dump(exclude_none=True)
        if kind == "input_image" and not checked.get("image_url"):
            raise ValueError(f"{at}.image_url: is required (a data:image/...;base64 URL, or an http(s):// or file:// URL "
                             "where the server allows them)")
        out.append(checked)
    return out


def input_items(value: Any) -> list[dict[str, Any]]:
    """The request's `input` as checked items (plain dicts, `type` always set): a string is one
    user message."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError("input: must be a string or a non-empty list of input items")
    out = []
    for i, item in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{at}: an input item must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        model = ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ValueError(f"{at}.type: unsupported item type {kind!r}; portside takes message, function_call, "
                             "function_call_output and reasoning items")
        checked = validated(model, item, at).model_dump(exclude_none=True)
        if isinstance(checked.get("content"), list) and kind == "message":
            checked["content"] = _check_parts(checked["role"], checked["content"], at)
        if kind == "function_call_output" and isinstance(checked["output"], list):
            checked["output"] = [validated(TextPart, p, f"{at}.output[{j}]").model_dump(exclude_none=True)
                                 for j, p in enumerate(checked["output"])]
        out.append(checked)
    return out


def _tool(i: int, value: Any) -> FunctionTool:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "function":
        raise ValueError(f"tools[{i}].type: {kind!r} tools are not supported; portside serves function tools "
                         "({'type': 'function', 'name': ..., 'parameters': {...}})")
    return validated(FunctionTool, value, f"tools[{i}]")  # type: ignore[no-any-return]


def _tool_choice(value: Any) -> str | FunctionToolChoice | None:
    if value is None or value in ("none", "auto", "required"):
        return value  # type: ignore[no-any-return]
    if isinstance(value, dict) and value.get("type") == "function":
        return validated(FunctionToolChoice, value, "tool_choice")  # type: ignore[no-any-return]
    kind = value.get("type") if isinstance(value, dict) else value
    raise ValueError(f"tool_choice: {kind!r} is not supported; portside takes 'none', 'auto', 'required' or "
                     "{'type': 'function', 'name': ...}")


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses."""

    model: str
    input: Any = Field(default=None, validate_default=True)  # str | list of items: see `items`
    instructions: str | None = None
    tools: list[Any] | None = None  # function tools: see `function_tools`
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name"}: see `choice`
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    store: bool | None = None  # None: true
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = None  # accepted: portside's prefix cache finds shared prefixes by itself
    truncation: str | None = None  # "disabled" only
    service_tier: str | None = None  # "auto" / "default" only
    background: bool | None = None  # false only
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    _items: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _tools: list[FunctionTool] = PrivateAttr(default_factory=list)
    _choice: str | FunctionToolChoice | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.input is None:
            raise ValueError("input: is required (a string, or a list of input items)")
        self._items = input_items(self.input)
        self._tools = [_tool(i, t) for i, t in enumerate(self.tools or [])]
        names = [t.name for t in self._tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        self._choice = _tool_choice(self.tool_choice)
        if isinstance(self._choice, FunctionToolChoice) and self._choice.name not in names:
            raise ValueError(f"tool_choice: function {self._choice.name!r} is not among the tools")
        if self._choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        self._check_options()
        return self

    def _check_options(self) -> None:
        for i, name in enumerate(self.include or []):
            if name not in INCLUDES:
                raise ValueError(f"include[{i}]: {name!r} is not supported; portside takes {', '.join(INCLUDES)}")
        if self.truncation not in (None, "disabled"):
            raise ValueError(f"truncation: only 'disabled' is supported (an input over the context is a 400), got {self.truncation!r}")
        if self.service_tier not in (None, "auto", "default"):
            raise ValueError(f"service_tier: portside has one tier ('auto' or 'default'), got {self.service_tier!r}")
        if self.background:
            raise ValueError("background: not supported; run the request in the foreground (stream it to see progress)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(meta)}")
        for key, value in meta.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"metadata: keys are at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}; "
                                 f"{key[:MAX_METADATA_KEY]!r} is over")

    @property
    def items(self) -> list[dict[str, Any]]:
        """The input as checked items (a string input is one user message)."""
        return self._items

    @property
    def function_tools(self) -> list[FunctionTool]:
        return self._tools

    @property
    def choice(self) -> str | FunctionToolChoice:
        """tool_choice as the response echoes it (OpenAI's default: "auto")."""
        return self._choice if self._choice is not None else "auto"

    @property
    def logprobs(self) -> bool:
        """Whether output_text carries logprobs (the include, or top_logprobs)."""
        return "message.output_text.logprobs" in (self.include or []) or self.top_logprobs is not None


def _text(parts: str | list[dict[str, Any]]) -> str:
    if isinstance(parts, str):
        return parts
    return "".join(p.get("text") or p.get("refusal") or "" for p in parts)


def _user_content(parts: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content as chat messages take it: text, or with images its parts one for one
    (so that `content[j]` names the same part in both)."""
    if isinstance(parts, str) or not any(p["type"] == "input_image" for p in parts):
        return _text(parts)
    return [{"type": "image_url", "image_url": {"url": p["image_url"], "detail": p.get("detail", "auto")}}
            if p["type"] == "input_image" else {"type": "text", "text": p.get("text", "")} for p in parts]


def chat_messages(items: list[dict[str, Any]], origins: list[str],
                  instructions: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation as chat messages (dicts for `ChatMessage`), and for each the field that
    holds it (`origins[k]` names `items[k]`: "input[3]", or "previous_response_id" for items of
    the stored conversation). `instructions` is a system message first. An assistant turn's
    reasoning, message and function calls, consecutive items here, are one assistant message
    (reasoning_content, content, tool_calls); a function_call_output is a tool message, which
    must answer a function_call before it (ValueError naming its call_id)."""
    messages: list[dict[str, Any]] = []
    where: list[str] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        where.append("instructions")
    names: dict[str, str] = {}  # call_id -> the function's name
    turn: dict[str, Any] | None = None  # the assistant message being assembled

    def assistant(origin: str, fresh: bool) -> dict[str, Any]:
        nonlocal turn
        if turn is None or fresh:
            turn = {"role": "assistant", "content": None}
            messages.append(turn)
            where.append(origin)
        return turn

    for item, origin in zip(items, origins, strict=True):
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            turn = None
            messages.append({"role": item["role"], "content": _user_content(item["content"])})
            where.append(origin)
        elif kind == "message":
            msg = assistant(origin, turn is None or turn["content"] is not None or "tool_calls" in turn)
            msg["content"] = _text(item["content"])
        elif kind == "reasoning":
            msg = assistant(origin, turn is None or turn["content"] is not None or len(turn) > 2)  # it opens a turn
            msg["reasoning_content"] = "".join(p["text"] for p in item.get("content") or item.get("summary") or [])
        elif kind == "function_call":
            msg = assistant(origin, False)
            msg.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}})
            names[item["call_id"]] = item["name"]
        else:  # function_call_output
            if item["call_id"] not in names:
                raise ValueError(f"{origin}.call_id: no function_call item with call_id {item['call_id']!r} comes before this "
                                 "output (send the call too, or continue its response with previous_response_id)")
            turn = None
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "name": names[item["call_id"]],
                             "content": _text(item["output"])})
            where.append(origin)
    for m in messages:  # an assistant turn of reasoning alone still says something
        if m["role"] == "assistant" and m["content"] is None and "tool_calls" not in m:
            m["content"] = ""
    return messages, where
