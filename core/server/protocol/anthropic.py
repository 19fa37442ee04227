"""Anthropic Messages request bodies (POST /v1/messages and /v1/messages/count_tokens) and their
mapping onto the chat-completions request the shared chat turn reads.

Validation is strict, as Anthropic's is: an unknown field, an unknown content block type or a
block where its role may not have one is a 400 naming it (`messages[1].content[0].type`). Content
blocks are checked per type here (not with a pydantic union, whose errors would name the union
member instead of the field), so every message names the field as the client sent it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from portside.server.protocol.common import MAX_STOP

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
ROLE_BLOCKS = {  # the block types each role's content may hold
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(AnthropicModel):
    """Accepted where Anthropic takes it: portside's prefix cache is automatic (every prompt's
    full blocks are reused), so a breakpoint changes nothing."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # what a client echoes back of a response's text block


class Base64Source(AnthropicModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(AnthropicModel):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(AnthropicModel):
    type: Literal["image"]
    source: dict[str, Any]  # Base64Source | URLSource, checked by its type in `_image_url`
    cache_control: CacheControl | None = None


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Any = None  # a string or text blocks, checked in `_check_block`
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # portside's own are a digest of the text; none is verified


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str  # encrypted by Anthropic: unreadable here, so not shown to the model


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
BLOCKS: dict[str, type[AnthropicModel]] = {
    "text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock,
}  # fmt: skip


def _error(where: str, e: ValidationError) -> ValueError:
    """The first error of a block's validation, as "where.field: why"."""
    first = e.errors(include_url=False)[0]
    param = where + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "missing":
        why = "required"
    elif kind == "extra_forbidden":
        why = "unknown field; portside does not support it"
    else:
        why = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return ValueError(f"{param}: {why}")


def parse_block(where: str, block: Any, allowed: tuple[str, ...], role: str) -> Block:
    """One content block, validated by its type; `where` is its parameter ("content[2]")."""
    if not isinstance(block, dict):
        raise ValueError(f"{where}: a content block must be an object with a 'type', got {type(block).__name__}")
    kind = block.get("type")
    if kind not in allowed:
        if kind in BLOCKS:
            raise ValueError(f"{where}.type: a {kind!r} block cannot appear in a {role} message; a {role} message "
                             f"holds {', '.join(allowed)}")
        raise ValueError(f"{where}.type: unsupported content block type {kind!r}; a {role} message holds "
                         f"{', '.join(allowed)}")
    try:
        parsed: Block = BLOCKS[kind].model_validate(block)  # type: ignore[assignment]
    except ValidationError as e:
        raise _error(where, e) from None
    _check_block(where, parsed)
    return parsed


def _check_block(where: str, block: Block) -> None:
    if isinstance(block, ImageBlock):
        image_url(where, block)
    elif isinstance(block, ToolResultBlock):
        tool_result_text(where, block)


def image_url(where: str, block: ImageBlock) -> str:
    """The image as a URL for the image pipeline: a data: URL for base64 data."""
    source = block.source
    kind = source.get("type")
    try:
        if kind == "base64":
            b64 = Base64Source.model_validate(source)
            return f"data:{b64.media_type};base64,{b64.data}"
        if kind == "url":
            return URLSource.model_validate(source).url
    except ValidationError as e:
        raise _error(f"{where}.source", e) from None
    raise ValueError(f"{where}.source.type: unsupported image source {kind!r}; send 'base64' (with media_type and "
                     "data) or 'url' ('file' sources need Anthropic's Files API, which portside does not have)")


def tool_result_text(where: str, block: ToolResultBlock) -> str:
    """A tool result's content as the text the chat template shows (text blocks joined)."""
    content = block.content
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: must be a string or a list of text blocks")
    texts = []
    for k, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "image":
            raise ValueError(f"{where}.content[{k}].type: images in tool results are not supported (chat templates "
                             "render tool results as text); send the image in a user text+image turn")
        if kind != "text":
            raise ValueError(f"{where}.content[{k}].type: a tool result's content holds text blocks, got {kind!r}")
        try:
            texts.append(TextBlock.model_validate(item).text)
        except ValidationError as e:
            raise _error(f"{where}.content[{k}]", e) from None
    return "\n".join(texts)


class InputMessage(AnthropicModel):
    role: Literal["user", "assistant"]
    content: Any  # a string, or content blocks; validated into `blocks`

    @model_validator(mode="after")
    def _blocks(self) -> InputMessage:
        content = self.content
        if isinstance(content, str):
            self.content = [TextBlock(type="text", text=content)]
            return self
        if not isinstance(content, list):
            raise ValueError("content: must be a string or a list of content blocks")
        if not content:
            raise ValueError("content: must not be empty (a string, or at least one content block)")
        self.content = [parse_block(f"content[{j}]", b, ROLE_BLOCKS[self.role], self.role) for j, b in enumerate(content)]
        return self

    @property
    def blocks(self) -> list[Block]:
        return self.content  # type: ignore[no-any-return]


class ToolDefinition(AnthropicModel):
    """A client tool. Anthropic's server tools (web search, code execution, text editor...) run
    on Anthropic's side and are refused."""

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # tool_choice any/tool constrain the arguments to the schema anyway

    @model_validator(mode="before")
    @classmethod
    def _server_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"type: {kind!r} is one of Anthropic's server tools, which run on Anthropic's side; "
                             "portside serves client tools only (name, description, input_schema)")
        return data

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type") != "object":
            raise ValueError("must be a JSON schema with type 'object' (the tool's input is an object)")
        return v


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError("name: required when type is 'tool'")
        if self.type != "tool" and self.name is not None:
            raise ValueError("name: only used when type is 'tool'")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError("disable_parallel_tool_use: not used when type is 'none'")
        return self


