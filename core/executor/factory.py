"""`make_executor`: which executor runs an engine's ranks, chosen from its config and the
launcher's environment."""

from __future__ import annotations

from portside.config import EngineConfig
from portside.contract import Platform
from portside.distributed.env import launcher_env
from portside.executor.base import Executor
from portside.executor.launched import LaunchedExecutor
from portside.executor.multiproc import MultiprocExecutor
from portside.executor.ray import RayExecutor
from portside.executor.uniproc import UniProcExecutor


def make_executor(config: EngineConfig, platform: type[Platform], eos_token_id: int | None) -> Executor:
    """`--distributed-executor-backend ray`: one Ray actor per rank, on any node of the cluster.
    Otherwise one rank: in-process. More: one spawned worker process per rank on this machine,
    unless a launcher (torchrun) started this process as rank 0 of a WORLD_SIZE > 1 world, whose
    other ranks run `python -m portside.distributed.worker`."""
    if config.parallel.distributed_executor_backend == "ray":
        return RayExecutor(config, platform, eos_token_id)
    world = config.parallel.world_size
    env = launcher_env()
    if world > 1 and env is not None and env.world_size > 1:
        if config.parallel.pipeline_parallel_size > 1:
            raise ValueError("pipeline parallelism under a launcher (torchrun) is not supported; let portside start the "
                             "ranks (--distributed-executor-backend mp on one machine, ray across machines)")
        return LaunchedExecutor(config, platform, eos_token_id, env)
    if world == 1 and config.parallel.data_parallel_size == 1:  # a data-parallel replica computes in a worker process
        return UniProcExecutor(config, platform, eos_token_id)
    return MultiprocExecutor(config, platform, eos_token_id)
