"""Process memory hygiene while an engine serves: full garbage collections moved off the request
path (`FullCollections`) and the allocator's free pages handed back to the OS when the engine goes
idle (`portside.contract.memory.release_free_memory`, which backends call too).

A full collection holds the GIL for as long as it scans, and the live heap of a request with
logprobs is large (n=128 x 160 tokens x 21 `Logprob`s: 0.3-0.5 s pauses every few seconds of it,
stalling the event loop and every other request), so the async engine collects in full only
when idle. glibc keeps the pages of freed buffers (the activations of the largest batches, in
every thread's arena) resident unless asked to trim.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from portside.outputs import RequestOutput

IDLE_GC_S = 1.0  # a full garbage collection once the engine has been idle this long after working
BUSY_GC_INTERVAL_S = 120.0  # and one at least this often while it never goes idle


class FullCollections:
    """Full (oldest-generation) garbage collections moved off the request path.

    Python collects its oldest generation whenever a quarter more objects than at the last full
    collection have survived into it, and such a collection scans the whole heap with the GIL
    held. The objects a request with logprobs keeps until it finishes (a dict and k+1 `Logprob`s
    per token) make that scan take 0.3-0.5 s, several times a request: every thread stalls,
    the event loop included. Instead, `start` collects and freezes the start-up heap (the model,
    modules and tokenizer: never scanned again, as vLLM does), and sets the oldest generation's
    threshold out of reach; the engine thread then collects in full once it has been idle for
    IDLE_GC_S after working and every finished output it handed out has been let go (a 24 MB
    response may still be being built from one: its objects would make the scan long), and at
    least every BUSY_GC_INTERVAL_S regardless (which bounds how long cyclic garbage that reached
    the oldest generation waits). The younger generations are collected as usual. `stop`
    restores the threshold and unfreezes.
    """

    def __init__(self, busy_interval_s: float = BUSY_GC_INTERVAL_S) -> None:
        self.busy_interval_s = busy_interval_s
        self.dirty = False  # worked since the last full collection
        self.last = time.monotonic()
        self._thresholds: tuple[int, int, int] | None = None
        self._held = 0  # finished outputs handed out and still alive somewhere
        self._lock = threading.Lock()

    def hold(self, out: RequestOutput) -> None:
        """`out` (finished) was handed out: no idle collection until it is let go."""
        try:
            weakref.finalize(out, self._let_go)
        except TypeError:  # an output type without weak references: not waited for
            return
        with self._lock:
            self._held += 1

    def _let_go(self) -> None:  # any thread: the one that drops the last reference
        with self._lock:
            self._held -= 1

    def due_when_idle(self) -> bool:
        return self.dirty and (self._held == 0 or time.monotonic() - self.last > self.busy_interval_s)

    def start(self) -> None:
        gc.collect()
        gc.freeze()
        self._thresholds = gc.get_threshold()
        gc.set_threshold(self._thresholds[0], self._thresholds[1], 1 << 30)
        self.last = time.monotonic()

    def stop(self) -> None:
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            gc.unfreeze()
            self._thresholds = None

    def collect(self) -> None:
        gc.collect()
        self.dirty, self.last = False, time.monotonic()

    def before_step(self) -> None:
        """Called before each engine step: a full collection when one is overdue."""
        self.dirty = True
        if time.monotonic() - self.last > self.busy_interval_s:
            self.collect()
