"""What both generation endpoints share: the serving context, request parsing, output-length
resolution, sampling parameters, engine submission with error mapping, per-choice deltas,
logprob formatting and SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from portside.engine.async_engine import AsyncLLMEngine, EngineStoppedError, QueueFullError, RequestStream
from portside.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from portside.sampling_params import RequestOutputKind, SamplingParams
from portside.server.errors import APIError, bad_request, from_validation_error, from_value_error
from portside.server.metrics import ServerMetrics
from portside.server.offload import SMALL_BYTES, Offload
from portside.server.protocol import SamplingFields
from portside.server.structured import compile_constraint, request_constraint
from portside.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def _default_media() -> Any:
    from portside.multimodal.media import MediaConnector

    return MediaConnector()  # data URLs only


@dataclass
class ServingContext:
    """Everything a handler needs; one per app."""

    engine: AsyncLLMEngine
    tokenizer: Any  # a private copy of the engine's tokenizer, used on the event loop only
    offload: Offload  # where request-sized work runs (its workers have their own tokenizers)
    served_model_names: list[str]
    max_model_len: int
    metrics: ServerMetrics
    chat_template: str | None = None
    vocab_size: int = 0
    retry_after_s: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    structured: Any = None  # the engine's StructuredOutputManager (compiles are thread-safe)
    reasoning_parser: Any = None  # a portside.reasoning.ReasoningParser (--reasoning-parser)
    tool_parser: Any = None  # a portside.tool_parsers.ToolParser class (--enable-auto-tool-choice)
    trust_request_chat_template: bool = False  # --trust-request-chat-template
    adapters: Any = None  # portside.server.lora.ServedAdapters, with --enable-lora
    response_role: str = "assistant"  # --response-role: the role of chat replies
    max_logprobs: int = 20  # --max-logprobs (the engine's max_logprobs; -1: no limit)
    default_sampling: dict[str, Any] = field(default_factory=dict)  # --generation-config: for fields a request leaves unset
    media: Any = field(default_factory=_default_media)  # a MediaConnector: where image URLs may point (--allowed-*-media-*)

    @classmethod
    def create(cls, engine: AsyncLLMEngine, served_model_names: list[str], metrics: ServerMetrics, chat_template: str | None,
               tool_parser: Any = None, trust_request_chat_template: bool = False) -> ServingContext:
        # copies keep the event loop's and the workers' tokenizers apart from the engine thread's detokenizer
        tok = copy.deepcopy(engine.engine.tokenizer)
        vocab = int(getattr(engine.engine, "vocab_size", 0) or len(tok))
        reasoning = getattr(engine.engine, "reasoning_parser", None)
        return cls(engine, tok, Offload(tok), served_model_names, engine.engine.max_model_len, metrics, chat_template, vocab,
                   structured=getattr(engine.engine, "structured", None), reasoning_parser=reasoning, tool_parser=tool_parser,
                   trust_request_chat_template=trust_request_chat_template,
                   default_sampling=dict(getattr(engine.engine, "default_sampling", None) or {}))

    async def constraint(self, req: SamplingFields, extra: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
        """The request's compiled output constraint (`extra`: one that tool_choice imposes)."""
        params, field_name = request_constraint(req)
        if req.guided_decoding_backend not in (None, "auto") and self.structured is not None and \
                req.guided_decoding_backend != self.structured.backend_name:
            raise bad_request(f"guided_decoding_backend: this server uses {self.structured.backend_name!r} "
                              "(--structured-outputs-backend); per-request backends are not supported", "guided_decoding_backend")
        if extra is not None:
            if params is not None:
                raise bad_request(f"{field_name}: cannot be combined with tool_choice 'required' or a named function", field_name)
            params, field_name = extra, "tools"
        if params is None:
            return None
        if self.structured is None:
            raise bad_request(f"{field_name}: structured output is not available on this server", field_name)
        assert field_name is not None
        await compile_constraint(self.structured, params, field_name)
        return params

    def check_model(self, name: str) -> Any:
        """The LoRA adapter `name` selects (None: the base model); 404 for a name not served."""
        if name in self.served_model_names:
            return None
        lora = self.adapters.adapters.get(name) if self.adapters is not None else None
        if lora is None:
            served = [*self.served_model_names, *(self.adapters.adapters if self.adapters is not None else ())]
            raise APIError(404, f"The model `{name}` does not exist. Served: {', '.join(served)}", param="model", code="model_not_found")
        return lora

    def decode_token(self, token_id: int, lp: Logprob | None = None) -> str:
        """A token's text alone: the engine thread's (`Logprob.decoded_token`) where there is one,
        else decoded with this thread's tokenizer (response bodies may be built on a worker)."""
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        tok = self.offload.tokenizer() if self.offload.on_worker() else self.tokenizer
        return tok.decode([token_id])


