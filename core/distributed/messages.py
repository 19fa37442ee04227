"""The typed messages between the engine and its workers.

Engine -> worker: `InitKVCache`, a `SchedulerOutput` (one per step, the only per-step message),
`CollectiveRPC` (a call on every rank's model runner: weight updates, sleep), `Shutdown`.
Worker -> engine: `WorkerReady` once its shard is loaded, then per step a
`ModelRunnerOutput` from the output rank only (with a KV connector, a `KVStepReport` from each
other rank too), an `RPCReply` from every rank per `CollectiveRPC`, or a
`WorkerError` at any time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from portside.config import EngineConfig
from portside.contract import KVCacheSpec


@dataclass(frozen=True)
class WorkerSetup:
    """Launcher mode only: what rank 0 tells the other ranks before they load their shard."""

    config: EngineConfig
    eos_token_id: int | None


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    kv_cache_spec: KVCacheSpec  # this rank's share (KV heads per rank)
    num_blocks: int  # blocks that fit this rank's device; the engine takes the minimum
    vocab_size: int
    weight_bytes: int = 0  # this rank's loaded weights


@dataclass(frozen=True)
class InitKVCache:
    num_blocks: int


@dataclass(frozen=True)
class KVCacheReady:
    rank: int


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class WorkerError:
    """A worker raised; it exits after sending this."""

    rank: int
    error: str  # "ExceptionType: message"
    traceback: str


@dataclass(frozen=True)
class CollectiveRPC:
    """Call `method` on every rank's `ModelRunner`: a method name, or a picklable function
    called as ``method(runner, *args, **kwargs)`` (vLLM's `collective_rpc`)."""

    method: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RPCReply:
    """A rank's answer to a `CollectiveRPC`: its result, or the error it raised (`error_type`,
    `error`); a call that raises leaves the worker running."""

    rank: int
    result: Any = None
    error_type: str | None = None
    error: str = ""


@dataclass(frozen=True)
class KVStepReport:
    """With a KV connector: a rank other than the output rank's report of a step, its connector
    output (None: nothing), which the executor merges with the others' (`KVOutputAggregator`)."""

    rank: int
    kv_connector_output: Any = None
