"""asyncio front of the synchronous `LLMEngine`.

One background thread owns the engine: it applies queued adds and aborts, runs `engine.step()`
while there is work, and hands each step's outputs to the event loop with
`loop.call_soon_threadsafe`. The event loop never blocks on model compute, and the engine (not
thread-safe) is only ever touched from that thread.

Each request gets a `RequestStream`: an async iterator of `RequestOutput`s (of the request's
`output_kind`; unread ones coalesced) that ends after the finished one. Closing a stream before
it finishes aborts the request; the engine frees its KV blocks on the next step.

While it runs, full garbage collections happen when the engine is idle, and the allocator's free
pages go back to the OS then (`portside.engine.memory_hygiene`); each request that ends is
reported as a `RequestRecord` (`portside.engine.stats`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from portside.contract.memory import release_free_memory
from portside.engine.async_control import AsyncEngineControl
from portside.engine.memory_hygiene import IDLE_GC_S, FullCollections
from portside.engine.stats import RequestRecord, RequestTimings
from portside.outputs import RequestOutput
from portside.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class SyncEngine(Protocol):
    """The part of `LLMEngine` the async engine drives."""

    tokenizer: Any
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams, *, priority: int = 0,
                    lora_request: Any = None) -> None: ...
    def abort_request(self, request_ids: str | list[str]) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> Any: ...
    def shutdown(self) -> None: ...


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class EngineStoppedError(RuntimeError):
    """The engine no longer accepts requests: it is shutting down or its step loop died."""


def check_waiting_limit(limit: int | None, num_waiting: int, num_seqs: int) -> None:
    """`QueueFullError` unless `num_seqs` more sequences may wait beside `num_waiting` under
    `limit` (None: no limit); ValueError when that many could never wait at once."""
    if limit is None:
        return
    if num_seqs > limit:
        raise ValueError(f"the request has {num_seqs} sequences (prompts x n), more than the {limit} this server "
                         "lets wait at once (--max-waiting-requests); send fewer prompts or a smaller n")
    if num_waiting + num_seqs > limit:
        raise QueueFullError(f"too many waiting requests ({num_waiting} sequences of at most {limit}); retry later")


HEALTH_CHECK_S = 1.0  # while idle, how often the engine's `check_health` (when it has one) runs


async def generate_outputs(engine: Any, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams,
                           priority: int) -> AsyncIterator[RequestOutput]:
    """Add a request to `engine` (an `AsyncLLMEngine`, or a front with its `add_request`) and yield
    its outputs; leaving early aborts it."""
    stream = await engine.add_request(request_id, prompt, params, priority=priority)
    try:
        async for out in stream:
            yield out
    finally:
        stream.close()


class RequestStream:
    """The outputs of one request, in order; ends after the finished output.

    Outputs a consumer has not taken yet are coalesced into one pending output (DELTA outputs
    folded together, others replaced by the newer), so a consumer that reads slowly, or not at
    all, holds at most one output's worth of memory rather than a copy per engine step.
    """

    def __init__(self, owner: AsyncLLMEngine, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self._owner = owner
        self._delta = params.output_kind is RequestOutputKind.DELTA
        self.params = params
        self.num_seqs = params.num_samples  # best_of > n: every sample drawn waits
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ended = False  # nothing will be added any more
        self._wake = asyncio.Event()
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.finished = False
        self.timings = RequestTimings(arrival_time=time.monotonic())  # for its `RequestRecord`
        self.lora_request: Any = None  # the LoRA adapter it runs with

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = self.take()
            if out is not None:
                yield out
            elif self._ended:
                return
            else:
                self._wake.clear()
                await self._wake.wait()

    def take(self) -> RequestOutput | None:
        """What arrived since the last take, as one output (None: nothing yet, or the end);
        raises the failure that ended the stream once everything before it was taken."""
        out, self._pending = self._pending, None
        if out is None and self._error is not None:
            raise self._error
        return out

    @property
    def exhausted(self) -> bool:
        """Ended, and everything taken."""
        return self._ended and self._pending is None and self._error is None

    def bind(self, wake: asyncio.Event) -> None:
        """Signal `wake` (shared by the streams of one HTTP request) instead of the stream's own."""
        self._wake = wake
        if self._pending is not None or self._ended:
            wake.set()

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self._owner.abort(self.request_id)

    # called on the event loop by the owner
    def _put(self, out: RequestOutput, now: float) -> None:
        self.timings.observe(out, now, self._delta)
        if self._pending is not None and self._delta:
            self._pending.add(out)
        else:
            self._pending = out
        self._wake.set()

    def _end(self, error: BaseException | None = None) -> None:
        self._ended = True
        self._error = error
        self._wake.set()


