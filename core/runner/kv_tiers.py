"""The KV tiers connector, worker half: the host tier's buffer, the disk tier's files, and the
copies (the scheduler half, which decides, is `portside.kv_transfer.tiers`).

`start_step` runs the step's ops in order (device -> host saves, host -> disk spills, file
removals) before the forward, then hands the step's loads to a background thread, which copies
host slots (or verified disk files) into the target device blocks while later steps run: those
blocks are held by the scheduler, so no step reads or writes them meanwhile. `take_output`
reports the requests whose loads ended, with how many of their blocks are good: a disk file
that fails its checks stops its request's load there (counted as `corrupt_blocks`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import torch

from portside.contract import KVBlockIO, host_zeros
from portside.kv_transfer import disk_format
from portside.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput
from portside.kv_transfer.config import KVTransferConfig
from portside.kv_transfer.tiers import TiersMetadata
from portside.runner.kv_transfer import KVConnectorWorker

__all__ = ["TiersWorker"]

logger = logging.getLogger(__name__)


class TiersWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor], io: KVBlockIO, fingerprint: str,
                 rank: int = 0) -> None:
        super().__init__(config, kv_caches, io, fingerprint, rank)
        bb = self.layout.block_bytes
        num_slots = config.cpu_bytes // bb
        # mapped lazily: a large tier costs memory only as blocks arrive
        self.host = host_zeros(max(1, num_slots) * bb).view(max(1, num_slots), bb)
        self.disk_dir = disk_format.folder(config.disk_path, fingerprint) if config.disk_path is not None else None
        self._jobs: queue.Queue[tuple[str, list[Any]] | None] = queue.Queue()
        self._done = threading.Condition()
        self._finished: KVConnectorOutput = KVConnectorOutput()
        self._pending = 0
        self._thread = threading.Thread(target=self._load_loop, name="portside-kv-tiers", daemon=True)
        self._thread.start()

    # ---- before the forward ------------------------------------------------------------------

    def start_step(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, TiersMetadata):
            return
        t0 = time.perf_counter()
        saves: list[tuple[int, int]] = []
        for op in meta.ops:
            if op[0] == "save":
                saves.append((op[1], op[2]))
                continue
            self._flush_saves(saves)
            if op[0] == "spill":
                _, slot, block_hash, parent, tokens = op
                assert self.disk_dir is not None
                disk_format.write(disk_format.path_of(self.disk_dir, block_hash), self.fingerprint, block_hash, parent,
                                  tokens, self.host[slot].numpy().data)
            elif op[0] == "remove":
                assert self.disk_dir is not None
                disk_format.remove(disk_format.path_of(self.disk_dir, op[1]))
        self._flush_saves(saves)
        if meta.ops:
            self._count("save_seconds", time.perf_counter() - t0)
        for req_id, loads in meta.loads.items():
            with self._done:
                self._pending += 1
            self._jobs.put((req_id, loads))

    def _flush_saves(self, saves: list[tuple[int, int]]) -> None:
        if not saves:
            return
        blocks = self.io.read(self.kv_caches, [b for b, _ in saves])
        self.host[torch.tensor([s for _, s in saves])] = blocks.reshape(len(saves), -1).view(torch.uint8)
        self._count("save_bytes", len(saves) * self.layout.block_bytes)
        saves.clear()

    # ---- the loader thread -------------------------------------------------------------------

    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            req_id, loads = job
            t0 = time.perf_counter()
            try:
                good = self._load(loads)
            except Exception:  # never a hang: the request recomputes what did not arrive
                logger.exception("KV tiers: loading blocks for request %s failed; they are recomputed", req_id)
                good = 0
            with self._done:
                out = self._finished
                out.finished_loading.add(req_id)
                if good < len(loads):
                    out.failed_loading[req_id] = good
                for key, value in (("load_seconds", time.perf_counter() - t0), ("loads", 1),
                                   ("load_bytes", good * self.layout.block_bytes)):
                    out.stats[key] = out.stats.get(key, 0.0) + value
                self._pending -= 1
                self._done.notify_all()

    def _load(self, loads: list[Any]) -> int:
        """Copy the blocks in; returns how many (a prefix of `loads`) arrived intact."""
        payloads: list[torch.Tensor] = []
        for _, kind, key in loads:
            if kind == "host":
                payloads.append(self.host[key])
                continue
            block_hash, parent, tokens = key
            assert self.disk_dir is not None
            try:
                data = disk_format.read_payload(disk_format.path_of(self.disk_dir, block_hash), self.fingerprint,
                                                block_hash, parent, tuple(tokens), self.layout.block_bytes)
            except disk_format.CorruptBlock as e:
                logger.warning("KV tiers: disk block %016x dropped: %s", block_hash & (2**64 - 1), e)
                self._count("corrupt_blocks", 1)
                break
            payloads.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if payloads:
            self.io.write(self.kv_caches, [b for b, _, _ in loads[: len(payloads)]], torch.stack(payloads))
        return len(payloads)

    def _count(self, key: str, value: float) -> None:
        with self._done:
            self._finished.stats[key] = self._finished.stats.get(key, 0.0) + value

    # ---- the report --------------------------------------------------------------------------

    def take_output(self) -> KVConnectorOutput | None:
        with self._done:
            if self._pending and not self._finished.finished_loading:
                self._done.wait(0.002)  # a step with only loads to wait for: not a hot spin
            out, self._finished = self._finished, KVConnectorOutput()
        return out if out.finished_loading or out.stats else None

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
