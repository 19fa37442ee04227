"""The worker's half of a KV connector (the contract: `portside.kv_transfer.base`).

The model runner builds one from `EngineConfig.kv_transfer` once its KV caches exist
(`make_kv_connector_worker`), and per step calls `start_step(meta)` before the forward,
`finish_step(meta)` after it, and `take_output()` for the step's `ModelRunnerOutput`. Blocks move
through the platform's `KVBlockIO` in the neutral layout (`portside.contract.kv_transfer`).

Under tensor or pipeline parallelism every rank runs one over its part of each block (its KV
heads, its stage's layers), at the same host slots and block hashes as the others, with a
fingerprint of its own (the rank's tp and pp index are part of it), so its files are its own and
a restart with the same parallel layout finds them; the executor merges the ranks' reports
(`portside.kv_transfer.ranks`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from portside.contract import KVBlockIO, KVBlockLayout
from portside.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVTransferInfo
from portside.kv_transfer.config import KVTransferConfig
from portside.kv_transfer.factory import connector_class

__all__ = ["KVConnectorWorker", "make_kv_connector_worker"]


class KVConnectorWorker(ABC):
    """Executes a connector's `KVConnectorMetadata` on one rank."""

    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor], io: KVBlockIO, fingerprint: str,
                 rank: int = 0) -> None:
        self.config = config
        self.kv_caches = kv_caches
        self.io = io
        self.layout: KVBlockLayout = io.layout
        self.fingerprint = fingerprint
        self.rank = rank

    @property
    def info(self) -> KVTransferInfo:
        return KVTransferInfo(self.layout.block_bytes, self.fingerprint)

    @abstractmethod
    def start_step(self, meta: KVConnectorMetadata | None) -> None:
        """Before the step's forward: saves of blocks about to be reused (done when this returns),
        then the loads (may continue in the background into blocks no step touches)."""

    def finish_step(self, meta: KVConnectorMetadata | None) -> None:
        """After the step's forward: saves of KV the step computed. Default: nothing."""

    @abstractmethod
    def take_output(self) -> KVConnectorOutput | None:
        """Loads finished or failed since the last call, and counters; None: nothing to report."""

    def shutdown(self) -> None:
        """Stop background work. Default: nothing."""


def make_kv_connector_worker(config: KVTransferConfig, kv_caches: list[torch.Tensor], io: KVBlockIO,
                             identity: tuple[str, ...], rank: int = 0) -> Any:
    """The configured connector's worker half; `identity` (model path, dtype, ...) goes into the
    fingerprint of the blocks it stores."""
    cls = connector_class(config.connector, "worker")
    return cls(config, kv_caches, io, io.layout.fingerprint(*identity), rank)


def extra_identity(config: Any) -> tuple[str, ...]:
    """What else changes a block's bytes beyond the layout and the model's path, dtype, cache dtype
    and parallel shape (`KVBlockLayout.fingerprint`): quantized weights, and a speculative draft
    model or EAGLE/MTP head, whose layers' KV rides in the blocks."""
    identity: tuple[str, ...] = ()
    if config.model.quantization is not None:
        identity += (f"quantization={config.model.quantization!r}",)
    spec = config.speculative
    if spec is not None and spec.method != "ngram":
        draft = spec.draft
        identity += (f"draft={spec.method}:{spec.model}" + (f":{draft.dtype}:{draft.quantization!r}" if draft else ""),)
    return identity


class RunnerKVTransfer:
    """The model runner's side of the configured connector: no-ops without one."""

    def __init__(self) -> None:
        self.worker: KVConnectorWorker | None = None

    def setup(self, config: Any, platform: Any, backend: Any, spec: Any, kv_caches: list[torch.Tensor],
              block_size: int, rank: int, draft: tuple[Any, list[torch.Tensor]] | None = None) -> None:
        """Build the worker half once the caches exist (`config`: the `EngineConfig`). `draft`: a
        speculative draft model's or EAGLE/MTP head's (`KVCacheSpec`, caches), which use the same
        block ids: its layers ride in each block after the target's (`KVBlockLayout.draft`)."""
        self.release()  # a wake-up after sleep builds a new one
        if config.kv_transfer is None:
            return
        layout = platform.kv_block_layout(spec, block_size)
        if draft is not None:
            layout = layout.with_draft(platform.kv_block_layout(draft[0], block_size))
            kv_caches = [*kv_caches, *draft[1]]
        io = platform.kv_block_io(backend, layout)
        par = config.parallel
        tp = par.tensor_parallel_size
        identity: tuple[str, ...] = (str(config.model.path), str(config.model.dtype), config.cache.kv_cache_dtype,
                                     f"tp{tp}", f"pp{par.pipeline_parallel_size}")
        if par.world_size > 1:  # this rank's part (its heads, its stage's layers): files of its own
            identity += (f"tp-rank{rank % tp}", f"pp-rank{rank // tp}")
        identity += extra_identity(config)
        self.worker = make_kv_connector_worker(config.kv_transfer, kv_caches, io, identity, rank)

    @property
    def info(self) -> KVTransferInfo | None:
        return None if self.worker is None else self.worker.info

    def start_step(self, meta: KVConnectorMetadata | None) -> None:
        if self.worker is not None:
            self.worker.start_step(meta)

    def finish_step(self, meta: KVConnectorMetadata | None) -> KVConnectorOutput | None:
        """After the forward: the post-forward saves, then the worker's report for the step's output."""
        if self.worker is None:
            return None
        self.worker.finish_step(meta)
        return self.worker.take_output()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    def release(self) -> None:
        """Stop the worker and let go of it, with the caches and host buffer it holds (sleep)."""
        self.shutdown()
        self.worker = None
