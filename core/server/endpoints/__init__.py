"""The server's endpoints, one module per family; `ENDPOINTS` is the route table `build_app`
registers, in order.

Each module exports `ROUTES`, a tuple of `portside.server.context.Route`s whose handlers take the
app's `ServingContext` and the request. A generate endpoint is a `pipeline.GenerateAPI` adapter
served by `pipeline.generate_route(path, Adapter)`: the shared stages (validation, output length,
structured output and tool constraints, sampling parameters with the generation config's
defaults, submission, SSE or one JSON body, usage, error mapping) are the pipeline's, so a new
API is its request body, `prepare`, `response` and `events`: one file, and one line below.
"""

from portside.server.endpoints import (
    chat,
    classify,
    completions,
    dev,
    embeddings,
    lora_admin,
    messages,
    models,
    ops,
    pooling,
    rerank,
    responses,
    score,
    tokenize,
)

ENDPOINTS = (
    ops,  # /health, /metrics, /version
    models,  # /v1/models, /v1/models/{model_id}
    tokenize,  # /tokenize, /detokenize
    embeddings,  # /v1/embeddings (--runner pooling: an embedding model)
    score,  # /score, /v1/score (pooling: cross-encoder or embedding cosine)
    rerank,  # /rerank, /v1/rerank (Jina), /v2/rerank (Cohere)
    classify,  # /classify (pooling: a classifier)
    pooling,  # /pooling (pooling: the model's raw vectors)
    lora_admin,  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    completions,  # /v1/completions
    chat,  # /v1/chat/completions
    responses,  # /v1/responses, /v1/responses/{response_id}
    messages,  # /v1/messages, /v1/messages/count_tokens (Anthropic)
    dev,  # /sleep, /wake_up, /pause, /resume, /collective_rpc, ... (--enable-dev-endpoints)
)
