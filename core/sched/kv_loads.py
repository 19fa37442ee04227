"""Waiting requests whose KV a connector is loading (vLLM's WAITING_FOR_REMOTE_KVS).

The scheduler asks the connector, after a waiting request's device prefix-cache hit, how many
more of its tokens it can load (`KVConnectorScheduler.get_num_new_matched_tokens`). If any, it
takes that many blocks from the pool for them and holds them, together with the device hit's
blocks, under the request's id in `KVCacheManager.external_holds` (so no other request can evict
or overwrite them); the request stays in the waiting queue, skipped, while other requests run.
When the worker reports the loads finished, the good blocks enter the prefix cache under the
request's block hashes and the hold is released: they are cached free blocks, most recently
used, and the request is admitted through the normal path, a prefix hit on them. (Holding them
until admission could deadlock: a request ahead of it in the queue may need those blocks. If
they are evicted first, the request computes them: one load per admission, so a connector that
keeps offering a block that failed is not asked again and again.) A load in flight
keeps its hold until it lands, an aborted request's too: a block being written is never handed out.

Without a connector every method is a no-op, so the scheduler calls them unconditionally.
Pure Python, like the rest of `portside.sched`.
"""

from __future__ import annotations

from dataclasses import dataclass

from portside.kv_cache.block_pool import KVCacheBlock
from portside.kv_cache.manager import KVCacheManager
from portside.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler
from portside.request import Request
from portside.sched.output import SchedulerOutput

__all__ = ["KVConnectorScheduler", "KVLoads"]


@dataclass
class _Load:
    num_hit: int  # leading held blocks that are the device prefix hit (already cached)
    num_targets: int  # blocks after them being loaded
    done: bool = False
    aborted: bool = False
    stale: bool = False  # the prefix cache was reset meanwhile (new weights): nothing it loads is kept


class KVLoads:
    """The waiting requests with loads in flight or done, and the blocks held for them."""

    def __init__(self, connector: KVConnectorScheduler | None, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self.loads: dict[str, _Load] = {}
        # requests whose load landed, until admitted: never a second load for the same admission (a
        # connector that still offers a block that failed would otherwise be asked again and again)
        self._landed: set[str] = set()
        self.num_loaded_tokens = 0  # tokens loaded instead of computed, since start (metrics)
        # preemption (with or without a connector): tokens a preempted request had computed, and
        # how many of them it computed again after resuming (the rest came from the caches)
        self._computed_at_preemption: dict[str, int] = {}
        self.num_recomputed_tokens = 0
        if connector is not None:
            connector.bind(kv)
            kv.on_reset = self._reset
            kv.pool.on_evict = lambda b: connector.on_evict(b.block_id, b.block_hash, b.parent_hash, b.token_ids)  # type: ignore[arg-type]

    def build_meta(self, output: SchedulerOutput) -> KVConnectorMetadata | None:
        """The connector's metadata for this step; an empty one while loads are in flight (the
        runner must be stepped to report them)."""
        if self.connector is None:
            return None
        meta = self.connector.build_connector_meta(output)
        return KVConnectorMetadata() if meta is None and self.num_loading else meta

    def has_pending_work(self) -> bool:
        return self.connector is not None and (bool(self.loads) or self.connector.has_pending_work())

    def preempted(self, request: Request) -> None:
        rid = request.request_id
        self._computed_at_preemption[rid] = max(self._computed_at_preemption.get(rid, 0), request.num_computed_tokens)
        if self.connector is not None:
            self.connector.on_preempt(request, self.kv.get_block_ids(request.request_id))

    def finished(self, request: Request) -> None:
        """`request` ended (its blocks are freed next): the connector hears of it; a hold is released."""
        self._computed_at_preemption.pop(request.request_id, None)
        self._landed.discard(request.request_id)
        if self.connector is not None:
            self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
            self.drop(request)

    def waits(self, request: Request, hit: list[KVCacheBlock], num_computed: int) -> bool:
        """True while `request` must wait for loads: loads in flight, or just started here for
        what the connector has past its device hit (`hit`, `num_computed` tokens)."""
        if self.connector is None:
            return False
        if request.request_id in self.loads:
            return True
        if request.request_id in self._landed:
            return False
        bs = self.kv.block_size
        num_blocks = self.connector.get_num_new_matched_tokens(request, num_computed) // bs
        pool = self.kv.pool
        if num_blocks <= 0 or num_blocks > pool.num_free_blocks - sum(1 for b in hit if b.ref_cnt == 0):
            return False  # nothing to load, or no room for it now: compute instead
        pool.touch(hit)
        targets = pool.get_new_blocks(num_blocks)
        self.kv.external_holds[request.request_id] = [*hit, *targets]
        self.loads[request.request_id] = _Load(len(hit), num_blocks)
        self.connector.update_state_after_alloc(request, [b.block_id for b in targets], num_blocks * bs)
        return True

    def update(self, output: KVConnectorOutput | None, requests: dict[str, Request]) -> None:
        """The worker's report: finished loads enter the prefix cache (only their good blocks)."""
        if output is None or self.connector is None:
            return
        for req_id in output.finished_loading:
            load = self.loads.get(req_id)
            if load is None or load.done:
                continue
            load.done = True
            held = self.kv.external_holds[req_id]
            good = 0 if load.stale else min(output.failed_loading.get(req_id, load.num_targets), load.num_targets)
            end = load.num_hit + good
            bad = held[end:]
            del held[end:]
            self.kv.pool.free_blocks(reversed(bad))
            request = requests.get(req_id)
            if not load.aborted and request is not None:
                self.num_loaded_tokens += good * self.kv.block_size
                self._cache(request, held, load.num_hit)
                self._landed.add(req_id)
            self._release(req_id)
        self.connector.update_connector_output(output)

    def _cache(self, request: Request, held: list[KVCacheBlock], start: int) -> None:
        bs = self.kv.block_size
        hashes = self.kv.block_hashes(request, len(held))
        tokens = request.all_token_ids
        for i in range(start, len(held)):
            self.kv.pool.cache_block(held[i], hashes[i], hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]))

    def admitted(self, request: Request, num_computed: int) -> None:
        """`request` was admitted with `num_computed` tokens cached (its allocation holds the blocks
        now): a resumed request's tokens computed again are counted."""
        self._landed.discard(request.request_id)
        before = self._computed_at_preemption.pop(request.request_id, None)
        if before is not None:
            self.num_recomputed_tokens += max(0, before - num_computed)

    def drop(self, request: Request) -> None:
        """`request` ended while waiting: its hold is released when its loads land."""
        load = self.loads.get(request.request_id)
        if load is not None:
            load.aborted = True

    def _reset(self) -> None:
        for load in self.loads.values():
            load.stale = True
        assert self.connector is not None
        self.connector.reset()

    def weights_changed(self) -> None:
        """The weights were updated in place (after the prefix cache's reset): tell the connector."""
        if self.connector is not None:
            self.connector.weights_changed()

    def _release(self, req_id: str) -> None:
        self.loads.pop(req_id, None)
        self.kv.pool.free_blocks(reversed(self.kv.external_holds.pop(req_id, [])))

    def stats(self) -> dict[str, float]:
        """The connector's counters, with the tokens loaded and the tokens recomputed after preemption."""
        out = dict(self.connector.stats()) if self.connector is not None else {}
        return {**out, "loaded_tokens": self.num_loaded_tokens, "preemption_recomputed_tokens": self.num_recomputed_tokens}

    @property
    def num_loading(self) -> int:
        return sum(1 for load in self.loads.values() if not load.done)
