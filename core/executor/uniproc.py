"""UniProcExecutor: one rank, the model runner in the engine process."""

from __future__ import annotations

from typing import Any

from portside.config import EngineConfig
from portside.contract import Platform
from portside.distributed.messages import CollectiveRPC
from portside.distributed.rpc import call_on
from portside.executor.base import Executor
from portside.runner.model_runner import ModelRunner
from portside.sched.output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: type[Platform], eos_token_id: int | None) -> None:
        self.runner = ModelRunner(config, platform, platform.communicator(), eos_token_id)
        self.vocab_size = self.runner.vocab_size
        self.weight_bytes = self.runner.weight_bytes

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [call_on(self.runner, CollectiveRPC(method, tuple(args), dict(kwargs or {})))]

    def shutdown(self) -> None:
        pass  # the runner and its KV cache go with the engine
