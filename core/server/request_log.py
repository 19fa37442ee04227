"""The server's log lines for operators: one per finished request, and a periodic stats line.

Request lines go to the logger `portside.requests`, at INFO, as `key=value` pairs in a fixed
order (values with spaces or quotes are JSON-quoted)::

    request_id=cmpl-3f2a model=tiny finish_reason=stop prompt_tokens=12 output_tokens=40 ttft_s=0.031 queue_s=0.001 e2e_s=0.412

`finish_reason` is stop, length, abort or error; a time the request never reached (an abort
before its first token) is `none`. Prompts and outputs are never logged, only their sizes.
Off with `--disable-log-requests`.

The stats line goes to `portside.stats` every `interval` seconds (10 by default) while the
server is busy: prompt and generation throughput over the interval, running and waiting
requests, KV-cache use and the prefix-cache hit rate over the interval, as vLLM prints it.
Off with `--disable-log-stats`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from portside.engine.stats import RequestRecord

request_logger = logging.getLogger("portside.requests")
stats_logger = logging.getLogger("portside.stats")


def _value(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:.3f}"
    s = str(v)
    return json.dumps(s) if not s or any(c in s for c in ' "=\n') else s


def format_record(record: RequestRecord, model: str) -> str:
    fields = {
        "request_id": record.request_id,
        "model": record.lora_name or model,
        "finish_reason": record.outcome,
        "prompt_tokens": record.num_prompt_tokens,
        "output_tokens": record.num_generation_tokens,
        "ttft_s": record.ttft,
        "queue_s": record.queue_time,
        "e2e_s": record.e2e,
    }
    return " ".join(f"{k}={_value(v)}" for k, v in fields.items())


class RequestLogger:
    """`on_request_done` callback: one INFO line per ended request."""

    def __init__(self, model: str) -> None:
        self.model = model

    def __call__(self, record: RequestRecord) -> None:
        if request_logger.isEnabledFor(logging.INFO):
            request_logger.info("%s", format_record(record, self.model))


class StatsLogger:
    """Logs the engine's throughput and state every `interval` seconds, when there was activity."""

    def __init__(self, stats: Callable[[], Any], interval: float = 10.0) -> None:
        self._stats = stats
        self.interval = interval
        self._last = self._snapshot()

    def _snapshot(self) -> tuple[float, float, float, float, float]:
        s = self._stats()

        def get(name: str) -> float:
            return float(getattr(s, name, 0) or 0) if s is not None else 0.0

        return (time.monotonic(), get("prompt_tokens_total"), get("generation_tokens_total"),
                get("prefix_cache_queries"), get("prefix_cache_hits"))  # fmt: skip

    def log_once(self) -> bool:
        """Log one line if anything happened since the last call; returns whether it did."""
        now = self._snapshot()
        (t0, p0, g0, q0, h0), (t1, p1, g1, q1, h1) = self._last, now
        self._last = now
        s = self._stats()
        running = int(getattr(s, "num_running", 0) or 0)
        waiting = int(getattr(s, "num_waiting", 0) or 0)
        if p1 == p0 and g1 == g0 and not running and not waiting:
            return False  # idle: no noise
        dt = max(t1 - t0, 1e-9)
        stats_logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            (p1 - p0) / dt, (g1 - g0) / dt, running, waiting, 100 * float(getattr(s, "kv_cache_usage", 0) or 0),
            100 * (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
        )  # fmt: skip
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.log_once()


def show_at_default_level(*loggers: logging.Logger) -> None:
    """Print these loggers' INFO lines to stderr even when the root level (`--log-level`,
    WARNING by default) would hide them: they are what an operator reads, and vLLM prints them
    at its default level. Under a root level of INFO or lower they go through the root handlers;
    a level above the default (`--log-level ERROR`) asked for quiet, and hides them too."""
    root = logging.getLogger().getEffectiveLevel()
    for log in loggers:
        if root > logging.WARNING:
            continue
        log.setLevel(logging.INFO)
        if root <= logging.INFO or log.handlers:
            continue
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