class AsyncLLMEngine(AsyncEngineControl):
    """Runs a `SyncEngine` on a background thread and streams outputs to asyncio callers.

    `max_waiting_requests` bounds the sequences (a request's n samples each) that have been
    accepted but not yet produced a token; past it `add_request` raises `QueueFullError`.
    `on_request_done` is called on the event loop with a `RequestRecord` for every request that
    ends. `manage_gc`: full garbage collections while it runs as `FullCollections` says
    (process-wide; restored by `shutdown`); a `FullCollections` instance instead: one that several
    async engines share, started and stopped by its owner (`portside.engine.data_parallel`).
    `engine_index` and `name`: the data-parallel replica this is (records and error messages).

    While idle, the engine's `check_health()` (if it has one) runs every HEALTH_CHECK_S: a worker
    process that died between requests stops the step loop (`is_running` turns False) at once,
    not when the next request arrives.
    """

    def __init__(
        self,
        engine: SyncEngine,
        *,
        max_waiting_requests: int | None = None,
        on_request_done: Callable[[RequestRecord], None] | None = None,
        on_step: Callable[[Any], None] | None = None,
        manage_gc: bool | FullCollections = True,
        engine_index: int = 0,
        name: str = "the engine",
    ) -> None:
        self.engine = engine
        self.engine_index = engine_index
        self.name = name
        self.max_waiting_requests = max_waiting_requests
        self.on_request_done = on_request_done
        self.on_step = on_step  # called on the event loop with each step's `EngineStats`
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._commands: list[tuple[str, Any]] = []  # guarded by _cv
        self._cv = threading.Condition()
        self._stop = False
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_stats: Any = None
        self._owns_gc = manage_gc is True
        self._gc = manage_gc if isinstance(manage_gc, FullCollections) else FullCollections() if manage_gc else None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop; call from inside the running event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._last_stats = self.engine.stats()
        if self._gc is not None and self._owns_gc:
            self._gc.start()
        self._thread = threading.Thread(target=self._run, name="portside-engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    @property
    def error(self) -> BaseException | None:
        """What stopped the step loop (None while it runs)."""
        return self._error

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_unfinished_seqs(self) -> int:
        """Sequences (a request's n samples each) accepted and not finished."""
        return sum(s.num_seqs for s in self._streams.values())

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    @property
    def num_waiting(self) -> int:
        """Sequences (a request's n samples each) accepted that have not produced a token yet."""
        return sum(s.num_seqs for s in self._streams.values() if s.timings.first_token_time is None)

    @property
    def supports_images(self) -> bool:
        return bool(getattr(self.engine, "supports_images", False))

    async def process_multimodal(self, prompt: dict[str, Any], add_special_tokens: bool = True) -> dict[str, Any]:
        """`LLMEngine.process_multimodal` in a worker thread: images are processed off both the
        event loop and the engine thread. Returns the prompt dict to pass to `add_request`."""
        if not self.supports_images:
            raise ValueError(f"{self.name}'s model does not take images (it is not a vision-language model)")
        return await asyncio.to_thread(self.engine.process_multimodal, prompt, add_special_tokens)  # type: ignore[attr-defined]

    def num_using(self, lora_int_id: int) -> int:
        """Unfinished requests running with the LoRA adapter `lora_int_id`."""
        return sum(1 for s in self._streams.values() if s.lora_request is not None and s.lora_request.lora_int_id == lora_int_id)

    def check_capacity(self, num_seqs: int) -> None:
        """Raise `QueueFullError` unless `num_seqs` more sequences may wait now, or ValueError
        when that many could never wait at once."""
        check_waiting_limit(self.max_waiting_requests, self.num_waiting, num_seqs)

    def stats(self) -> Any:
        """The engine's `EngineStats` after the latest step (never calls into the engine)."""
        return self._last_stats

    def engine_stats(self) -> list[Any]:
        """`stats()` per engine replica: one here (`DataParallelEngine` has several)."""
        return [self._last_stats]

    def stop_accepting(self) -> None:
        self._accepting = False

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout` s, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and self.is_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.warning("aborting %d unfinished request(s) at shutdown", len(self._streams))
            for rid in list(self._streams):
                self.abort(rid)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        if self._gc is not None and self._owns_gc:
            self._gc.stop()
        self.engine.shutdown()

    # ---- requests --------------------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams, *, priority: int = 0,
        check_capacity: bool = True, lora_request: Any = None,
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        Raises `QueueFullError`, `EngineStoppedError`, or the engine's `ValueError` for a bad
        request. `check_capacity=False`: the caller checked the waiting limit for a batch of requests.
        """
        if not self.accepting:
            raise EngineStoppedError("the server is shutting down" if self.is_running else f"{self.name} stopped")
        if (asleep := getattr(self.engine, "asleep_reason", lambda: None)()) is not None:
            raise EngineStoppedError(asleep)  # 503: a sleeping engine (`rl_engine`)
        if check_capacity:
            self.check_capacity(params.num_samples)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, params)
        stream.lora_request = lora_request
        self._streams[request_id] = stream
        self._command("add", (request_id, prompt, params, priority, lora_request))
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the client went away before the engine saw the request
            self.abort(request_id)
            raise
        return stream

    def generate(
        self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams, *, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; leaving early aborts it."""
        return generate_outputs(self, request_id, prompt, params, priority)

    def abort(self, request_id: str) -> None:
        """Abort a request (event-loop thread). Its stream ends; blocks are freed on the next step."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._command("abort", request_id)
        if not stream.accepted.done():
            stream.accepted.cancel()
        stream.finished = True
        self._record(stream, "abort")
        stream._end()

    # ---- event-loop side of the hand-off -----------------------------------------------------

    def _command(self, kind: str, payload: Any) -> None:
        with self._cv:
            self._commands.append((kind, payload))
            self._cv.notify()

    def _on_accepted(self, request_id: str, error: BaseException | None) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.accepted.done():
            return
        if error is None:
            stream.accepted.set_result(None)
            return
        del self._streams[request_id]
        stream.finished = True
        stream.accepted.set_exception(error)  # never ran: the caller reports it, no record

    def _on_step(self, outputs: list[RequestOutput], stats: Any) -> None:
        self._last_stats = stats
        if self.on_step is not None:
            try:
                self.on_step(stats)
            except Exception:  # metrics must never break serving
                logger.exception("on_step failed")
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            stream._put(out, now)
            if out.finished and self._gc is not None:
                self._gc.hold(out)
            if out.finished:
                del self._streams[out.request_id]
                stream.finished = True
                self._record(stream, stream.timings.finished_outcome)
                stream._end()

    def _on_dead(self, error: BaseException) -> None:
        self._error = error
        for rid, stream in list(self._streams.items()):
            del self._streams[rid]
            stream.finished = True
            failure = EngineStoppedError(f"{self.name} failed: {type(error).__name__}")
            if not stream.accepted.done():
                stream.accepted.set_exception(failure)
            self._record(stream, "error")
            stream._end(failure)

    def _record(self, stream: RequestStream, outcome: str) -> None:
        if self.on_request_done is None:
            return
        record = stream.timings.record(stream.request_id, outcome, time.monotonic(), stream.params,
                                       stream.lora_request, self.engine_index)
        try:
            self.on_request_done(record)
        except Exception:  # metrics must never break serving
            logger.exception("on_request_done failed")

    # ---- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        worked, last_trim = False, 0.0  # stepped since memory was last released; when
        check_health = getattr(self.engine, "check_health", None)
        try:
            while True:
                with self._cv:
                    idle = not self._commands and not self._stop and not self._has_work()
                if idle and worked and time.monotonic() - last_trim > 1.0:  # at most once a second
                    release_free_memory()
                    worked, last_trim = False, time.monotonic()
                collect = check = False
                with self._cv:
                    while not self._commands and not self._stop and not self._has_work():
                        gc_pending = self._gc is not None and self._gc.dirty
                        timeout = HEALTH_CHECK_S if check_health is not None else IDLE_GC_S if gc_pending else None
                        if self._cv.wait(timeout=timeout):
                            continue
                        if gc_pending and self._gc is not None and self._gc.due_when_idle():
                            collect = True  # idle that long, nothing handed out still held: collect now
                            break
                        if check_health is not None:
                            check = True
                            break
                    commands, self._commands = self._commands, []
                    stop = self._stop
                if check:
                    assert check_health is not None
                    check_health()  # raises when a worker died: the loop reports it below
                if collect:
                    assert self._gc is not None
                    self._gc.collect()
                    release_free_memory()  # what the collection freed, too
                    continue
                aborted = self._apply(commands, loop)
                if stop and not self.engine.has_unfinished_requests():
                    break
                if self._has_work() or (aborted and not self._paused):
                    worked = True
                    if self._gc is not None:
                        self._gc.before_step()
                    outputs = self.engine.step()
                    loop.call_soon_threadsafe(self._on_step, outputs, self.engine.stats())
                    del outputs  # held here while idle, they would keep FullCollections waiting
        except BaseException as e:  # the loop must report, never vanish silently
            logger.exception("engine step loop died")
            try:
                loop.call_soon_threadsafe(self._on_dead, e)
            except RuntimeError:  # the event loop is already closed
                pass

    def _apply(self, commands: list[tuple[str, Any]], loop: asyncio.AbstractEventLoop) -> bool:
        aborts: list[str] = []
        aborted = False
        for kind, payload in commands:
            if kind == "add":
                request_id, prompt, params, priority, lora_request = payload
                error: BaseException | None = None
                try:
                    kwargs = {"lora_request": lora_request} if lora_request is not None else {}
                    self.engine.add_request(request_id, prompt, params, priority=priority, **kwargs)
                except Exception as e:  # a bad request must not kill the loop; the caller gets it
                    error = e
                loop.call_soon_threadsafe(self._on_accepted, request_id, error)
            elif kind == "call":  # `AsyncEngineControl.call`, after the aborts queued before it
                aborted |= self._abort(aborts)
                aborts = []
                fn, fut = payload
                self._run_call(fn, fut, loop)
            else:
                aborts.append(payload)
        return self._abort(aborts) or aborted

    def _abort(self, aborts: list[str]) -> bool:
        if aborts:
            self.engine.abort_request(aborts)
        return bool(aborts)
