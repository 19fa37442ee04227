"""LaunchedExecutor: tensor parallelism over a world started by a launcher (torchrun, a job
scheduler): every process is one rank, on one machine or many.

Rank 0 runs the engine and its own shard in-process; it broadcasts each step's `SchedulerOutput`
to the other ranks (``python -m portside.distributed.worker``) with `broadcast_object_list` over a
gloo control group (with a KV connector, the ranks' connector reports are gathered back after each
step and merged: `portside.kv_transfer.ranks`). A peer that dies makes rank 0's next collective fail (gloo notices the closed
connection; otherwise after PORTSIDE_DIST_TIMEOUT seconds), which is raised as a RuntimeError.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from portside.config import EngineConfig
from portside.contract import Platform
from portside.distributed.env import LauncherEnv, init_process_group
from portside.distributed.messages import CollectiveRPC, InitKVCache, Shutdown, WorkerSetup
from portside.distributed.rpc import rpc_results
from portside.distributed.worker import (
    Worker,
    broadcast_message,
    control_group,
    destroy_process_group_quietly,
    limit_threads,
)
from portside.executor.base import Executor
from portside.kv_transfer.ranks import KVOutputAggregator
from portside.sched.output import ModelRunnerOutput, SchedulerOutput


class LaunchedExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: type[Platform], eos_token_id: int | None, env: LauncherEnv) -> None:
        tp = config.parallel.tensor_parallel_size
        if env.world_size != tp:
            raise ValueError(
                f"WORLD_SIZE={env.world_size} from the launcher but tensor_parallel_size={tp}; "
                "portside uses the whole launched world as one tensor-parallel group: make them equal"
            )
        if env.rank != 0:
            raise RuntimeError(
                f"this process is rank {env.rank}: only rank 0 runs the engine; "
                "run `python -m portside.distributed.worker` on the other ranks"
            )
        self.world_size = tp
        self._closed = False
        self._kv_outputs = KVOutputAggregator(tp) if config.kv_transfer is not None else None
        limit_threads(platform, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        init_process_group(platform, 0, tp, env.init_method)
        try:
            self._group = control_group()
            broadcast_message(WorkerSetup(config, eos_token_id), self._group)
            self.worker = Worker(config, platform, eos_token_id, 0, env.local_rank)
            self.vocab_size: int = self.worker.runner.vocab_size
            self.weight_bytes: int = self.worker.runner.weight_bytes  # every rank's, once determine_num_blocks ran
        except BaseException:
            destroy_process_group_quietly()
            raise

    def determine_num_blocks(self) -> int:
        gathered: list[Any] = [None] * self.world_size  # (blocks, weight bytes) of every rank
        mine = (self.worker.ready().num_blocks, self.worker.runner.weight_bytes)
        self._guard(lambda: dist.all_gather_object(gathered, mine, group=self._group))
        self.weight_bytes = sum(b for _, b in gathered)
        return min(n for n, _ in gathered)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        msg = InitKVCache(num_blocks)
        self._guard(lambda: (broadcast_message(msg, self._group), self.worker.handle(msg)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        def step() -> ModelRunnerOutput:
            broadcast_message(scheduler_output, self._group)
            out = self.worker.handle(scheduler_output)
            if self._kv_outputs is not None:  # every rank's KV connector report, merged
                gathered: list[Any] = [None] * self.world_size
                dist.all_gather_object(gathered, out.kv_connector_output, group=self._group)
                out.kv_connector_output = self._kv_outputs.aggregate(gathered)
            return out

        return self._guard(step)

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        msg = CollectiveRPC(method, tuple(args), dict(kwargs or {}))

        def call() -> list[Any]:
            broadcast_message(msg, self._group)
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, self.worker.handle(msg), group=self._group)
            return gathered

        return rpc_results(dict(enumerate(self._guard(call))))

    def shutdown(self) -> None:
        """Tell the other ranks to exit (when they still listen) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        try:
            broadcast_message(Shutdown(), self._group)
        except Exception:
            pass
        destroy_process_group_quietly()

    def _guard(self, fn: Any) -> Any:
        if self._closed:
            raise RuntimeError("the tensor-parallel executor has been shut down")
        try:
            return fn()
        except RuntimeError as e:  # gloo/nccl errors are RuntimeErrors (DistBackendError)
            raise RuntimeError(
                f"tensor-parallel step failed on rank 0 ({type(e).__name__}: {e}); "
                "another rank has probably died: see its log"
            ) from e
