"""The generate pipeline: what every endpoint that generates text does, in one place.

An API (chat completions, completions; next Anthropic Messages and OpenAI Responses) is an
adapter: a `GenerateAPI` subclass that says how its body becomes a `Job` (the prompts and what
the request asks of the output) and how outputs become its response body and stream events.
`generate` runs the stages between, the same for every API:

1. validate: the served task checked, the body parsed into the API's model (a 400 naming the
   field), its `model` resolved to the base model or a LoRA adapter (404 for neither);
2. prompt: `api.prepare()`, the adapter's own part (rendering or tokenizing, images, the tool plan);
3. output length: each prompt's limit (`resolve_max_tokens`: 400 when it cannot fit);
4. constraint: structured output, or what tool_choice imposes, compiled off the loop;
5. sampling: `SamplingParams` from the request, a field it leaves unset from the model's
   generation config (`--generation-config`), else OpenAI's default;
6. submission: every prompt added all or none (`streams.submit_all`), or beam search stepped
   over the engine;
7. output: SSE events (`api.events`, framed by `api.sse`, closed by `api.stream_end`) or one
   JSON body (`api.response`, built and encoded off the loop when large), each with `usage`;
8. errors: a refusal before the first byte is an `APIError` (counted as rejected, `counted`);
   a failure mid-stream is one error event (`api.error_event`); anything else a logged 500.

Pooling endpoints (embeddings) share stages 1 and 6 through `pool`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from portside.engine.async_engine import EngineStoppedError
from portside.outputs import RequestOutput
from portside.sampling_params import RequestOutputKind, SamplingParams
from portside.server.beam_search import beam_search
from portside.server.context import Route, ServingContext, parse_body
from portside.server.errors import APIError, bad_request, from_value_error
from portside.server.json_body import ResponseBuilder, json_response, response_values
from portside.server.protocol.common import SamplingFields
from portside.server.streams import (
    EngineStreamingResponse,
    Prompt,
    collect,
    merged,
    submit_all,
    until_disconnected,
)
from portside.server.structured import compile_constraint, request_constraint
from portside.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=BaseModel)
SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Job:
    """One generate request, as its API prepared it for the pipeline (stage 2)."""

    prompts: list[Prompt]  # one engine request each: token ids, or a processed multimodal prompt
    prompt_param: str  # the field a prompt's error names ("messages", "prompt")
    max_tokens: int | None = None  # the requested output limit (None: what the context leaves)
    max_tokens_field: str = "max_tokens"  # the field it came from; errors name it
    logprobs: int | None = None  # top logprobs per output token
    prompt_logprobs: int | None = None  # at least this many prompt logprobs (else the request's)
    constraint: StructuredOutputsParams | None = None  # what the API imposes (tool_choice); a 400 beside the request's own
    constrain_reasoning: bool = True  # False: the constraint holds from the first token (the API splits no reasoning off)
    skip_special_tokens: bool | None = None  # None: the request's
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # what the API stops on besides the request's
    request_id: str = ""  # set by the pipeline, before submission
    created: int = 0  # idem: the response's `created`

    def prompt_ids(self) -> list[list[int]]:
        return [p["prompt_token_ids"] if isinstance(p, dict) else p for p in self.prompts]

    def mm_features(self) -> list[Any]:
        """Each prompt's processed images (None for a text prompt)."""
        return [p.get("mm_features") if isinstance(p, dict) else None for p in self.prompts]


