"""Request bodies of the OpenAI-compatible API (pydantic models, validated in JSON mode).

Validation is strict about types (``"max_tokens": "5"`` is a 400, not a silent cast), about
ranges the API documents, and about fields: a field portside does not act on is a 400 naming it,
never silently ignored (the `openai` client sends only the fields a caller sets). Range checks
that `SamplingParams` already makes are left to it.

`common`: the strict base model and the sampling fields every generate endpoint shares;
`messages`: conversations, images and tools; `bodies`: one body per endpoint. An endpoint
module imports from those; this package re-exports them for callers outside the server.
"""

from portside.server.protocol.bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from portside.server.protocol.common import (
    BEAM_SEARCH_EXCLUDES,
    MAX_N,
    MAX_STOP,
    JsonSchemaFormat,
    OpenAIModel,
    ResponseFormat,
    SamplingFields,
    StreamOptions,
    StructuredOutputsBody,
    prompt_list,
)
from portside.server.protocol.messages import (
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    Tool,
    image_urls,
)

__all__ = [
    "BEAM_SEARCH_EXCLUDES", "MAX_N", "MAX_STOP", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
    "DetokenizeRequest", "EmbeddingRequest", "FunctionCall", "FunctionDefinition", "JsonSchemaFormat", "MessageToolCall",
    "NamedFunction", "NamedToolChoice", "OpenAIModel", "ResponseFormat", "SamplingFields", "StreamOptions",
    "StructuredOutputsBody", "TextPart", "TokenizeRequest", "Tool", "image_urls", "prompt_list",
]