class ThinkingConfig(AnthropicModel):
    """enabled: the model reasons (templates read enable_thinking / thinking), its reasoning comes
    back as thinking blocks; disabled: no reasoning; adaptive: the template's own default."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens: required when type is 'enabled'")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError("budget_tokens: only used when type is 'enabled'")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise ValueError(f"budget_tokens: must be at least 1, got {self.budget_tokens}")
        if self.type == "disabled" and self.display is not None:
            raise ValueError("display: not used when type is 'disabled'")
        return self


class Metadata(AnthropicModel):
    user_id: str | None = None


class ConversationBody(AnthropicModel):
    """What both routes take: the conversation and what is shown with it."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Any = None  # a string or text blocks
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None  # accepted: the prefix cache is automatic

    @model_validator(mode="after")
    def _conversation(self) -> ConversationBody:
        if self.system is not None and not isinstance(self.system, str):
            if not isinstance(self.system, list):
                raise ValueError("system: must be a string or a list of text blocks")
            blocks = [parse_block(f"system[{j}]", b, ("text",), "system") for j, b in enumerate(self.system)]
            self.system = "\n".join(b.text for b in blocks)  # type: ignore[union-attr]
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: tool names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice: type {choice.type!r} needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice.name: {choice.name!r} is not among the tools")
        self._check_turns(set(names))
        return self

    def _check_turns(self, tools: set[str]) -> None:
        """tool_use blocks name defined tools, tool_result blocks answer the previous assistant
        message's tool_use blocks, and a final assistant message (a prefill) holds text only."""
        previous: set[str] = set()
        for i, m in enumerate(self.messages):
            ids = set()
            for j, b in enumerate(m.blocks):
                if isinstance(b, ToolUseBlock):
                    if b.name not in tools:
                        raise ValueError(f"messages[{i}].content[{j}].name: tool {b.name!r} is not among the tools")
                    if b.id in ids:
                        raise ValueError(f"messages[{i}].content[{j}].id: {b.id!r} is used twice")
                    ids.add(b.id)
                elif isinstance(b, ToolResultBlock) and b.tool_use_id not in previous:
                    raise ValueError(f"messages[{i}].content[{j}].tool_use_id: {b.tool_use_id!r} answers no tool_use block of "
                                     "the previous assistant message")
            previous = ids if m.role == "assistant" else set()
        last = self.messages[-1]
        if last.role == "assistant" and any(not isinstance(b, TextBlock) for b in last.blocks):
            raise ValueError(f"messages[{len(self.messages) - 1}].content: a final assistant message continues the reply "
                             "(a prefill) and may hold text blocks only")