async def parse_body(ctx: ServingContext, request: Request, model: type[M]) -> tuple[M, bool]:
    """Read and validate a JSON body; any problem is a 400 naming the parameter. Also says
    whether the request is large (its body over `SMALL_BYTES`: its work goes to the large lane)."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # hung up mid-body: an abort, before the engine saw anything
        ctx.metrics.requests.labels("abort").inc()
        raise APIError(499, "client disconnected") from None
    large = len(raw) > SMALL_BYTES
    try:
        if large:
            return await ctx.offload.run(model.model_validate_json, raw, large=True), True
        return model.model_validate_json(raw or b""), False
    except ValidationError as e:
        raise from_validation_error(e) from None


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


@contextlib.contextmanager
def engine_errors(ctx: ServingContext, param: str) -> Iterator[None]:
    """Map the async engine's refusals to HTTP errors."""
    try:
        yield
    except QueueFullError as e:
        raise APIError(503, str(e), code="queue_full", headers={"Retry-After": str(ctx.retry_after_s)}) from None
    except EngineStoppedError as e:
        raise APIError(503, str(e), code="unavailable", headers={"Retry-After": str(ctx.retry_after_s)}) from None
    except ValueError as e:  # the engine's own validation
        raise from_value_error(e, default_param=param) from None


async def submit_all(ctx: ServingContext, base_id: str, prompts: list[list[int]], params: list[SamplingParams], priority: int,
                     prompt_param: str, lora_request: Any = None) -> list[RequestStream]:
    """Submit one request per prompt, all or none: the waiting limit counts every sequence of
    the batch (prompts x n) up front, and if one is refused those already accepted are aborted."""
    with engine_errors(ctx, "n"):
        ctx.engine.check_capacity(sum(p.num_samples for p in params))
    streams: list[RequestStream] = []
    try:
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            with engine_errors(ctx, prompt_param):
                streams.append(await ctx.engine.add_request(rid, ids, sp, priority=priority, check_capacity=False,
                                                            lora_request=lora_request))
    except BaseException:
        close_all(streams)
        raise
    return streams


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (prompt index, output); leaving early aborts them
    all. Nothing is buffered here: what a slow consumer has not taken stays coalesced in its stream."""
    wake = asyncio.Event()
    for s in streams:
        s.bind(wake)
    live = list(enumerate(streams))
    try:
        while live:
            wake.clear()
            progressed = False
            for entry in list(live):
                i, s = entry
                out = s.take()
                if out is not None:
                    progressed = True
                    yield i, out
                elif s.exhausted:
                    live.remove(entry)
                    progressed = True
            if not progressed:
                await wake.wait()
    finally:
        close_all(streams)


def close_all(streams: list[RequestStream]) -> None:
    """Abort every stream that has not finished (idempotent)."""
    for s in streams:
        s.close()


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that aborts its requests however it ends, even if never iterated."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self._streams)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work` but cancel it when the client disconnects (non-streaming requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if not task.done():
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        raise APIError(499, "client disconnected")
    watcher.cancel()
    return task.result()


@dataclass
class ChoiceCursor:
    """What has been sent of one streamed choice so far (its outputs are deltas)."""

    text_len: int = 0
    num_tokens: int = 0
    echo_len: int = 0  # completions with echo: the prompt text sent before the output
    finished: bool = False
    started: bool = False

    def advance(self, c: CompletionOutput) -> None:
        self.text_len += len(c.text)
        self.num_tokens += len(c.token_ids)


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely alternatives of one position, most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30, -kv[1].logprob))
    return ranked[:k]


def chat_logprobs(ctx: ServingContext, c: CompletionOutput, k: int) -> list[dict[str, Any]]:
    """Chat `logprobs.content` entries for c's tokens."""
    items = []
    for pos in range(len(c.token_ids)):
        tid = c.token_ids[pos]
        entry = c.logprobs[pos] if c.logprobs and pos < len(c.logprobs) else {}
        lp = entry.get(tid)
        token = ctx.decode_token(tid, lp)
        items.append(
            {
                "token": token,
                "logprob": max(lp.logprob, -9999.0) if lp else -9999.0,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := ctx.decode_token(i, alt)), "logprob": max(alt.logprob, -9999.0), "bytes": list(t.encode("utf-8"))}
                    for i, alt in top_entries(entry, k)
                ],
            }
        )
    return items


