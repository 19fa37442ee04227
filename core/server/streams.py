"""Engine submission and what comes back: a request's prompts added all or none, their output
streams interleaved, drained or streamed, aborted however the HTTP request ends, and the async
engine's refusals mapped to HTTP errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from portside.engine.async_engine import EngineStoppedError, QueueFullError, RequestStream
from portside.engine.rl_engine import EngineAsleepError
from portside.outputs import RequestOutput
from portside.sampling_params import SamplingParams
from portside.server.context import ServingContext
from portside.server.errors import APIError, from_value_error

T = TypeVar("T")
Prompt = list[int] | dict[str, Any]  # token ids, or a processed multimodal prompt ({"prompt_token_ids", "mm_features", ...})


@contextlib.contextmanager
def engine_errors(ctx: ServingContext, param: str) -> Iterator[None]:
    """Map the async engine's refusals to HTTP errors."""
    try:
        yield
    except QueueFullError as e:
        raise APIError(503, str(e), code="queue_full", headers={"Retry-After": str(ctx.retry_after_s)}) from None
    except (EngineStoppedError, EngineAsleepError) as e:  # asleep: a request that met the engine falling asleep
        raise APIError(503, str(e), code="unavailable", headers={"Retry-After": str(ctx.retry_after_s)}) from None
    except ValueError as e:  # the engine's own validation
        raise from_value_error(e, default_param=param) from None


async def submit_all(ctx: ServingContext, base_id: str, prompts: list[Prompt], params: list[SamplingParams], priority: int,
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

