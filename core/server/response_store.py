"""The in-memory store of OpenAI Responses (`POST /v1/responses` with `store`, the default):
what `previous_response_id` continues and `GET`/`DELETE /v1/responses/{id}` read.

Bounded three ways, so that a server that runs for weeks holds a fixed amount:

- at most `max_entries` responses (`--responses-store-max-entries`, default 1000);
- at most `max_bytes` of them, counted as the JSON size of each response body and of the whole
  conversation it continues (`--responses-store-max-bytes`, default 256 MiB; a conversation that
  continues another is counted in full, so the bound holds however the entries share items);
- each for `ttl_s` seconds after it was last used (`--responses-store-ttl`, default 3600):
  stored, read, or continued by a request naming it as `previous_response_id`.

A new entry past a bound evicts the least recently used ones; one larger than `max_bytes` alone
is not kept. As every use renews the TTL, the least recently used entry is also the first to
expire: expired entries go from the front on every store, and when touched. Nothing is written to disk: a restart forgets every response. The
store is thread-safe (a response body may be built on an offload worker).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_TTL_S = 3600.0


@dataclass
class StoredResponse:
    """One stored response: its body as `POST` returned it, and the conversation that a request
    naming it as `previous_response_id` continues: every item before it (its own
    previous_response_id's, then its input) and its output, as input items. The request's
    `instructions` are not part of it (OpenAI's rule: they are not carried over)."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    conversation_bytes: int = 0  # the JSON size of `conversation` (a continuation adds its own items to it)
    nbytes: int = 0  # what it counts against max_bytes: the body's size and conversation_bytes
    expires: float = 0.0  # set by the store


class ResponseStore:
    """Responses by id, bounded in entries, bytes and age (see the module's docstring)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0:
            raise ValueError(f"--responses-store-max-entries must be 0 (store nothing) or more, got {max_entries}")
        if max_bytes < 0:
            raise ValueError(f"--responses-store-max-bytes must be 0 (store nothing) or more, got {max_bytes}")
        if not ttl_s > 0:
            raise ValueError(f"--responses-store-ttl must be a positive number of seconds, got {ttl_s}")
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def describe(self) -> str:
        """The bounds, as an error message tells a client why an id is gone."""
        return (f"this server keeps at most {self.max_entries} responses ({self.max_bytes >> 20} MiB) "
                f"for {self.ttl_s:g} s, in memory")

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry` (replacing one of the same id); False when it is too large to keep."""
        with self._lock:
            now = self._clock()
            self._drop(response_id)
            self._expire(now)
            if entry.nbytes > self.max_bytes or self.max_entries == 0:
                return False
            while self._entries and (len(self._entries) >= self.max_entries or self._bytes + entry.nbytes > self.max_bytes):
                self._drop(next(iter(self._entries)))
            entry.expires = now + self.ttl_s
            self._entries[response_id] = entry
            self._bytes += entry.nbytes
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used, its TTL renewed), or None: never stored, deleted,
        evicted or expired."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            now = self._clock()
            if entry.expires <= now:
                self._drop(response_id)
                return None
            entry.expires = now + self.ttl_s
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        """Forget the entry; False when there was none (or it had expired)."""
        with self._lock:
            entry = self._entries.get(response_id)
            self._drop(response_id)
            return entry is not None and entry.expires > self._clock()

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def _expire(self, now: float) -> None:
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires > now:
                return
            self._drop(key)
