"""The KV connector contract: a smaller version of vLLM's KVConnectorBase_V1.

A connector moves whole KV blocks between the device cache and a store outside it (host memory,
disk, a shared directory, another instance). It has two halves that talk only through the two
step messages:

- `KVConnectorScheduler` (here, pure Python, in the scheduler's process) decides: which of a
  waiting request's tokens it can load, which device blocks to save, and it records those
  decisions in a `KVConnectorMetadata` attached to each `SchedulerOutput`
  (`SchedulerOutput.kv_connector_metadata`);
- `KVConnectorWorker` (`portside.runner.kv_transfer`, in every rank's model runner) executes
  them: `start_step(meta)` before the step's forward (saves of blocks about to be reused, then
  the loads, started asynchronously), `finish_step(meta)` after it (saves of KV the step just
  computed), and reports finished or failed loads in a `KVConnectorOutput`
  (`ModelRunnerOutput.kv_connector_output`).

Block identity is the prefix cache's content hash (`portside.kv_cache.hashing`: the parent chain,
the LoRA root and multimodal extras), and every stored block keeps its token ids and parent
hash, so a load is verified against the tokens like a prefix-cache hit. A block's bytes are the
layout-neutral form `portside.contract.kv_transfer.KVBlockLayout` describes.

The scheduler calls, per step (`portside.sched.kv_loads` drives the waiting side):

1. `get_num_new_matched_tokens(request, num_computed)` for a waiting request after its device
   prefix-cache hit of `num_computed` tokens: how many tokens past it the connector can load, in
   whole blocks, never the request's last token (its logits must be computed). 0: none.
2. If > 0 the scheduler takes that many blocks from the pool (held for the load, not yet the
   request's), calls `update_state_after_alloc(request, block_ids, num_external_tokens)`, and the
   request waits (vLLM's WAITING_FOR_REMOTE_KVS) while other requests run.
3. `build_connector_meta(scheduler_output)` at the end of `Scheduler.schedule`: everything decided
   since the last call. Return None when there is nothing to do; return a metadata (even an
   empty one) while loads are in flight, so that the runner is stepped and can report them.
4. The worker's `KVConnectorOutput` comes back through `update_connector_output` (under tensor or
   pipeline parallelism every rank's, merged by the executor: `portside.kv_transfer.ranks`). A request in
   `finished_loading` has its loaded blocks entered in the prefix cache and is admitted through
   the normal path (a prefix hit); `failed_loading[req_id] = k` means only its first `k` loaded
   blocks are good: the rest are freed and recomputed, never used.

Besides: `on_evict(block_id, block_hash, parent_hash, token_ids)` just before the pool hands a
cached block out again (its KV is still intact: a save recorded now runs in `start_step` of the
step that overwrites it, before the forward); `on_preempt(request, block_ids)` when a request is
preempted (swap preemption saves its blocks); `request_finished(request, block_ids)` when a
request ends (its blocks are freed after this call: a save recorded now runs before any later
step's forward, so before they can be overwritten); `reset()` when the prefix cache is reset
(the weights changed: forget every stored block); `stats()` for metrics; `has_pending_work()`
while the engine must keep stepping the runner for the connector alone.

The ordering rules that make this safe without extra synchronisation: a step's metadata is
executed by the worker in `start_step` before that step's forward writes any block; the worker
executes steps in order; blocks being loaded are held (ref_cnt > 0) until the request that needs
them is admitted, so no step writes them meanwhile. Layer-by-layer transfers (vLLM's
`wait_for_layer_load` / `save_kv_layer`) are not part of this contract: blocks move whole.

Connectors are registered by name in `portside.kv_transfer.factory` (scheduler class, worker
class). This engine's are "tiers" (host memory and disk behind the device cache, the same
connector used for swap preemption) and those `portside.kv_transfer.factory` lists.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from portside.kv_cache.manager import KVCacheManager
    from portside.kv_transfer.config import KVTransferConfig
    from portside.request import Request
    from portside.sched.output import SchedulerOutput

__all__ = ["KVConnectorMetadata", "KVConnectorOutput", "KVConnectorScheduler", "KVTransferInfo"]


@dataclass
class KVConnectorMetadata:
    """One step's instructions from a connector's scheduler half to its worker half. Connectors
    subclass it; it crosses process boundaries, so it must pickle (plain data only)."""


@dataclass
class KVConnectorOutput:
    """What a connector's worker half reports after a step."""

    finished_loading: set[str] = field(default_factory=set)
    """Requests whose loads all completed (including any in `failed_loading`)."""
    failed_loading: dict[str, int] = field(default_factory=dict)
    """req_id -> how many of its loaded blocks (in load order) are good; the rest failed."""
    stats: dict[str, float] = field(default_factory=dict)
    """Counters since the previous output (bytes moved, seconds spent), summed by the scheduler half."""

    def merge(self, other: KVConnectorOutput | None) -> None:
        if other is None:
            return
        self.finished_loading |= other.finished_loading
        self.failed_loading.update(other.failed_loading)
        for k, v in other.stats.items():
            self.stats[k] = self.stats.get(k, 0.0) + v


