"""What the server's dev endpoints ask of the async engine (mixed into `AsyncLLMEngine`): a call
run on the engine thread between steps (`call`: sleep, wake-up, weight updates, collective_rpc
all go through it, so they never race a step), and pausing the step loop (`pause` / `resume`,
as vLLM's `/pause` and `/resume`).

Pause modes: ``abort`` (the default) aborts every request in flight, then pauses; ``wait`` lets
the requests in flight finish (new ones are accepted and run meanwhile), then pauses; ``keep``
pauses at once, the requests in flight kept where they are until `resume`. While paused, new
requests are accepted and wait; nothing is scheduled. ``clear_cache`` (default true) resets the
prefix cache once paused.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

PAUSE_MODES = ("abort", "wait", "keep")


class AsyncEngineControl:
    """Mixed into `AsyncLLMEngine` (which provides engine, _streams, _cv, _command, abort)."""

    engine: Any
    _streams: dict[str, Any]
    _cv: threading.Condition
    _paused = False

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the engine thread, between two steps; its result, or its exception."""
        if not self.is_running:  # type: ignore[attr-defined]
            raise RuntimeError("the engine's step loop is not running")
        fut = asyncio.get_running_loop().create_future()
        self._command("call", (fn, fut))  # type: ignore[attr-defined]
        return await fut

    @property
    def is_paused(self) -> bool:
        return self._paused

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        if mode == "abort":
            for rid in list(self._streams):
                self.abort(rid)  # type: ignore[attr-defined]
        elif mode == "wait":
            while self._streams and self.is_running:  # type: ignore[attr-defined]
                await asyncio.sleep(0.02)
        with self._cv:
            self._paused = True
            self._cv.notify()
        if clear_cache:
            await self.call(lambda engine: engine.reset_prefix_cache())

    async def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    def _run_call(self, fn: Callable[[Any], Any], fut: asyncio.Future[Any], loop: asyncio.AbstractEventLoop) -> None:
        """Engine thread: run a `call` and hand its outcome to the event loop."""
        result, failure = None, None
        try:
            result = fn(self.engine)
        except Exception as e:  # the caller gets it; the loop goes on
            failure = e
        loop.call_soon_threadsafe(settle, fut, result, failure)

    def _has_work(self) -> bool:
        """Steps to run: unfinished requests and not paused (engine thread)."""
        return not self._paused and self.engine.has_unfinished_requests()


def settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Complete a `call`'s future on the event loop (unless its caller went away)."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
