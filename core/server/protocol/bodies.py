"""The request body of each endpoint (pydantic models, validated in JSON mode), built from the
shared parts in `common` and `messages`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from portside.server.protocol.common import OpenAIModel, SamplingFields, prompt_list
from portside.server.protocol.messages import (
    ChatMessage,
    NamedToolChoice,
    Tool,
    check_continuation,
    check_prompt_or_messages,
)

_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs")


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
        return prompt_list(v, empty_text=True)

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.echo and self.logprobs is not None and self.stream:
            raise ValueError("echo: echo with logprobs is not supported when streaming")
        return self


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
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # gpt-oss: its harmony system message; else a template variable
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
        check_continuation(self)
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
        check_prompt_or_messages(self, "prompt", "text", "a prompt", (*_TEMPLATE_FIELDS, "tools"), "/tokenize")
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
        check_prompt_or_messages(self, "input", "texts or token ids", "input", _TEMPLATE_FIELDS, "/v1/embeddings")
        return self

    @field_validator("input")
    @classmethod
    def _check_input(cls, v: Any) -> list[str] | list[list[int]]:
        """Normalise to a non-empty list of non-empty texts or of non-empty token-id lists."""
        return prompt_list(v, empty_text=False)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (max_model_len) or at least 1")
        return v
