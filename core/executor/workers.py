"""What the executors whose every rank runs outside the engine process share: `MultiprocExecutor`
(worker processes on this machine) and `RayExecutor` (Ray actors on any node).

Their ranks run the same `Worker` and answer the same messages (`portside.distributed.messages`);
only the transport differs. Shared here: the ranks' start-up replies (`WorkerReady`), a step as
`submit` then wait, the deadline on every reply, and one way to fail: a RuntimeError naming the
rank and its cause, recorded so that every later call raises it at once, after every rank was
stopped.
"""

from __future__ import annotations

import logging
import os
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, NoReturn

from portside.config import EngineConfig
from portside.contract import KVCacheSpec
from portside.distributed.messages import KVStepReport, WorkerError, WorkerReady
from portside.executor.base import Executor
from portside.kv_transfer.ranks import KVOutputAggregator
from portside.sched.output import ModelRunnerOutput, SchedulerOutput

# Longest wait for one reply (loading a shard, one step) while every worker is still alive.
WORKER_TIMEOUT_S = float(os.environ.get("PORTSIDE_WORKER_TIMEOUT", "900"))
GRACE_S = 1.0  # after a failure: how long to wait for the other ranks (to name the cause, not a consequence)


class WorkerExecutor(Executor):
    """An executor whose TP x PP ranks all run in workers; the engine process holds no shard and
    never enters a collective. A subclass starts its workers, creates `_finalizer` (stopping them
    at garbage collection or exit, even without `shutdown`), calls `_take_ready` with their
    start-up replies, and implements `submit`, `initialize_kv_cache` and `_stop_ranks`."""

    kind: ClassVar[str]  # in messages: "the {kind} executor has been shut down"
    workers: ClassVar[str]  # in messages: "the {workers} were stopped"
    _finalizer: weakref.finalize

    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.parallel.world_size
        # the rank whose output the engine reads: rank 0, or the first rank of the last pipeline stage
        self.output_rank = config.parallel.output_rank
        self._micro_batches = config.parallel.pipeline_micro_batches
        # with a KV connector every rank reports its loads each step (`KVStepReport`): merged here
        self._kv_outputs = KVOutputAggregator(self.world_size) if config.kv_transfer is not None else None
        self._error: RuntimeError | None = None
        self._logger = logging.getLogger(type(self).__module__)

    def _take_ready(self, ready: dict[int, WorkerReady]) -> None:
        """What every rank reported once its shard was loaded."""
        self.vocab_size = ready[0].vocab_size
        self.weight_bytes = sum(r.weight_bytes for r in ready.values())
        self.kv_cache_spec: KVCacheSpec = ready[0].kv_cache_spec  # per rank
        self._num_blocks = min(r.num_blocks for r in ready.values())

    def determine_num_blocks(self) -> int:
        """The smallest pool any rank can hold (every rank caches the same blocks)."""
        return self._num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(scheduler_output)()

    @abstractmethod
    def submit(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Send a step to every rank now; the returned call waits for the output rank's reply
        (and, with a KV connector, every rank's: `_step_replies`, `_merge_kv`)."""

    @property
    def _step_replies(self) -> tuple[list[int], tuple[type, ...]]:
        """The ranks that reply to a step and the messages they send: the output rank's
        `ModelRunnerOutput`, with a KV connector every other rank's `KVStepReport` too."""
        if self._kv_outputs is None:
            return [self.output_rank], (ModelRunnerOutput,)
        return list(range(self.world_size)), (ModelRunnerOutput, KVStepReport)

    def _merge_kv(self, replies: dict[int, Any], doing: str) -> ModelRunnerOutput:
        """The output rank's `ModelRunnerOutput` of a step, its KV connector output replaced by
        every rank's merged (`KVOutputAggregator`)."""
        out = replies[self.output_rank]
        if not isinstance(out, ModelRunnerOutput):
            self._raise("worker failed", [protocol_error(self.output_rank, out, doing)])
        if self._kv_outputs is not None:
            out.kv_connector_output = self._kv_outputs.aggregate(
                [replies[r].kv_connector_output for r in range(self.world_size)])
        return out

    @property
    def max_concurrent_batches(self) -> int:
        return self._micro_batches

    def shutdown(self) -> None:
        """Stop every rank (asked to leave first, then killed); idempotent."""
        self._stop_ranks(graceful=True)

    @abstractmethod
    def _stop_ranks(self, graceful: bool) -> None:
        """Stop every rank, asking each to leave first when `graceful` (not after a failure: the
        ranks are out of step); idempotent, never raises."""

    # ---- failing ------------------------------------------------------------------------------

    def _check(self) -> None:
        """Raise the recorded failure, or that the executor was shut down."""
        if self._error is not None:
            raise self._error
        if not self._finalizer.alive:
            raise RuntimeError(f"the {self.kind} executor has been shut down")

    def _interrupted(self, doing: str) -> None:
        """A wait was interrupted (KeyboardInterrupt, SystemExit): a reply may still be in flight,
        so the ranks are out of step and go. The caller re-raises."""
        self._error = RuntimeError(f"interrupted while {doing}; the {self.workers} were stopped")
        self._stop_ranks(graceful=False)

    def _raise(self, title: str, causes: list[str], traceback_of: WorkerError | None = None) -> NoReturn:
        """Record "`title`: cause; then cause" (with `traceback_of`'s traceback) as the error every
        later call raises, log it, stop every rank, and raise it."""
        message = f"{title}: " + "; then ".join(causes or ["unknown cause"])
        if traceback_of is not None:
            message += f"\n--- rank {traceback_of.rank} traceback ---\n{traceback_of.traceback}"
        self._error = RuntimeError(message)
        self._logger.error("%s", message)
        self._stop_ranks(graceful=False)
        raise self._error


def no_reply(ranks: Iterable[int], doing: str) -> str:
    """The cause when ranks let WORKER_TIMEOUT_S pass without a reply."""
    return (f"rank(s) {sorted(ranks)} gave no reply within {WORKER_TIMEOUT_S:.0f} s while {doing} "
            "(raise PORTSIDE_WORKER_TIMEOUT if that is expected)")


def protocol_error(rank: int, reply: Any, doing: str) -> str:
    """The cause when a rank answered with the wrong message."""
    return f"protocol error: rank {rank} sent {type(reply).__name__} while {doing}"
