"""The shared-storage KV connector, worker half: block files in a directory other instances read
(the scheduler half, which decides, is `portside.kv_transfer.shared_storage`).

`start_step` loads the step's blocks before the forward (synchronously: the blocks' requests are
waiting, held out of every batch, so the copy only delays this step), stopping a request's load
at its first missing or damaged file; `finish_step` writes the blocks the step's forward computed,
before the step's outputs go back (so a prefill instance's answer means its blocks are on disk).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from portside.contract import KVBlockIO
from portside.kv_transfer import disk_format
from portside.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput
from portside.kv_transfer.config import KVTransferConfig
from portside.kv_transfer.shared_storage import BlockRef, SharedStorageMetadata
from portside.runner.kv_transfer import KVConnectorWorker

__all__ = ["SharedStorageWorker"]

logger = logging.getLogger(__name__)


class SharedStorageWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor], io: KVBlockIO, fingerprint: str,
                 rank: int = 0) -> None:
        super().__init__(config, kv_caches, io, fingerprint, rank)
        path = config.option("path")
        assert path is not None  # checked by the scheduler half
        self.folder = disk_format.folder(path, fingerprint)
        self._out = KVConnectorOutput()

    def start_step(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, SharedStorageMetadata):
            return
        for req_id, blocks in meta.loads.items():
            t0 = time.perf_counter()
            good = self._load(blocks)
            self._out.finished_loading.add(req_id)
            if good < len(blocks):
                self._out.failed_loading[req_id] = good
                self._count("failed_load_blocks", len(blocks) - good)
            self._count("loads", 1)
            self._count("loaded_blocks", good)
            self._count("load_bytes", good * self.layout.block_bytes)
            self._count("load_seconds", time.perf_counter() - t0)

    def _load(self, blocks: list[BlockRef]) -> int:
        """Copy the blocks in; how many (a prefix of `blocks`) arrived intact."""
        payloads: list[torch.Tensor] = []
        for _, block_hash, parent, tokens in blocks:
            path = disk_format.path_of(self.folder, block_hash)
            try:
                data = disk_format.read_payload(path, self.fingerprint, block_hash, parent, tuple(tokens),
                                                self.layout.block_bytes)
            except disk_format.CorruptBlock as e:
                if os.path.exists(path):
                    logger.warning("shared-storage KV: block %016x not used (%s); its tokens are recomputed",
                                   block_hash & (2**64 - 1), e)
                    self._count("corrupt_blocks", 1)
                    if "holds another block" not in str(e):  # damaged, not a hash collision: a producer rewrites it
                        disk_format.remove(path)
                break
            payloads.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if payloads:
            try:
                self.io.write(self.kv_caches, [b for b, _, _, _ in blocks[: len(payloads)]], torch.stack(payloads))
            except Exception:  # never a hang or wrong KV: the request recomputes them all
                logger.exception("shared-storage KV: writing %d loaded block(s) failed", len(payloads))
                return 0
        return len(payloads)

    def finish_step(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, SharedStorageMetadata) or not meta.saves:
            return
        t0 = time.perf_counter()
        blocks = self.io.read(self.kv_caches, [b for b, _, _, _ in meta.saves])
        raw = blocks.reshape(len(meta.saves), -1).view(torch.uint8)
        for i, (_, block_hash, parent, tokens) in enumerate(meta.saves):
            try:
                disk_format.write(disk_format.path_of(self.folder, block_hash), self.fingerprint, block_hash, parent,
                                  tokens, raw[i].numpy().data)
            except OSError as e:  # a full disk: the consumer recomputes what is missing
                logger.warning("shared-storage KV: saving block %016x failed: %s", block_hash & (2**64 - 1), e)
                continue
            self._count("saved_blocks", 1)
            self._count("save_bytes", self.layout.block_bytes)
        self._count("save_seconds", time.perf_counter() - t0)

    def _count(self, key: str, value: float) -> None:
        self._out.stats[key] = self._out.stats.get(key, 0.0) + value

    def take_output(self) -> KVConnectorOutput | None:
        out, self._out = self._out, KVConnectorOutput()
        return out if out.finished_loading or out.stats else None
