"""Executors run the model runner on every tensor-parallel rank. This one: one rank, in-process."""

from __future__ import annotations

from portside.backend_api import Platform
from portside.config import EngineConfig
from portside.sched.output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: EngineConfig, platform: type[Platform], eos_token_id: int | None) -> None:
        from portside.runner.model_runner import ModelRunner

        self.runner = ModelRunner(config, platform, platform.communicator(), eos_token_id)

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def weight_bytes(self) -> int:
        return self.runner.weight_bytes

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, platform: type[Platform], eos_token_id: int | None):
    """One rank: in-process. More: one spawned worker per rank on this machine, unless a
    launcher (torchrun) started this process as rank 0 of a WORLD_SIZE > 1 world, whose other
    ranks run `python -m portside.distributed.worker`."""
    if config.parallel.distributed_executor_backend == "ray":  # one Ray actor per rank, on any node of the cluster
        from portside.engine.ray_executor import RayExecutor

        return RayExecutor(config, platform, eos_token_id)
    from portside.distributed.env import launcher_env

    world = config.parallel.world_size
    env = launcher_env()
    if world > 1 and env is not None and env.world_size > 1:
        if config.parallel.pipeline_parallel_size > 1:
            raise ValueError("pipeline parallelism under a launcher (torchrun) is not supported; let portside start the "
                             "ranks (--distributed-executor-backend mp on one machine, ray across machines)")
        from portside.distributed.launched import LaunchedExecutor

        return LaunchedExecutor(config, platform, eos_token_id, env)
    if world == 1 and config.parallel.data_parallel_size == 1:  # a data-parallel replica computes in a worker process
        return UniProcExecutor(config, platform, eos_token_id)
    from portside.engine.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, platform, eos_token_id)
