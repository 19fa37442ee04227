"""Executors run the model runner on every tensor-parallel rank. This one: one rank, in-process."""

from __future__ import annotations

from portside.backend_api import Platform
from portside.config import EngineConfig
from portside.sched.output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: EngineConfig, platform: type[Platform], eos_token_id: int | None) -> None:
        from portside.runner.model_runner import ModelRunner

        self.runner = ModelRunner(config, platform, platform.communicator(), eos_token_id)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig, platform: type[Platform], eos_token_id: int | None):
    if config.parallel.tensor_parallel_size == 1:
        return UniProcExecutor(config, platform, eos_token_id)
    from portside.engine.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, platform, eos_token_id)
