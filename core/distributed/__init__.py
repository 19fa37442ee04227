"""Multi-process tensor parallelism: process-group setup from the launcher environment, the
messages the engine sends its workers, and the worker loop.

Two ways to run more than one rank:

- one machine, started by the engine (`portside.executor.multiproc.MultiprocExecutor`):
  the engine spawns one worker process per rank and talks to each over a pipe;
- any number of machines, started by a launcher such as ``torchrun``
  (`portside.executor.launched.LaunchedExecutor`): every process is one rank, rank 0 runs the
  engine with its model shard in-process and broadcasts each step to the others, which run
  ``python -m portside.distributed.worker``.
"""

from portside.distributed.env import LauncherEnv, init_process_group, launcher_env
from portside.distributed.messages import InitKVCache, Shutdown, WorkerError, WorkerReady

__all__ = [
    "LauncherEnv",
    "launcher_env",
    "init_process_group",
    "InitKVCache",
    "Shutdown",
    "WorkerError",
    "WorkerReady",
]
