"""The KV tiers connector, scheduler half: host memory and disk behind the device cache.

A cached device block the pool evicts for reuse is copied to the host tier
(`--kv-offload-cpu-bytes`, LRU); a block the host tier evicts is written to the disk tier
(`--kv-offload-disk-path`, `--kv-offload-disk-bytes`, LRU, one checksummed file per block). A
waiting request whose prefix continues, past its device hit, in these tiers has those blocks
loaded back (`portside.sched.kv_loads`), host first, else disk. With `--preemption-mode swap` a
preempted request's blocks are copied to the host tier at once (swap-out) and come back the same
way on resume.

This half owns the index (block hash -> where it is, with its parent hash and token ids, which a
load is verified against) and decides; the worker half (`portside.runner.kv_tiers`) owns the
bytes and executes `TiersMetadata.ops` in order, before the step's forward. A host slot or disk
file being loaded from is pinned until the worker reports the load, so it is never reused
meanwhile.

Disk files live in ``<disk path>/portside-kv-<fingerprint>/`` (the fingerprint covers the model
and the neutral block layout, `KVTransferInfo.fingerprint`), so another model never reads them;
a restarted engine rebuilds the index from their headers (`portside.kv_transfer.disk_format`),
least recently written evicted first. A file whose checksum or header does not match is
reported by the worker as a failed load: dropped, counted (`corrupt_blocks`), its tokens
recomputed.

Tensor and pipeline parallelism: the index, the host slot numbers and the ops are the same for
every rank; each rank's worker half keeps its part of each block (its KV heads, its stage's
layers) in its own host buffer, at the slot this half assigns, and in its own folder (its
fingerprint includes the rank's tp and pp index: `KVTransferInfo.parts`). A block is on disk when
every rank's file is; a restart indexes only those. `--kv-offload-cpu-bytes` and
`--kv-offload-disk-bytes` count every rank's parts together (vLLM's rule for its offloading size).
A load is finished when every rank's is, with the fewest good blocks any rank reported
(`portside.kv_transfer.ranks`): a file damaged on one rank is recomputed from there on all.

Sliding-window models: the prefix cache enters a request's blocks that fell out of the window
before it frees them, so they are cached blocks like any other (their KV intact until the pool
hands them out again, when they are saved here); a table's null placeholders have no hash and
are never saved, and a load, like a prefix hit, is a chain from the first block.

With KV events on (`--kv-events-config`, docs/kv_events.md) the tiers report their blocks too,
beside the device cache's "GPU" ones: a block copied to the host tier is stored with medium
"CPU" and removed from it when the host tier lets it go, likewise "DISK" for the disk tier (the
files a restarted engine finds are announced at its first step). A reset reports nothing more
than the device cache's `AllBlocksCleared`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from portside.kv_cache.kv_events import KVEventRecorder
from portside.kv_transfer import disk_format
from portside.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, KVTransferInfo
from portside.kv_transfer.config import KVTransferConfig

if TYPE_CHECKING:
    from portside.request import Request
    from portside.sched.output import SchedulerOutput

__all__ = ["TiersMetadata", "TiersScheduler"]

# ops, executed in order by the worker before the step's forward:
#   ("save", device_block_id, host_slot)                              device -> host
#   ("spill", host_slot, block_hash, parent_hash, token_ids)          host -> a new disk file
#   ("remove", block_hash)                                            delete its disk file
Op = tuple[Any, ...]
# a load: (device_block_id, "host", host_slot) or (device_block_id, "disk", (block_hash, parent_hash, token_ids))
Load = tuple[int, str, Any]


@dataclass
class TiersMetadata(KVConnectorMetadata):
    ops: list[Op] = field(default_factory=list)
    loads: dict[str, list[Load]] = field(default_factory=dict)  # req_id -> its blocks, in table order


@dataclass(eq=False)
class _Entry:
    parent_hash: int | None
    token_ids: tuple[int, ...]
    host_slot: int | None = None
    on_disk: bool = False
    pins: int = 0  # loads in flight reading it


class TiersScheduler(KVConnectorScheduler):
    """Host and disk tiers: the index and the decisions (see the module docstring)."""

    def __init__(self, config: KVTransferConfig, block_size: int, info: KVTransferInfo) -> None:
        super().__init__(config, block_size, info)
        self.swap = config.option("swap") == "1"
        self.num_host_slots = config.cpu_bytes // info.block_bytes
        if self.num_host_slots < 1:
            raise ValueError(f"--kv-offload-cpu-bytes {config.cpu_bytes} holds no KV block ({info.block_bytes} bytes "
                             "each); raise it")
        self.free_slots = list(range(self.num_host_slots - 1, -1, -1))
        self.entries: dict[int, _Entry] = {}
        self.host_lru: OrderedDict[int, _Entry] = OrderedDict()  # hash -> entry, least recently used first
        self.disk_lru: OrderedDict[int, _Entry] = OrderedDict()
        # the disk tier: one folder per rank (its part of every block), `KVTransferInfo.parts`
        self.disk_dirs: list[str] = []
        self.num_disk_files = 0
        self._file_bytes = sum(disk_format.file_bytes(bb, block_size) for _, bb in info.parts)  # a block, every rank's
        if config.disk_path is not None:
            self.disk_dirs = [disk_format.folder(config.disk_path, fp) for fp, _ in info.parts]
            self.num_disk_files = config.disk_bytes // self._file_bytes
            if self.num_disk_files < 1:
                raise ValueError(f"--kv-offload-disk-bytes {config.disk_bytes} holds no KV block file; raise it")
        self.ops: list[Op] = []
        self.loads: dict[str, list[Load]] = {}  # recorded this step
        self.inflight: dict[str, list[int]] = {}  # req_id -> hashes being loaded (pinned)
        self._matched: dict[str, list[int]] = {}  # req_id -> hashes found by get_num_new_matched_tokens
        self.counters: dict[str, float] = dict.fromkeys(
            ("host_hit_blocks", "disk_hit_blocks", "host_saved_blocks", "disk_saved_blocks", "swapped_out_blocks",
             "corrupt_blocks", "failed_load_blocks", "loads", "load_seconds", "load_bytes", "save_seconds", "save_bytes",
             "disk_evicted_blocks"), 0.0)
        if self.disk_dirs:
            self._rebuild_disk_index()
        self._announced = False  # the disk tier's blocks reported to KV events (`_events`)
        self._quiet = False  # a reset: no removals (the device cache reports AllBlocksCleared)

    # ---- the index ---------------------------------------------------------------------------

    def _rebuild_disk_index(self) -> None:
        """A restart: index the blocks whose file every rank's folder holds, with the same parent
        and tokens (oldest first, by the first rank's files); the other files, and the oldest
        beyond capacity, are deleted."""
        scans = []
        for folder, (fp, _) in zip(self.disk_dirs, self.info.parts, strict=True):
            found, num_corrupt = disk_format.scan(folder, fp)
            self.counters["corrupt_blocks"] += num_corrupt
            scans.append(found)
        keys = [{(h, parent, tokens) for _, h, parent, tokens in found} for found in scans]
        whole = set.intersection(*keys)
        kept = [f for f in scans[0] if (f[1], f[2], f[3]) in whole]
        kept = kept[max(0, len(kept) - self.num_disk_files):]
        keep = {(h, parent, tokens) for _, h, parent, tokens in kept}
        for found in scans:
            for path, h, parent, tokens in found:
                if (h, parent, tokens) not in keep:
                    disk_format.remove(path)
        for _, block_hash, parent, tokens in kept:
            entry = _Entry(parent, tokens, on_disk=True)
            self.entries[block_hash] = entry
            self.disk_lru[block_hash] = entry

    def _find(self, block_hash: int, parent: int | None, tokens: tuple[int, ...]) -> _Entry | None:
        entry = self.entries.get(block_hash)
        if entry is None or entry.token_ids != tokens or entry.parent_hash != parent:
            return None
        return entry

    def _events(self) -> KVEventRecorder | None:
        """The KV-events recorder (None: events off), once the disk tier's blocks are announced."""
        events = self.kv.pool.events if self.kv is not None and not self._quiet else None
        if events is not None and not self._announced:
            self._announced = True
            for block_hash, entry in self.disk_lru.items():
                events.stored(block_hash, entry.parent_hash, entry.token_ids, medium="DISK")
        return events

    def _drop(self, block_hash: int) -> None:
        """Forget a block in every tier (its file is removed)."""
        entry = self.entries.pop(block_hash, None)
        if entry is None:
            return
        if (events := self._events()) is not None:
            for medium, held in (("CPU", entry.host_slot is not None), ("DISK", entry.on_disk)):
                if held:
                    events.removed(block_hash, medium)
        if entry.host_slot is not None:
            self.host_lru.pop(block_hash, None)
            self.free_slots.append(entry.host_slot)
            entry.host_slot = None
        if entry.on_disk:
            self.disk_lru.pop(block_hash, None)
            self.ops.append(("remove", block_hash))
            entry.on_disk = False

    def _take_host_slot(self) -> int | None:
        """A free host slot, evicting the least recently used unpinned block (to disk, if any)."""
        if self.free_slots:
            return self.free_slots.pop()
        block_hash = next((h for h, e in self.host_lru.items() if e.pins == 0), None)
        if block_hash is None:
            return None  # every host block is being loaded from
        entry = self.host_lru[block_hash]
        slot = entry.host_slot
        assert slot is not None
        del self.host_lru[block_hash]
        entry.host_slot = None
        if (events := self._events()) is not None:
            events.removed(block_hash, "CPU")
        if self.disk_dirs and not entry.on_disk:
            self._spill(block_hash, entry, slot)
        if not entry.on_disk:
            del self.entries[block_hash]
        return slot

    def _spill(self, block_hash: int, entry: _Entry, slot: int) -> None:
        while len(self.disk_lru) >= self.num_disk_files:
            victim = next((h for h, e in self.disk_lru.items() if e.pins == 0), None)
            if victim is None:
                return  # every file is being loaded from: the block is not kept
            self.counters["disk_evicted_blocks"] += 1
            self._drop(victim)
        self.ops.append(("spill", slot, block_hash, entry.parent_hash, entry.token_ids))
        entry.on_disk = True
        self.disk_lru[block_hash] = entry
        if (events := self._events()) is not None:
            events.stored(block_hash, entry.parent_hash, entry.token_ids, medium="DISK")
        self.counters["disk_saved_blocks"] += 1

    def _save(self, block_id: int, block_hash: int, parent: int | None, tokens: tuple[int, ...]) -> bool:
        """Copy a device block to the host tier (a no-op when it is there already)."""
        entry = self._find(block_hash, parent, tokens)
        if entry is not None and entry.host_slot is not None:
            self.host_lru.move_to_end(block_hash)
            return False
        if entry is None and block_hash in self.entries:
            self._drop(block_hash)  # same hash, other tokens (a collision): the newer block wins
        slot = self._take_host_slot()
        if slot is None:
            return False
        if entry is None:
            entry = self.entries[block_hash] = _Entry(parent, tokens)
        entry.host_slot = slot
        self.host_lru[block_hash] = entry
        if (events := self._events()) is not None:
            events.stored(block_hash, parent, tokens, medium="CPU")
        self.ops.append(("save", block_id, slot))
        self.counters["host_saved_blocks"] += 1
        return True

    # ---- the contract ------------------------------------------------------------------------

    def on_evict(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        self._save(block_id, block_hash, parent_hash, token_ids)

    def on_preempt(self, request: Request, block_ids: list[int]) -> None:
        if not self.swap or self.kv is None:
            return
        for block in self.kv.req_to_blocks.get(request.request_id, []):
            if block.block_hash is not None and block.token_ids is not None:
                if self._save(block.block_id, block.block_hash, block.parent_hash, block.token_ids):
                    self.counters["swapped_out_blocks"] += 1

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        assert self.kv is not None
        bs = self.block_size
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // bs
        start = num_computed_tokens // bs
        if start >= max_blocks or not self.entries:
            return 0
        hashes = self.kv.block_hashes(request, max_blocks)
        matched = []
        for i in range(start, max_blocks):
            if self._find(hashes[i], hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs])) is None:
                break
            matched.append(hashes[i])
        self._matched[request.request_id] = matched
        return len(matched) * bs

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, [])
        assert len(matched) == len(block_ids), (matched, block_ids)
        loads: list[Load] = []
        for block_id, block_hash in zip(block_ids, matched, strict=True):
            entry = self.entries[block_hash]
            entry.pins += 1
            if entry.host_slot is not None:
                self.host_lru.move_to_end(block_hash)
                loads.append((block_id, "host", entry.host_slot))
                self.counters["host_hit_blocks"] += 1
            else:
                self.disk_lru.move_to_end(block_hash)
                loads.append((block_id, "disk", (block_hash, entry.parent_hash, entry.token_ids)))
                self.counters["disk_hit_blocks"] += 1
        self.loads[request.request_id] = loads
        self.inflight[request.request_id] = matched

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        self._events()  # a restarted engine's disk blocks are announced at its first step
        self._matched.clear()
        if not self.ops and not self.loads:
            return None
        meta = TiersMetadata(self.ops, self.loads)
        self.ops, self.loads = [], {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for key, value in output.stats.items():
            self.counters[key] = self.counters.get(key, 0.0) + value
        for req_id in output.finished_loading:
            hashes = self.inflight.pop(req_id, [])
            for block_hash in hashes:
                entry = self.entries.get(block_hash)
                if entry is not None:
                    entry.pins -= 1
            good = output.failed_loading.get(req_id, len(hashes))
            if good < len(hashes):  # the first bad block is dropped (recomputed); the rest stay indexed
                self.counters["failed_load_blocks"] += len(hashes) - good
                self._drop(hashes[good])

    def reset(self) -> None:
        self._quiet = True
        for block_hash in list(self.entries):
            self._drop(block_hash)
        self._quiet = False
        for hashes in self.inflight.values():  # their loads are discarded (`KVLoads`): pins are moot
            hashes.clear()

    def weights_changed(self) -> None:
        """From now on no block reaches the disk tier: a server restarted on the checkpoint would
        load KV computed with the updated weights (the files stored before were removed by `reset`)."""
        self.disk_dirs = []

    def has_pending_work(self) -> bool:
        return bool(self.ops)

    def stats(self) -> dict[str, Any]:
        bb = self.info.block_bytes
        return {**self.counters, "host_blocks": len(self.host_lru), "host_bytes": len(self.host_lru) * bb,
                "host_capacity_bytes": self.num_host_slots * bb, "disk_blocks": len(self.disk_lru),
                "disk_bytes": len(self.disk_lru) * self._file_bytes}

    def check_integrity(self) -> None:
        """Every entry is in some tier; host slots are each used once or free."""
        slots = [e.host_slot for e in self.host_lru.values()]
        assert len(set(slots)) == len(slots) and not set(slots) & set(self.free_slots)
        assert len(slots) + len(self.free_slots) == self.num_host_slots
        for block_hash, entry in self.entries.items():
            assert entry.host_slot is not None or entry.on_disk, block_hash
            assert (entry.host_slot is not None) == (block_hash in self.host_lru)
            assert entry.on_disk == (block_hash in self.disk_lru)
        for folder in self.disk_dirs:
            assert os.path.isdir(folder)