def completion_logprobs(ctx: ServingContext, c: CompletionOutput, k: int, text_offset: int) -> dict[str, Any]:
    """Legacy completions `logprobs` for c's tokens; offsets start at text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for pos in range(len(c.token_ids)):
        tid = c.token_ids[pos]
        entry = c.logprobs[pos] if c.logprobs and pos < len(c.logprobs) else {}
        lp = entry.get(tid)
        token = ctx.decode_token(tid, lp)
        tokens.append(token)
        token_logprobs.append(max(lp.logprob, -9999.0) if lp else -9999.0)
        top: dict[str, float] = {}
        for i, alt in top_entries(entry, k):  # most likely first: on a text collision it wins
            top.setdefault(ctx.decode_token(i, alt), max(alt.logprob, -9999.0))
        tops.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(ctx: ServingContext, pl: PromptLogprobs | None) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` response field: None for the first prompt token, then per token
    id (the prompt token and its top-k) {logprob, rank, decoded_token}; -inf reads -9999.0."""
    if pl is None:
        return None
    return [None if entry is None else {
        tid: {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": ctx.decode_token(tid, lp)}
        for tid, lp in entry.items()
    } for entry in pl]  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# a non-streamed response holding more values than this (tokens, logprob alternatives, prompt
# logprobs, text in 64-character units) is built and encoded off the event loop: at a few
# microseconds a value, one under it stalls the loop for at most some tens of milliseconds
LARGE_RESPONSE_VALUES = 8192
_JSON_PIECE_VALUES = 2048  # values per json.dumps call when encoding a large body


def response_values(finals: list[RequestOutput]) -> int:
    """About how many values the non-streamed response of `finals` holds (see LARGE_RESPONSE_VALUES)."""
    total = 0
    for out in finals:
        pl = out.prompt_logprobs
        prompt = len(pl) * len(pl[-1] or ()) if pl else 0  # completions repeat it on every choice
        for c in out.outputs:
            lp = c.logprobs
            total += len(c.text) // 64 + len(c.token_ids) + (len(lp) * len(lp[-1]) if lp else 0) + prompt
    return total


class ResponseBuilder:
    """`fn(*args)` for the response body of `outputs`, called once. Freeing the million objects
    of a large output holds the GIL as long as it takes (n=128 x 480 tokens x 21 logprobs, its
    body included: ~0.9 s in one go), so the call takes the outputs apart a slice at a time once
    the body is built, on the thread that built it, and lets go of them; the caller hands over
    its only references (`del`), so nothing large is freed on the event loop."""

    def __init__(self, fn: Callable[..., dict[str, Any]], *args: Any, outputs: list[RequestOutput]) -> None:
        self._call: Callable[[], dict[str, Any]] | None = functools.partial(fn, *args)
        self._outputs: list[RequestOutput] | None = outputs

    def __call__(self) -> dict[str, Any]:
        call, self._call = self._call, None
        outputs, self._outputs = self._outputs, None
        assert call is not None and outputs is not None, "a response is built once"
        body = call()
        del call
        for out in outputs:
            release(out.prompt_logprobs)
            for c in out.outputs:
                release(c.logprobs)
        return body


async def json_response(ctx: ServingContext, build: ResponseBuilder, values: int) -> Response:
    """The JSON response of a non-streamed request: `build()` and its encoding on the event loop
    when it holds up to LARGE_RESPONSE_VALUES values, else on the large offload lane (not
    refused when the lane is busy: the generation is done), encoded in pieces."""
    if values <= LARGE_RESPONSE_VALUES:
        return JSONResponse(build())
    body = await ctx.offload.run(_build_and_encode, build, large=True, refusable=False)
    return Response(body, media_type="application/json")


def _build_and_encode(build: ResponseBuilder) -> bytes:
    body = build()
    try:
        return encode_json(body)
    finally:
        release(body)


def release(obj: Any) -> None:
    """Empty a large list or dict (and the large ones inside it) a slice of about
    _JSON_PIECE_VALUES values at a time: freeing them all in one go holds the GIL throughout."""
    if not isinstance(obj, (dict, list)) or _weight(obj) <= _JSON_PIECE_VALUES:
        return
    if isinstance(obj, dict):
        for value in obj.values():
            release(value)
        obj.clear()
        return
    step = _piece_step(obj)
    while obj:
        if step == 1:
            release(obj[-1])
        del obj[-step:]


def encode_json(obj: Any) -> bytes:
    """`obj` as JSONResponse encodes it (the same bytes), but in pieces of about
    _JSON_PIECE_VALUES values, each one json.dumps call: a C call holds the GIL throughout, and
    one over a whole 24 MB body would stall the event loop for seconds."""
    pieces: list[bytes] = []
    _encode_pieces(obj, pieces)
    return b"".join(pieces)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _weight(obj: Any) -> int:
    """About how many scalar values `obj` holds (a list counted by its first and last elements)."""
    if isinstance(obj, dict):
        return max(1, sum(_weight(v) for v in obj.values()))
    if isinstance(obj, (list, tuple)) and obj:
        return len(obj) * max(_weight(obj[0]), _weight(obj[-1]))
    return 1


def _piece_step(items: list[Any]) -> int:
    """How many elements of a non-empty list make a piece of about _JSON_PIECE_VALUES values."""
    return max(1, _JSON_PIECE_VALUES // max(_weight(items[0]), _weight(items[-1])))


def _encode_pieces(obj: Any, out: list[bytes]) -> None:
    if not isinstance(obj, (dict, list)) or _weight(obj) <= _JSON_PIECE_VALUES or \
            (isinstance(obj, dict) and not all(isinstance(k, str) for k in obj)):
        out.append(_dumps(obj).encode())
        return
    if isinstance(obj, dict):
        out.append(b"{")
        for j, (key, value) in enumerate(obj.items()):
            out.append(f"{',' if j else ''}{_dumps(key)}:".encode())
            _encode_pieces(value, out)
        out.append(b"}")
        return
    step = _piece_step(obj)
    out.append(b"[")
    for i in range(0, len(obj), step):
        if i:
            out.append(b",")
        if step == 1:
            _encode_pieces(obj[i], out)
        else:
            out.append(_dumps(obj[i : i + step])[1:-1].encode())
    out.append(b"]")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


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


async def collect(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    """Drain merged outputs; the last output of each prompt."""
    finals: list[RequestOutput | None] = [None] * count
    try:
        async for i, out in outputs:
            finals[i] = out
    except EngineStoppedError as e:  # the engine (a data-parallel replica) failed under the request
        raise APIError(503, str(e), code="unavailable") from None
    if not all(f is not None and f.finished for f in finals):  # aborted by a shutdown
        raise APIError(503, "the request was aborted: the server is shutting down", code="aborted")
    return finals  # type: ignore[return-value]


def openai_finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons as OpenAI's ("abort" never reaches a client that is still there)."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"
