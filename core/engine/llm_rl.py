"""`LLM`'s methods for reinforcement learning, as vLLM's `LLM` names them (mixed into `LLM`):
weight updates in place, `collective_rpc`, sleep and wake-up, `reset_prefix_cache`. See
`portside.engine.rl_engine` for what each does, and docs/rl.md."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch


class LLMWeights:
    engine: Any

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (Hugging Face parameter name, tensor) pairs into the running model, on every
        rank (each takes its tensor-parallel shard, each pipeline stage its layers); all or
        nothing: an unknown name, a wrong shape or dtype (it must be the model's) or a quantized
        layer raises ValueError with the model unchanged. The prefix cache is reset. Returns
        the number of tensors."""
        return self.engine.update_weights(weights)

    def update_weights_from_path(self, path: str | os.PathLike[str]) -> int:
        """`update_weights` with every tensor of the safetensors checkpoint in folder `path`
        (a Hugging Face model folder; dtypes converted as loading does)."""
        return self.engine.update_weights_from_path(os.fspath(path))

    def init_weight_transfer(self, host: str, port: int, world_size: int) -> None:
        """Join a trainer's weight-update group: the trainer (another process) is member 0 and
        hosts it at host:port (`portside.distributed.weight_transfer.WeightTransferGroup`); this
        engine's ranks are members 1..world_size-1 (world_size = 1 + TP x PP). Blocks until every
        member has joined."""
        self.engine.init_weight_transfer(host, port, world_size)

    def receive_weights(self) -> int:
        """Wait for the trainer's next `WeightTransferGroup.send` and apply it on every rank, all
        or nothing (a refusal raises ValueError here and in the trainer); returns the tensors."""
        return self.engine.receive_weights()

    def close_weight_transfer(self) -> None:
        """Leave the weight-update group; the trainer calls `WeightTransferGroup.close` at the same
        time (each waits for the other)."""
        self.engine.close_weight_transfer()

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` on the model runner of every rank: the name of a `ModelRunner` method, or
        a picklable function called as ``method(runner, *args, **kwargs)``; every rank's result,
        by rank (vLLM's `LLM.collective_rpc`, whose functions take the worker)."""
        return self.engine.collective_rpc(method, args, kwargs)

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory: level 1 offloads the weights to host memory (on cpu: to a
        temporary file, so the process's resident memory falls) and drops the KV cache; level 2
        drops both (the weights come back by `update_weights` / `update_weights_from_path`).
        Generating while asleep raises `EngineAsleepError`."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `sleep` released: tags None (everything), ["weights"] or ["kv_cache"]."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self.engine.is_sleeping)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM returns whether it could; here it always can)."""
        self.engine.reset_prefix_cache()
        return True