class GenerateAPI(Generic[B]):
    """An API over the generate pipeline, one instance per request: `req` is its parsed body,
    `large` whether its work goes to the large offload lane. A subclass sets the class attributes
    and implements `prepare`, `response` and `events`; `fields` and the framing hooks default to
    OpenAI's."""

    name: ClassVar[str]  # as a refusal names the API ("Chat Completions")
    body: ClassVar[type[BaseModel]]  # the request body's model
    id_prefix: ClassVar[str]  # response ids are f"{id_prefix}-{uuid}"
    stream_end: ClassVar[str | None] = SSE_DONE  # sent after the last event

    def __init__(self, ctx: ServingContext, req: B, large: bool) -> None:
        self.ctx = ctx
        self.req = req
        self.large = large

    def fields(self) -> SamplingFields:
        """The request's sampling fields under OpenAI's names, which the pipeline reads (model,
        stream, priority, beam search, sampling): the body itself when it is a `SamplingFields`;
        an API whose body differs maps it onto one."""
        assert isinstance(self.req, SamplingFields), f"{type(self).__name__}: map the body onto SamplingFields in fields()"
        return self.req

    async def prepare(self) -> Job:
        """Stage 2: the request's prompts (rendered or tokenized, on the offload lanes) and what it
        asks of the output; every problem a 400 naming the field."""
        raise NotImplementedError

    def response(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        """The non-streamed body, from each prompt's final output (may run on a worker thread)."""
        raise NotImplementedError

    def events(self, job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        """The streamed events' payloads, from (prompt index, delta output) pairs."""
        raise NotImplementedError

    def sse(self, payload: dict[str, Any]) -> str:
        """One server-sent event."""
        return sse(payload)

    def error_event(self, e: BaseException) -> str:
        """The event for an error after the stream started."""
        return stream_error(e)


async def generate(api_cls: type[GenerateAPI[Any]], ctx: ServingContext, request: Request) -> Response:
    """Serve one request of `api_cls` through every stage (see the module's docstring)."""
    ctx.require_task("generate", api_cls.name)  # a --task embed server only embeds
    body, large = await parse_body(ctx, request, api_cls.body)
    api = api_cls(ctx, body, large)
    req = api.fields()
    lora = ctx.check_model(req.model)
    job = await api.prepare()
    params = await sampling(ctx, req, job)
    job.request_id, job.created = new_id(api_cls.id_prefix), int(time.time())
    if req.use_beam_search:
        finals = await beam_search(ctx, request, job.request_id, job.prompt_ids(), [p.max_tokens or 1 for p in params], req,
                                   lora, job.prompt_param, job.mm_features())
    else:
        streams = await submit_all(ctx, job.request_id, job.prompts, params, req.priority, job.prompt_param, lora)
        if req.stream:
            return EngineStreamingResponse(_framed(api, job, merged(streams)), streams)
        finals = await until_disconnected(request, collect(merged(streams), len(streams)))
    build, values = ResponseBuilder(api.response, job, finals, outputs=finals), response_values(finals)
    del finals  # build holds the only reference: a large output is freed off the loop
    return await json_response(ctx, build, values)


def generate_route(path: str, api_cls: type[GenerateAPI[Any]]) -> Route:
    """The POST route serving `api_cls` through the pipeline."""
    return Route("POST", path, functools.partial(generate, api_cls), counted=True)


async def pool(ctx: ServingContext, request: Request, request_id: str, prompts: list[Prompt], priority: int,
               prompt_param: str, lora: Any) -> list[RequestOutput]:
    """Stage 6 for a pooling endpoint: one request per prompt, all or none, and their finished
    outputs (`RequestOutput.pooled`); cancelled when the client disconnects."""
    params = [SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)] * len(prompts)
    streams = await submit_all(ctx, request_id, prompts, params, priority, prompt_param, lora)
    return await until_disconnected(request, collect(merged(streams), len(streams)))


async def counted(ctx: ServingContext, work: Awaitable[Response]) -> Response:
    """Stage 8 around a request the engine serves: a refusal (bad input, unknown model, queue
    full) counts as rejected, a client that left mid-request is the engine's abort, and an
    unexpected failure is logged and answered with a bare 500."""
    try:
        return await work
    except APIError as e:
        if e.status != 499:
            ctx.metrics.rejected()
        raise
    except Exception:
        logger.exception("error serving a generation request")
        ctx.metrics.requests.labels("error").inc()
        raise APIError(500, "internal server error; see the server log") from None


async def sampling(ctx: ServingContext, req: SamplingFields, job: Job) -> list[SamplingParams]:
    """Stages 3-5: each prompt's output limit, the output constraint, and its SamplingParams."""
    explicit = job.max_tokens_field in req.model_fields_set
    limits = [resolve_max_tokens(job.max_tokens, job.max_tokens_field, explicit, len(ids), ctx.max_model_len, job.prompt_param)
              for ids in job.prompt_ids()]
    structured = await output_constraint(ctx, req, job.constraint)
    if structured is not None and not job.constrain_reasoning:
        structured = dataclasses.replace(structured, after_reasoning=False)
    params = [sampling_params(req, max_tokens=limit, logprobs=job.logprobs, renames={"max_tokens": job.max_tokens_field},
                              structured=structured, skip_special_tokens=job.skip_special_tokens, defaults=ctx.default_sampling,
                              prompt_logprobs=job.prompt_logprobs) for limit in limits]
    for p in params:
        own = list(p.stop_token_ids or [])
        p.stop_token_ids = own + [t for t in job.stop_token_ids if t not in own]
    return params


def resolve_max_tokens(requested: int | None, field_name: str, explicit: bool, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    """The output-length limit for one prompt, or a 400 when the prompt or limit do not fit."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt ({prompt_param}) has {prompt_len} tokens "
            "(the prompt must leave room for at least one output token); shorten the prompt",
            prompt_param,
        )
    if requested is None:
        return room
    if requested < 1:
        raise bad_request(f"{field_name} must be at least 1, got {requested}", field_name)
    if requested > room:
        if not explicit:
            return room  # the endpoint's default, not the user's choice: fit it to the context
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} tokens "
            f"and {field_name} is {requested}, {prompt_len + requested} in total; lower {field_name}",
            field_name,
        )
    return requested


async def output_constraint(ctx: ServingContext, req: SamplingFields,
                            extra: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
    """The request's compiled output constraint (`extra`: one that tool_choice imposes)."""
    params, field_name = request_constraint(req)
    if req.guided_decoding_backend not in (None, "auto") and ctx.structured is not None and \
            req.guided_decoding_backend != ctx.structured.backend_name:
        raise bad_request(f"guided_decoding_backend: this server uses {ctx.structured.backend_name!r} "
                          "(--structured-outputs-backend); per-request backends are not supported", "guided_decoding_backend")
    if extra is not None:
        if params is not None:
            raise bad_request(f"{field_name}: cannot be combined with tool_choice 'required' or a named function", field_name)
        params, field_name = extra, "tools"
    if params is None:
        return None
    if ctx.structured is None:
        raise bad_request(f"{field_name}: structured output is not available on this server", field_name)
    assert field_name is not None
    await compile_constraint(ctx.structured, params, field_name)
    return params


def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None, renames: dict[str, str] | None = None,
                    structured: StructuredOutputsParams | None = None, skip_special_tokens: bool | None = None,
                    defaults: dict[str, Any] | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from request fields; a field left unset takes `defaults` (the model's
    generation config, `ServingContext.default_sampling`), else OpenAI's default. Without an
    explicit max_tokens the output length is also capped by a default max_tokens, as vLLM does.
    A stream gets deltas (coalesced while its client is slow); any other request only its final output.
    `prompt_logprobs`: at least this many prompt logprobs (completions' echo with logprobs)."""
    defaults = defaults or {}

    def pick(value: Any, name: str, fallback: Any) -> Any:
        return defaults.get(name, fallback) if value is None else value

    sent = req.model_fields_set & {"max_tokens", "max_completion_tokens"}
    if "max_tokens" in defaults and all(getattr(req, f) is None for f in sent):
        max_tokens = min(max_tokens, defaults["max_tokens"])
    kwargs: dict[str, Any] = dict(
        n=req.n,
        best_of=req.best_of,
        prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else max(prompt_logprobs, req.prompt_logprobs or 0),
        temperature=pick(req.temperature, "temperature", 1.0),
        top_p=pick(req.top_p, "top_p", 1.0),
        top_k=pick(req.top_k, "top_k", -1),
        min_p=pick(req.min_p, "min_p", 0.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
        seed=req.seed,
        stop=list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e, renames=renames) from None


async def _framed(api: GenerateAPI[Any], job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    """Stage 7 for a stream: the API's events as SSE, an error after the start as one more event."""
    try:
        async for payload in api.events(job, outputs):
            yield api.sse(payload)
    except Exception as e:
        yield api.error_event(e)
    if api.stream_end is not None:
        yield api.stream_end


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stream_error(e: BaseException) -> str:
    """An error that happens after the stream started: one SSE event with an error body."""
    if isinstance(e, APIError):
        return sse(e.body())
    if isinstance(e, EngineStoppedError):  # the engine (a data-parallel replica) failed under the request
        return sse(APIError(503, str(e), code="unavailable").body())
    logger.exception("error while streaming", exc_info=e)
    return sse(APIError(500, "internal server error; see the server log").body())
