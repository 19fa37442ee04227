"""Where the work a request controls runs: never on the event loop.

Parsing a large body, tokenizing a prompt, rendering a chat template and decoding an echoed
prompt take time proportional to what the client sent (a 5 MB prompt: seconds). They run on
two bounded lanes of worker threads: requests with a small body use the `small` lane and
everything else (large bodies, templates the client supplied, the bodies of large non-streamed
responses: logprobs of many tokens) the `large` one, so a client sending huge or expensive
requests delays only others like it, never /health or a short request. Each worker thread
tokenizes with its own copy of the tokenizer (a Hugging Face fast tokenizer must not be used by
threads that may change its settings concurrently).

Work that runs Python code on a lane (a template's loops, a large body's dicts) holds the GIL
but for the interpreter's switch interval, and the event loop and the engine thread wait up to
that long at each hand-off; a short completion hands off about ten times (loop, small lane, loop,
engine, loop). So the lanes lower the interval from Python's 5 ms to SWITCH_INTERVAL_S for the
process: more frequent switches cost little beside the model's compute.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from portside.server.errors import APIError

T = TypeVar("T")

SMALL_BYTES = 64 << 10  # a body up to this size is a small request
SWITCH_INTERVAL_S = 0.001  # sys.setswitchinterval while lanes exist (see above)


class Offload:
    """Two single-thread lanes holding at most `max_queued` jobs each (small, large); past it a
    503. Small jobs take about a millisecond: a burst of hundreds drains at once."""

    def __init__(self, tokenizer: Any, max_queued: tuple[int, int] = (1024, 64), retry_after_s: int = 1) -> None:
        self._base = tokenizer
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self._lanes = {name: ThreadPoolExecutor(1, thread_name_prefix=f"portside-{name}", initializer=self._mark_worker)
                       for name in ("small", "large")}
        self._queued = dict.fromkeys(self._lanes, 0)
        self.max_queued = dict(zip(self._lanes, max_queued))
        self.retry_after_s = retry_after_s
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)

    def _mark_worker(self) -> None:
        self._local.worker = True

    def on_worker(self) -> bool:
        """Whether the calling thread is one of the lanes' workers."""
        return getattr(self._local, "worker", False)

    def tokenizer(self) -> Any:
        """This worker thread's own tokenizer."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:
                tok = self._local.tokenizer = copy.deepcopy(self._base)
        return tok

    async def run(self, fn: Callable[..., T], *args: Any, large: bool, refusable: bool = True) -> T:
        """`fn(*args)` on a worker of the lane; a client that leaves first cancels it if it has not started.
        `refusable=False`: queued even past the bound (the body of a response whose generation is
        done: their number is bounded by the requests the engine admitted), still counted in it."""
        lane = "large" if large else "small"
        if refusable and self._queued[lane] >= self.max_queued[lane]:
            raise APIError(503, "the server is busy preparing other requests; retry later", code="server_busy",
                           headers={"Retry-After": str(self.retry_after_s)})
        self._queued[lane] += 1
        try:
            return await asyncio.wrap_future(self._lanes[lane].submit(fn, *args))
        finally:
            self._queued[lane] -= 1

    def shutdown(self) -> None:
        for pool in self._lanes.values():
            pool.shutdown(wait=False, cancel_futures=True)
