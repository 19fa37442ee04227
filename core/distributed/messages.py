"""The typed messages between the engine and its workers.

Engine -> worker: `InitKVCache`, a `SchedulerOutput` (one per step, the only per-step message),
`Shutdown`. Worker -> engine: `WorkerReady` once its shard is loaded, then (rank 0 only) a
`ModelRunnerOutput` per step, or a `WorkerError` at any time.
"""

from __future__ import annotations

from dataclasses import dataclass

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
