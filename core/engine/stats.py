"""What the engine reports for metrics: `EngineStats` (a snapshot after each step), and per
request the timings and sizes an async stream collects (`RequestTimings`) into the
`RequestRecord` handed to `on_request_done` when it ends (Prometheus, tracing, request logs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from portside.outputs import RequestOutput, SpecDecodeStats
from portside.sampling_params import SamplingParams


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    num_used_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found in the cache
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    weight_bytes: int = 0  # the loaded model's weights, every rank together
    # speculative decoding since start (all zero without it)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # the latest step: tokens it computed, and the seconds since each request's previous tokens
    step_tokens: int = 0
    token_intervals: list[float] = field(default_factory=list)
    # KV tiers / connector counters and tokens recomputed after preemption (`portside.sched.kv_loads.KVLoads.stats`)
    kv_transfer: dict[str, float] = field(default_factory=dict)


@dataclass
class RequestRecord:
    """Timings and sizes of one finished (or aborted) request, for metrics."""

    request_id: str
    outcome: str  # "stop", "length", "abort" or "error" (the step loop died)
    arrival_time: float  # time.monotonic()
    first_token_time: float | None
    finish_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    first_scheduled_time: float | None = None  # when the scheduler first admitted it (engine clock, same monotonic)
    params: SamplingParams | None = None
    lora_name: str | None = None  # the LoRA adapter it ran with
    engine_index: int = 0  # the data-parallel replica that ran it (metrics' `engine` label)

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to first token."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """First token to the end."""
        return None if self.first_token_time is None else self.finish_time - self.first_token_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class RequestTimings:
    """What one request's stream has seen, for its `RequestRecord`: arrival and first token on
    the event loop's clock, the engine's own first_scheduled_time / first_token_time (the same
    monotonic clock), token counts, and whether every sample so far finished by length."""

    arrival_time: float
    first_token_time: float | None = None
    engine_times: dict[str, float] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    length_only: bool = True  # every sample finished by length (the metrics' outcome)

    def observe(self, out: RequestOutput, now: float, delta: bool) -> None:
        """Account for `out`, handed to the stream at `now` (`delta`: outputs are deltas)."""
        if self.first_token_time is None and any(c.token_ids for c in out.outputs):
            self.first_token_time = now
        for key in ("first_scheduled_time", "first_token_time"):
            if key in out.metrics:
                self.engine_times.setdefault(key, out.metrics[key])
        reasons = {c.finish_reason for c in out.outputs}  # a delta holds the samples that finished now
        self.length_only = self.length_only and reasons <= {"length", None}
        if self.num_prompt_tokens == 0:
            self.num_prompt_tokens = len(out.prompt_token_ids)
        new_tokens = sum(len(c.token_ids) for c in out.outputs) + out.num_dropped_tokens  # best_of: every sample
        self.num_generation_tokens = self.num_generation_tokens + new_tokens if delta else new_tokens

    @property
    def finished_outcome(self) -> str:
        return "length" if self.length_only else "stop"

    def record(self, request_id: str, outcome: str, finish_time: float, params: SamplingParams | None,
               lora_request: Any, engine_index: int) -> RequestRecord:
        return RequestRecord(
            request_id=request_id,
            outcome=outcome,
            arrival_time=self.arrival_time,
            # the engine's clock where it has one: a final-only output reaches the loop at the end
            first_token_time=self.engine_times.get("first_token_time", self.first_token_time),
            finish_time=finish_time,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            first_scheduled_time=self.engine_times.get("first_scheduled_time"),
            params=params,
            lora_name=getattr(lora_request, "lora_name", None),
            engine_index=engine_index,
        )