@dataclass(frozen=True)
class KVTransferInfo:
    """What the scheduler half learns from the workers at start-up (`ModelRunner.kv_transfer_info`
    of every rank, `combine`d).

    Under tensor or pipeline parallelism each rank holds its part of every block (its KV heads,
    its stage's layers) and stores that part itself, in files of its own: `shards` lists each
    rank's (fingerprint, block bytes), by rank. A block is in a store only when every rank's part is."""

    block_bytes: int
    """Bytes of one block in the neutral form, every rank's part together."""
    fingerprint: str
    """Digest of the model and layout (`KVBlockLayout.fingerprint`): stored blocks with another one
    are never read. With one rank, that rank's; with several, a digest of theirs."""
    shards: tuple[tuple[str, int], ...] = ()
    """Each rank's (fingerprint, block bytes), by rank; empty means one rank: ((fingerprint, block_bytes),)."""

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        """`shards`, or the one rank's part."""
        return self.shards or ((self.fingerprint, self.block_bytes),)

    @classmethod
    def combine(cls, infos: Sequence[KVTransferInfo]) -> KVTransferInfo:
        """The whole engine's info from every rank's, by rank."""
        if len(infos) == 1:
            return infos[0]
        parts = tuple(p for info in infos for p in info.parts)
        digest = hashlib.blake2b("|".join(fp for fp, _ in parts).encode(), digest_size=16).hexdigest()
        return cls(sum(b for _, b in parts), digest, parts)


class KVConnectorScheduler(ABC):
    """The scheduler's half of a KV connector (see the module docstring for the call order)."""

    def __init__(self, config: KVTransferConfig, block_size: int, info: KVTransferInfo) -> None:
        self.config = config
        self.block_size = block_size
        self.info = info
        self.kv: KVCacheManager | None = None

    def bind(self, kv: KVCacheManager) -> None:
        """The scheduler's KV-cache manager (for a request's block hashes: `KVCacheManager.block_hashes`)."""
        self.kv = kv

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (a multiple of the block size) the connector can load."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The scheduler holds `block_ids` (in table order, after the device hit) to receive them."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        """This step's instructions for the worker half, or None when there are none."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker half's report of a step. Default: nothing."""

    def on_evict(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        """A cached device block is being handed out again (its KV is intact until the next forward)."""

    def on_preempt(self, request: Request, block_ids: list[int]) -> None:
        """`request` is preempted; its blocks are freed right after this call."""

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """`request` ended; its blocks are freed right after this call."""

    def reset(self) -> None:
        """The prefix cache was reset (new weights): nothing stored so far may be loaded again."""

    def weights_changed(self) -> None:
        """The model's weights were updated in place (RL; `reset` has run): KV computed from now on
        belongs to weights no checkpoint holds. Default: nothing."""

    def stats(self) -> dict[str, Any]:
        """Counters for metrics (names without prefix; values numbers)."""
        return {}

    def has_pending_work(self) -> bool:
        """True while the runner must be stepped for the connector alone (loads or saves pending)."""
        return False
