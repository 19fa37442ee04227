"""Data parallelism (`portside serve --data-parallel-size D`): D engine replicas behind one server.

Each replica is a whole `LLMEngine` (its own scheduler, KV cache and executor) whose model runs
in worker processes, TP x PP of them, so the D replicas compute in parallel (on cpu each worker
takes cores / (D x TP x PP) threads). Every replica has its own `AsyncLLMEngine`, whose step loop
runs on a thread of the server process; `DataParallelEngine` is what the server talks to, with
the async engine's interface:

- routing: each request goes to the replica `PrefixRouter` picks (prefix-cache affinity,
  balanced by unfinished sequences; the rule is in `portside.engine.dp_router`); its stream
  belongs to that replica, so closing it aborts it there;
- engine state the server changes is one object for all replicas: replica 0's grammar cache
  (`StructuredOutputManager`) and LoRA adapter registry serve every replica, so an adapter
  loaded or unloaded over HTTP is loaded or unloaded everywhere;
- `stats()` sums the replicas' `EngineStats` (the `portside_*` metrics); `engine_stats()` lists
  them, for the `vllm:*` series labelled `engine="i"`; records carry their replica's index;
- failure: when a replica's step loop stops (a worker process died: noticed within about a
  second, idle or not), the front stops accepting: `/health` answers 503 and new requests are
  refused naming the replica; the dead replica's requests fail, the others' finish;
- `shutdown` stops every replica and its workers.

`LLM(data_parallel_size=D)` is refused: offline, run one `LLM` per process or `portside serve -dp D`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from portside.engine.async_engine import (
    AsyncLLMEngine,
    EngineStoppedError,
    RequestStream,
    SyncEngine,
    check_waiting_limit,
    generate_outputs,
)
from portside.engine.dp_router import PrefixRouter
from portside.engine.memory_hygiene import FullCollections
from portside.engine.stats import RequestRecord
from portside.outputs import RequestOutput
from portside.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def start_replicas(num_replicas: int, **engine_kwargs: Any) -> list[Any]:
    """`num_replicas` `LLMEngine`s built from the same arguments, started side by side (their
    workers load the model at the same time). If one fails, the others are shut down and its
    error is raised: no worker outlives a failed start."""
    from portside.distributed.env import launcher_env
    from portside.engine.llm_engine import LLMEngine

    env = launcher_env()
    if env is not None and env.world_size > 1:
        raise ValueError("data parallelism starts its replicas' worker processes itself; run `portside serve -dp D` "
                         "without a launcher (torchrun)")
    from transformers import AutoTokenizer  # noqa: F401  (transformers' lazy imports are not thread-safe: first here)

    with ThreadPoolExecutor(num_replicas, thread_name_prefix="portside-dp-start") as pool:
        futures = [pool.submit(LLMEngine.from_args, data_parallel_size=num_replicas, data_parallel_rank=i, **engine_kwargs)
                   for i in range(num_replicas)]
        done = [(f.result() if f.exception() is None else None, f.exception()) for f in futures]
    errors = [e for _, e in done if e is not None]
    if errors:
        for engine, _ in done:
            if engine is not None:
                engine.shutdown()
        raise errors[0]
    return [engine for engine, _ in done]


def merge_stats(stats: list[Any]) -> Any:
    """One `EngineStats` for several replicas: numbers summed, lists joined, counter dataclasses
    and dicts merged, the KV-cache usage recomputed from the summed blocks, anything else replica 0's
    (None while any replica has none yet)."""
    if not stats or any(s is None for s in stats):
        return None
    values: dict[str, Any] = {}
    for f in dataclasses.fields(stats[0]):
        items = [getattr(s, f.name) for s in stats]
        if dataclasses.is_dataclass(items[0]):
            values[f.name] = _merge_counts(items)
        elif isinstance(items[0], list):
            values[f.name] = [x for item in items for x in item]
        elif isinstance(items[0], dict):  # counters by name (the KV tiers')
            values[f.name] = {k: sum(i.get(k, 0) for i in items) for k in {k for i in items for k in i}}
        elif all(isinstance(i, (int, float)) and not isinstance(i, bool) for i in items):
            values[f.name] = sum(items)
        # anything else (a flag, a name): replica 0's
    total = values.get("num_total_blocks")
    if total:
        values["kv_cache_usage"] = sum(s.kv_cache_usage * s.num_total_blocks for s in stats) / total
    return dataclasses.replace(stats[0], **values)


def _merge_counts(items: list[Any]) -> Any:
    """Dataclasses of counters (`SpecDecodeStats`): ints summed, lists of counts summed by index."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(items[0]):
        parts = [getattr(i, f.name) for i in items]
        if isinstance(parts[0], list):
            width = max(len(p) for p in parts)
            values[f.name] = [sum(p[k] for p in parts if k < len(p)) for k in range(width)]
        else:
            values[f.name] = sum(parts)
    return dataclasses.replace(items[0], **values)


