"""The shared parts of the request bodies: the strict base model, the sampling fields every
generate endpoint takes (OpenAI's plus vLLM's extras), output constraints, stream options and
OpenAI's prompt shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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



def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompt_list(v: Any, empty_text: bool) -> list[str] | list[list[int]]:
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

