"""The executor contract: what the engine asks of whatever runs the model on the ranks of one
engine replica.

Four executors implement it (`portside.executor.make_executor` picks one from the config):

- `UniProcExecutor` (`uniproc`): one rank, the model runner in the engine process;
- `MultiprocExecutor` (`multiproc`): TP x PP ranks on this machine, one worker process each;
- `RayExecutor` (`ray`): TP x PP ranks as Ray actors, on one node or many;
- `LaunchedExecutor` (`launched`): a world started by a launcher (torchrun), this process rank 0.

Data parallelism (`portside.engine.data_parallel`) runs several whole engines, each with its own
executor of one of these kinds; it never talks to an executor itself.

The engine knows only `Executor`: it never asks which kind it has. What only some executors can
do has a default here (`submit` runs the step at once, `check_health` finds nothing wrong, `pids`
is empty), so every executor answers every call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from portside.sched.output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Runs the model runner on every rank of one engine replica.

    The engine calls, in order: `determine_num_blocks`, `initialize_kv_cache` (once), then per
    step `submit` (or `execute_model`), `check_health` while idle, and `shutdown` at the end (also
    after a failed start). A method that finds a rank failed raises RuntimeError naming the rank
    and its cause; the executor has then stopped its ranks, and every later call raises.

    Every executor sets `vocab_size` and `weight_bytes` in its constructor, once the model is
    loaded.
    """

    vocab_size: int
    """The model's vocabulary size (the width of the logits the sampler sees)."""

    weight_bytes: int
    """The loaded model's weights in bytes, every rank together (final once
    `determine_num_blocks` has returned)."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """How many KV-cache blocks fit: the smallest number any rank can hold, since every rank
        caches the same blocks (of its own heads or layers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV-cache blocks on every rank (once, before the first step)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank and return its output (the sampled tokens)."""

    def submit(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start one step; the returned call gives its output. Up to `max_concurrent_batches`
        steps may be in flight, and their calls must be made in the order of the submits. By
        default the step runs here, at once."""
        out = self.execute_model(scheduler_output)
        return lambda: out

    @property
    def max_concurrent_batches(self) -> int:
        """How many submitted steps the engine may keep in flight (pipeline parallelism's
        micro-batches); 1 where a step runs to its end before the next starts."""
        return 1

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` on the model runner of every rank, between steps: a `ModelRunner`
        method's name, or a picklable function called as ``method(runner, *args, **kwargs)``
        (vLLM's `collective_rpc`). Returns every rank's result, by rank. An error a rank raises
        comes back raised here (ValueError and TypeError as themselves), and the ranks go on.
        Default: not supported (NotImplementedError)."""
        raise NotImplementedError(f"{type(self).__name__} does not run collective_rpc")

    def check_health(self) -> None:
        """Raise the error a step would raise when a rank has died; called while the engine is
        idle, so that a dead worker is reported without a request. By default: nothing to check."""

    @property
    def pids(self) -> list[int]:
        """The local worker processes this executor started, by rank (diagnostics and tests);
        empty where no rank runs in a child process of this one."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank and release what the executor holds; idempotent, and safe after a
        failure or a failed start."""
