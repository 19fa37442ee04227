"""Request bodies of the OpenAI-compatible API (pydantic models, validated in JSON mode).

Validation is strict about types (``"max_tokens": "5"`` is a 400, not a silent cast), about
ranges the API documents, and about fields: a field portside does not act on is a 400 naming it,
never silently ignored (the `openai` client sends only the fields a caller sets). Range checks
that `SamplingParams` already makes are left to it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from portside.sampling_params import MAX_BEAM_WIDTH, MAX_BEST_OF

MAX_N = 128  # OpenAI's documented upper bound for `n`
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; vLLM has no bound)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("json_schema: only allowed when type is 'json_schema'")
        return self


class StructuredOutputsBody(OpenAIModel):
    """vLLM's `structured_outputs` request field (as `portside.StructuredOutputsParams`)."""

    json_: Any = Field(None, alias="json")  # a JSON schema object (or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool = False  # accepted; portside never adds obfuscation padding
    continuous_usage_stats: bool = False  # vLLM extra (usage on every chunk): not supported, refused

    @model_validator(mode="after")
    def _check(self) -> StreamOptions:
        if self.continuous_usage_stats:
            raise ValueError("continuous_usage_stats: not supported; use include_usage (usage in the last chunk)")
        return self


# fields a beam-search request may not set (their defaults are fine)
BEAM_SEARCH_EXCLUDES = (
    "stream", "best_of", "logprobs", "top_logprobs", "prompt_logprobs", "stop", "stop_token_ids", "logit_bias",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p", "top_p", "top_k",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools",
)


class SamplingFields(OpenAIModel):
    """The sampling fields both endpoints share (OpenAI's plus vLLM's extras)."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Any = None  # str | list[str]; checked below for a clear message
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_BEST_OF)  # sample best_of, return the n most likely
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM extra; capped by --max-logprobs
    # beam search (vLLM's extra fields): n is the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def _check_beam_search(self) -> None:
        """Beam search ranks beams by the model's own logprobs and stops at EOS or max_tokens:
        a field that would change that is refused, never ignored."""
        if not 1 <= self.n <= MAX_BEAM_WIDTH:
            raise ValueError(f"n: the beam width with use_beam_search, from 1 to {MAX_BEAM_WIDTH}, got {self.n}")
        if "temperature" in self.model_fields_set and self.temperature not in (None, 0, 0.0):
            raise ValueError("temperature: beam search is deterministic; use 0 (or leave it out) with use_beam_search")
        for name in BEAM_SEARCH_EXCLUDES:
            if name in self.model_fields_set and getattr(self, name, None) not in (None, False, [], {}):
                raise ValueError(f"{name}: not supported with use_beam_search")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are supported")
        if any(s == "" for s in v):
            raise ValueError("must not contain empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {key} must be in [-100, 100], got {bias}")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.use_beam_search:
            self._check_beam_search()
        elif self.length_penalty != 1.0:
            raise ValueError("length_penalty: only used with use_beam_search")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true (as vLLM)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be at least n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of: greater than n cannot be streamed (the best samples are known only at the end)")
        return self


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Any  # str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)  # capped by --max-logprobs
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> list[str] | list[list[int]]:
        """Normalise to a non-empty list of text prompts or of token-id prompts."""
        return _prompt_list(v, empty_text=True)

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.echo and self.logprobs is not None and self.stream:
            raise ValueError("echo: echo with logprobs is not supported when streaming")
        return self


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


def _refuse_images(messages: list[ChatMessage] | None, endpoint: str) -> None:
    for i, m in enumerate(messages or ()):
        if m.image_urls:
            raise ValueError(f"messages[{i}].content: image parts are accepted by /v1/chat/completions only, not by {endpoint}")


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


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated alias of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # capped by --max-logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template: str | None = None  # vLLM extra
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra: e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True  # vLLM extra
    continue_final_message: bool = False  # vLLM extra

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: function {self.tool_choice.function.name!r} is not among the tools")
        if self.tool_choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice: {self.tool_choice!r} needs tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (set it false)")
        for i, m in enumerate(self.messages):
            if m.role == "tool" and m.tool_call_id is None:
                raise ValueError(f"messages[{i}].tool_call_id: required for role 'tool'")
            if m.tool_calls is not None and m.role != "assistant":
                raise ValueError(f"messages[{i}].tool_calls: only assistant messages have tool calls")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output-length limit and the field it came from (for error messages)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt_list(v: Any, empty_text: bool) -> list[str] | list[list[int]]:
    """OpenAI's prompt shapes (a string, strings, token ids, lists of token ids) as a non-empty list
    of texts or of non-empty token-id lists; `empty_text` allows "" as a text."""
    if isinstance(v, str) and (v or empty_text):
        return [v]
    if isinstance(v, list) and v:
        if all(isinstance(p, str) and (p or empty_text) for p in v):
            return v
        if all(_is_int(t) for t in v):
            return [v]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in v):
            return v
    strings = "strings" if empty_text else "non-empty strings"
    raise ValueError(f"must be a non-empty string, a list of {strings}, a non-empty list of token ids, "
                     "or a list of non-empty lists of token ids")


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest
    (`messages`, through the chat template), told apart by which of the two is sent."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (rendered by the template)
    return_token_strs: bool = False
    # messages only
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _check_tokenize(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send exactly one of prompt (text) and messages (a conversation)")
        if self.prompt is not None:
            chat_only = sorted(f for f in ("add_generation_prompt", "continue_final_message", "chat_template",
                                           "chat_template_kwargs", "tools") if f in self.model_fields_set)
            if chat_only:
                raise ValueError(f"{chat_only[0]}: applies to messages only, not to a prompt")
        _refuse_images(self.messages, "/tokenize")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (set it false)")
        return self


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings (OpenAI's fields and vLLM's extras)."""

    model: str | None = None  # vLLM's: optional (the served model)
    input: Any = None  # str | list[str] | list[int] | list[list[int]]
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # vLLM's EmbeddingChatRequest: one conversation
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep a prompt's last k tokens (-1: max_model_len)
    add_special_tokens: bool | None = None  # default: true for input, false for messages (rendered by the template)
    priority: int = 0
    # messages only
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_embedding(self) -> EmbeddingRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("input: send exactly one of input (texts or token ids) and messages (a conversation)")
        if self.input is not None:
            chat_only = sorted(f for f in ("add_generation_prompt", "continue_final_message", "chat_template",
                                           "chat_template_kwargs") if f in self.model_fields_set)
            if chat_only:
                raise ValueError(f"{chat_only[0]}: applies to messages only, not to input")
        _refuse_images(self.messages, "/v1/embeddings")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (set it false)")
        return self

    @field_validator("input")
    @classmethod
    def _check_input(cls, v: Any) -> list[str] | list[list[int]]:
        """Normalise to a non-empty list of non-empty texts or of non-empty token-id lists."""
        return _prompt_list(v, empty_text=False)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (max_model_len) or at least 1")
        return v