class CountTokensBody(ConversationBody):
    """POST /v1/messages/count_tokens."""


class MessagesBody(ConversationBody):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are supported")
        if any(s == "" for s in v or ()):
            raise ValueError("must not contain empty strings")
        return v

    @model_validator(mode="after")
    def _thinking_budget(self) -> MessagesBody:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens: must be less than max_tokens ({self.max_tokens}), got {budget}")
        return self


@dataclass
class Origin:
    """Where a chat message came from in the Anthropic body: the message's index (None: the
    system prompt) and, per content part, its block's index."""

    message: int | None
    blocks: list[int] = field(default_factory=list)


def chat_messages(body: ConversationBody) -> tuple[list[dict[str, Any]], list[Origin]]:
    """The conversation as chat-completions messages, and where each came from: the system
    prompt first; an assistant message's thinking as its reasoning_content, its tool_use blocks
    as tool_calls; a user message's tool_result blocks as tool messages (in place), its text and
    images as user content."""
    out: list[dict[str, Any]] = []
    origins: list[Origin] = []
    if body.system:
        out.append({"role": "system", "content": body.system})
        origins.append(Origin(None))
    for i, m in enumerate(body.messages):
        if m.role == "assistant":
            out.append(_assistant(m))
            origins.append(Origin(i))
            continue
        parts: list[dict[str, Any]] = []
        origin = Origin(i)
        for j, b in enumerate(m.blocks):
            if isinstance(b, ToolResultBlock):
                if parts:
                    out.append(_user(parts))
                    origins.append(origin)
                    parts, origin = [], Origin(i)
                text = tool_result_text(f"messages[{i}].content[{j}]", b)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": f"Error: {text}" if b.is_error else text})
                origins.append(Origin(i, [j]))
            elif isinstance(b, ImageBlock):
                parts.append({"type": "image_url", "image_url": {"url": image_url(f"messages[{i}].content[{j}]", b)}})
                origin.blocks.append(j)
            elif isinstance(b, TextBlock):
                parts.append({"type": "text", "text": b.text})
                origin.blocks.append(j)
        if parts:
            out.append(_user(parts))
            origins.append(origin)
    return out, origins


_CHAT_PARAM = re.compile(r"messages\[(\d+)\](?:\.content\[(\d+)\])?")


def anthropic_param(text: str, origins: list[Origin]) -> str:
    """`text` (an error's message or param) with the chat messages it names ("messages[2].content[1]")
    named as the Anthropic body has them."""

    def name(m: re.Match[str]) -> str:
        i = int(m.group(1))
        if i >= len(origins):
            return m.group(0)
        o = origins[i]
        if o.message is None:
            return "system"
        part = m.group(2)
        if part is None:
            return f"messages[{o.message}]"
        k = int(part)
        return f"messages[{o.message}].content[{o.blocks[k] if k < len(o.blocks) else k}]"

    return _CHAT_PARAM.sub(name, text, count=1)


def _user(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if all(p["type"] == "text" for p in parts):
        return {"role": "user", "content": "".join(p["text"] for p in parts)}
    return {"role": "user", "content": parts}


def _assistant(m: InputMessage) -> dict[str, Any]:
    text = "".join(b.text for b in m.blocks if isinstance(b, TextBlock))
    reasoning = "".join(b.thinking for b in m.blocks if isinstance(b, ThinkingBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in m.blocks if isinstance(b, ToolUseBlock)]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def chat_tools(body: ConversationBody) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    out = []
    for t in body.tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        if t.strict is not None:
            fn["strict"] = t.strict
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(body: ConversationBody) -> tuple[Any, bool]:
    """tool_choice (OpenAI's value, None for the default) and parallel_tool_calls."""
    choice = body.tool_choice
    if not body.tools:
        return None, True
    if choice is None:
        return "auto", True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel
