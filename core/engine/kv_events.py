"""Publishing KV-cache events to routers over ZeroMQ, in vLLM's message layout (docs/kv_events.md).

`--kv-events-config` takes vLLM's JSON (`enable_kv_cache_events`, `publisher` "zmq" or "null",
`endpoint`, `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, `topic`), plus portside's
`encoding`; `--kv-events-publisher` and `--kv-events-endpoint` are shorthands for two of its keys.

The block pool records events as they happen (`portside.kv_cache.kv_events`); the engine drains
them once per step into one batch (`KVEventStream.flush`) and hands it to the publisher, whose
thread encodes and sends it: the step never waits on the network. A batch is three ZeroMQ frames
on a PUB socket: the topic, an 8-byte big-endian sequence number (0, 1, 2, ... per publisher), the
msgpack payload `[ts, [event, ...], data_parallel_rank]`. Each event is, with `encoding` "map"
(vLLM since its switch to map encoding, the default), a map with its name under "type" and its
fields by name; with "array" (older vLLM, the routers that predate the switch) an array: the name,
then the fields in order. The last `buffer_steps` batches are kept: a subscriber that missed some
sends the first sequence number it wants (8 bytes big-endian) to the ROUTER `replay_endpoint` and
gets back every kept batch from there, as (sequence number, payload) frames, then (-1, b"").

pyzmq and msgpack are optional (`pip install portside[kv-events]`), imported when a zmq publisher
starts. If the queue to the thread is full (a stalled subscriber cannot stall it: PUB drops at its
high-water mark, so only a stalled thread fills it), batches are dropped and the next one sent
starts with `AllBlocksCleared`: a router then forgets this instance's blocks rather than believing
in blocks that may be gone.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from portside.kv_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventRecorder,
    external_hash,
)

logger = logging.getLogger(__name__)

PUBLISHERS = ("null", "zmq")
ENCODINGS = ("map", "array")
MISSING_DEPS = "KV events over ZeroMQ need pyzmq and msgpack: pip install 'portside[kv-events]'"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (same keys and defaults) plus `encoding` (module docstring)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has "*", "::", ipc:// or inproc://, else connected
    replay_endpoint: str | None = None  # ROUTER socket for replays (always bound); None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    encoding: str = "map"

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv events publisher {self.publisher!r} is unknown; use one of {', '.join(PUBLISHERS)}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding {self.encoding!r} is unknown; use one of {', '.join(ENCODINGS)}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be a positive integer, got {getattr(self, name)!r}")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def resolve_kv_events_config(value: dict[str, Any] | str | None, publisher: str | None = None,
                             endpoint: str | None = None) -> KVEventsConfig | None:
    """The config from --kv-events-config (JSON text or a dict) and the shorthands (which imply
    `enable_kv_cache_events`); None when events are off. ValueError naming the problem."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON ({e}); e.g. "
                             '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'') from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"--kv-events-config must be a JSON object, got {type(value).__name__}")
    values = dict(value or {})
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if publisher is not None:
        values["publisher"] = publisher
    if endpoint is not None:
        values["endpoint"] = endpoint
    if publisher is not None or endpoint is not None:
        values.setdefault("enable_kv_cache_events", publisher != "null")
    if not values:
        return None
    config = KVEventsConfig(**values)
    return config if config.active else None


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel replica's endpoint: the TCP port plus its rank, or "_dp<rank>" appended to
    an ipc:// or inproc:// name (replica 0 keeps the endpoint as given), as vLLM offsets them."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"kv events endpoint {endpoint!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    return f"{base}:{int(port) + rank}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _event_obj(event: KVCacheEvent, as_map: bool) -> Any:
    if isinstance(event, BlockStored):
        items: list[tuple[str, Any]] = [
            ("block_hashes", [external_hash(h) for h in event.block_hashes]),
            ("parent_block_hash", None if event.parent_block_hash is None else external_hash(event.parent_block_hash)),
            ("token_ids", event.token_ids), ("block_size", event.block_size), ("lora_id", event.lora_id),
            ("medium", event.medium),
        ]
    elif isinstance(event, BlockRemoved):
        items = [("block_hashes", [external_hash(h) for h in event.block_hashes]), ("medium", event.medium)]
    else:
        assert isinstance(event, AllBlocksCleared), event
        items = []
    name = type(event).__name__
    return {"type": name, **dict(items)} if as_map else [name, *(v for _, v in items)]


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int, encoding: str = "map") -> bytes:
    """One batch's msgpack payload (module docstring)."""
    import msgpack

    return msgpack.packb([ts, [_event_obj(e, encoding == "map") for e in events], data_parallel_rank])


class ZmqEventPublisher:
    """A PUB socket (and a ROUTER replay socket), fed by a thread from a bounded queue."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        try:
            import zmq
        except ImportError:
            raise ValueError(MISSING_DEPS) from None
        import msgpack  # noqa: F401  (fail here, not in the thread)

        self.config, self.rank = config, data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if self.replay_endpoint is not None else None
        try:
            self._pub.set_hwm(config.hwm)
            assert self.endpoint is not None
            (self._pub.bind if _binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self._replay is not None:
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv events: cannot open {self.endpoint} / {self.replay_endpoint}: {e}") from None
        self._seq = 0
        self._overflowed = False
        self.dropped_batches = 0
        self._thread = threading.Thread(target=self._run, name="portside-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay: %s, topic %r, %s encoding)", self.endpoint,
                    self.replay_endpoint or "off", config.topic, config.encoding)

    def publish(self, ts: float, events: list[KVCacheEvent]) -> None:
        """Queue one batch; never blocks (a full queue drops it: module docstring)."""
        try:
            self._queue.put_nowait((ts, events))
        except queue.Full:
            self._overflowed = True
            self.dropped_batches += 1
            if self.dropped_batches == 1 or self.dropped_batches % 1000 == 0:
                logger.warning("KV events: the publisher's queue is full; %d batch(es) dropped", self.dropped_batches)

    def _run(self) -> None:
        topic = self.config.topic.encode()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a bad request never stops the publishing
                    logger.exception("KV events: serving a replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                break
            ts, events = item
            if self._overflowed:  # written by publish() only to set it: a late reset only resends a clear
                self._overflowed = False
                events = [AllBlocksCleared(), *events]
            try:
                payload = encode_batch(ts, events, self.rank, self.config.encoding)
            except Exception:
                logger.exception("KV events: encoding a batch failed; it is dropped")
                self._overflowed = True  # the router resynchronises from a clear
                continue
            try:
                self._pub.send_multipart((topic, self._seq.to_bytes(8, "big"), payload))
            except Exception:  # the engine goes on; a subscriber sees the gap and asks for a replay
                logger.exception("KV events: sending batch %d failed", self._seq)
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request is [identity, b'', 8-byte start]; got %d frame(s)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)


class KVEventStream:
    """The engine's side: the pool's recorder, drained once per step into the publisher."""

    def __init__(self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0) -> None:
        self.recorder = KVEventRecorder(block_size)
        self.publisher = ZmqEventPublisher(config, data_parallel_rank)

    def flush(self) -> None:
        events = self.recorder.drain()
        if events:
            self.publisher.publish(time.time(), events)

    def shutdown(self) -> None:
        self.flush()
        self.publisher.shutdown()