class DataParallelEngine:
    """The async-engine front of several replicas (see the module docstring). `block_size`: the
    replicas' KV block size, which the router hashes prompts by."""

    def __init__(self, engines: list[SyncEngine], *, block_size: int, max_waiting_requests: int | None = None) -> None:
        if len(engines) < 2:
            raise ValueError("DataParallelEngine needs at least two replicas; use AsyncLLMEngine for one")
        self.engine = primary = engines[0]  # tokenizer, config, the shared grammar cache and adapter registry
        for e in engines[1:]:
            _share_state(primary, e)
        self.max_waiting_requests = max_waiting_requests
        self._gc = FullCollections()  # process-wide: one for every replica's loop
        self.replicas = [
            AsyncLLMEngine(e, manage_gc=self._gc, engine_index=i, name=f"data-parallel replica {i}")
            for i, e in enumerate(engines)
        ]  # fmt: skip
        self.router = PrefixRouter(len(engines), block_size)
        self._accepting = True
        self._started = False
        self._on_step: Callable[..., None] | None = None

    # ---- callbacks (set by the server before start) ------------------------------------------

    @property
    def on_request_done(self) -> Callable[[RequestRecord], None] | None:
        return self.replicas[0].on_request_done

    @on_request_done.setter
    def on_request_done(self, callback: Callable[[RequestRecord], None] | None) -> None:
        for r in self.replicas:
            r.on_request_done = callback  # records carry r.engine_index

    @property
    def on_step(self) -> Callable[..., None] | None:
        """Called on the event loop as on_step(stats, engine_index=i) after each step of replica i."""
        return self._on_step

    @on_step.setter
    def on_step(self, callback: Callable[..., None] | None) -> None:
        self._on_step = callback
        for r in self.replicas:
            r.on_step = None if callback is None else functools.partial(callback, engine_index=r.engine_index)

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._gc.start()
        for r in self.replicas:
            r.start()

    @property
    def is_running(self) -> bool:
        """Every replica's step loop runs (one that stopped makes the server unhealthy)."""
        return all(r.is_running for r in self.replicas)

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_running

    def stop_accepting(self) -> None:
        self._accepting = False
        for r in self.replicas:
            r.stop_accepting()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout` s, then stop every replica."""
        self.stop_accepting()
        try:
            results = await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas), return_exceptions=True)
        finally:
            if self._started:
                self._gc.stop()
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                logger.error("data-parallel replica %d did not shut down cleanly: %r", i, result)

    # ---- figures -------------------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def supports_images(self) -> bool:
        return self.replicas[0].supports_images

    async def process_multimodal(self, prompt: dict[str, Any], add_special_tokens: bool = True) -> dict[str, Any]:
        """Every replica serves the same model: the first one's processor does it."""
        return await self.replicas[0].process_multimodal(prompt, add_special_tokens)

    def num_using(self, lora_int_id: int) -> int:
        return sum(r.num_using(lora_int_id) for r in self.replicas)

    def loads(self) -> list[int]:
        """Each replica's unfinished sequences (what the router balances)."""
        return [r.num_unfinished_seqs for r in self.replicas]

    def stats(self) -> Any:
        """The replicas' latest `EngineStats`, summed."""
        return merge_stats([r.stats() for r in self.replicas])

    def engine_stats(self) -> list[Any]:
        """Each replica's latest `EngineStats`, by replica index."""
        return [r.stats() for r in self.replicas]

    def check_capacity(self, num_seqs: int) -> None:
        """`max_waiting_requests` bounds the sequences waiting on all replicas together."""
        check_waiting_limit(self.max_waiting_requests, self.num_waiting, num_seqs)

    # ---- requests ------------------------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams, *, priority: int = 0,
        check_capacity: bool = True, lora_request: Any = None,
    ) -> RequestStream:
        """Route the request to a replica and queue it there (see `AsyncLLMEngine.add_request`)."""
        if not self.accepting:
            raise EngineStoppedError(self.stopped_reason())
        if check_capacity:
            self.check_capacity(params.num_samples)
        if any(r.has_request(request_id) for r in self.replicas):
            raise ValueError(f"request id {request_id!r} is already in use")
        salt = lora_request.lora_int_id if lora_request is not None else 0
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt  # a processed image prompt: its ids
        i = self.router.choose(ids if isinstance(ids, list) else None, self.loads(), salt)
        # no await before the replica registers the stream: the next routing decision sees its load
        return await self.replicas[i].add_request(request_id, prompt, params, priority=priority, check_capacity=False,
                                                  lora_request=lora_request)

    def generate(
        self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams, *, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; leaving early aborts it."""
        return generate_outputs(self, request_id, prompt, params, priority)

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            r.abort(request_id)  # a no-op where the request is not

    def stopped_reason(self) -> str:
        """Why requests are refused (names a failed replica)."""
        for r in self.replicas:
            if not r.is_running and r.error is not None:
                return (f"data-parallel replica {r.engine_index} of {len(self.replicas)} failed "
                        f"({type(r.error).__name__}); the server is unhealthy")
        return "the server is shutting down" if self.is_running else "the engine stopped"


def _share_state(primary: Any, replica: Any) -> None:
    """Let `replica` use `primary`'s grammar cache and adapter registry (its own go unused)."""
    for name in ("structured", "loras"):
        if hasattr(primary, name) and hasattr(replica, name):
            own = getattr(replica, name)
            if hasattr(own, "shutdown"):
                own.shutdown()
            setattr(replica, name, getattr(primary, name))
