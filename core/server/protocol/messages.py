"""Conversations in request bodies: messages with text and image parts, assistant tool calls,
the tool definitions and tool choice, and the checks every endpoint that renders messages
through the chat template shares."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from portside.server.protocol.common import OpenAIModel


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as the API returns it


class MessageToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail (accepted; images are processed as the model's processor does)
IMAGE_ROLES = ("user",)  # the roles whose messages may hold image parts


def _image_url(i: int, part: dict[str, Any]) -> str:
    """The URL of an image_url content part: {"image_url": {"url": ..., "detail": ...}} (OpenAI's)
    or {"image_url": "..."} (the bare string vLLM also accepts)."""
    extra = sorted(set(part) - {"type", "image_url"})
    if extra:
        raise ValueError(f"part {i}: unexpected field {extra[0]!r} in an image_url part")
    value = part.get("image_url")
    url: Any = None
    if isinstance(value, str):
        url = value
    elif isinstance(value, dict):
        extra = sorted(set(value) - {"url", "detail"})
        if extra:
            raise ValueError(f"part {i}: unexpected field image_url.{extra[0]} (an image_url part holds url and detail)")
        url = value.get("url")
        detail = value.get("detail", "auto")
        if detail not in IMAGE_DETAILS:
            raise ValueError(f"part {i}: image_url.detail must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r}")
    else:
        raise ValueError(f"part {i}: image_url must be an object {{'url': ...}} (or the URL as a string)")
    if not isinstance(url, str) or not url:
        raise ValueError(f"part {i}: image_url.url must be a non-empty string (a data:image/...;base64 URL, "
                         "or an http(s):// or file:// URL where the server allows them)")
    return url


class ChatMessage(OpenAIModel):
    """One message. `content` is what the chat template renders: a string (text parts are joined
    into one), or, for a user message with images, a list of template parts in order,
    {"type": "text", "text": ...} and {"type": "image"} (the form HF templates of vision-language
    models read); `image_urls` are the images' URLs in the same order."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(default=None, validate_default=True)  # str | list[TextPart | image_url part]; None: an assistant's tool calls
    name: str | None = None
    tool_call_id: str | None = None  # role "tool": the call this message answers
    tool_calls: list[MessageToolCall] | None = None  # role "assistant": the calls it made
    refusal: str | None = None  # an assistant's refusal: its content for the template
    reasoning_content: str | None = None  # an assistant's reasoning, for templates that show it
    # what the openai client echoes back from a response message: accepted only when null
    annotations: None = None
    audio: None = None
    function_call: None = None
    _image_urls: list[str] = PrivateAttr(default_factory=list)

    @field_validator("content")
    @classmethod
    def _check_content(cls, v: Any, info: ValidationInfo) -> str | list[dict[str, Any]] | None:
        """Text parts are flattened into one string; a user message with image_url parts keeps its
        parts in order (split into template parts and URLs after validation). Any other part type
        is a 400, as are images in other roles. Only an assistant's content may be null or missing
        (as OpenAI's: when it made tool calls or refused)."""
        role = info.data.get("role")
        if v is None:
            if role == "assistant":
                return None
            raise ValueError("is required for this role (a string or a list of content parts), got null or nothing")
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            parts: list[dict[str, Any]] = []
            has_image = False
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image_url":
                    if role is not None and role not in IMAGE_ROLES:
                        raise ValueError(f"part {i}: image parts are only accepted in user messages, not in a {role!r} message")
                    parts.append({"type": "image_url", "url": _image_url(i, part)})
                    has_image = True
                elif kind == "text":
                    raise ValueError(f"part {i}: a text part needs a string 'text'")
                elif isinstance(part, dict):
                    raise ValueError(f"part {i}: unsupported content part type {kind!r}; supported: 'text' "
                                     "({'type': 'text', 'text': ...}) and, in user messages, 'image_url' "
                                     "({'type': 'image_url', 'image_url': {'url': ...}})")
                else:
                    raise ValueError(f"part {i}: a content part must be an object with a 'type', got {type(part).__name__}")
            if not has_image:
                return "".join(p["text"] for p in parts)
            return parts
        raise ValueError("must be a string or a list of content parts")

    @model_validator(mode="after")
    def _assistant_says_something(self) -> ChatMessage:
        if self.role == "assistant" and self.content is None and not self.tool_calls and self.refusal is None:
            raise ValueError("content: an assistant message needs content, tool_calls or refusal")
        if isinstance(self.content, list):  # image_url parts -> {"type": "image"} in place, URLs aside
            self._image_urls = [p["url"] for p in self.content if p["type"] == "image_url"]
            self.content = [{"type": "image"} if p["type"] == "image_url" else p for p in self.content]
        return self

    @property
    def image_urls(self) -> list[str]:
        """The URLs of this message's images, in order (their {"type": "image"} parts' order)."""
        return list(self._image_urls)


def image_urls(messages: list[ChatMessage] | None) -> list[str]:
    """Every image URL of a conversation, in the order the template places them."""
    return [u for m in messages or () for u in m.image_urls]


def refuse_images(messages: list[ChatMessage] | None, endpoint: str) -> None:
    for i, m in enumerate(messages or ()):
        if m.image_urls:
            raise ValueError(f"messages[{i}].content: image parts are accepted by /v1/chat/completions only, not by {endpoint}")


def check_continuation(req: Any) -> None:
    """The template either opens a new assistant turn or continues the last message, not both."""
    if req.continue_final_message and req.add_generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (set it false)")


def check_prompt_or_messages(req: Any, prompt_field: str, prompt_kind: str, what: str, template_fields: tuple[str, ...],
                             endpoint: str) -> None:
    """A body that takes either a prompt (`prompt_field`, `prompt_kind` in the message) or
    `messages` through the chat template: exactly one of them, the template's fields only with
    messages (`what`: the prompt as the message names it), and no images."""
    if (getattr(req, prompt_field) is None) == (req.messages is None):
        raise ValueError(f"{prompt_field}: send exactly one of {prompt_field} ({prompt_kind}) and messages (a conversation)")
    if req.messages is None:
        chat_only = sorted(f for f in template_fields if f in req.model_fields_set)
        if chat_only:
            raise ValueError(f"{chat_only[0]}: applies to messages only, not to {what}")
    refuse_images(req.messages, endpoint)
    check_continuation(req)


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


