"""KV-cache events for routers: what entered and left the prefix cache, as vLLM reports it.

The block pool reports to an optional `KVEventRecorder` (`BlockPool.events`; None costs nothing):
a full block entering the prefix cache (`stored`), a cached block evicted or forgotten
(`removed`), the whole cache forgotten (`cleared`, after a weight update). The engine drains the
recorder once per step and hands the events to a publisher (`portside.engine.kv_events`), which
sends them in vLLM's message layout (docs/kv_events.md) so a prefix-aware router (llm-d's KV
cache indexer, Dynamo's KV router) can track which instance holds which prefix.

Events are vLLM's three: `BlockStored` (block hashes in chain order, the hash the first one chains
on, every block's tokens concatenated, the block size, the LoRA adapter's id, the medium),
`BlockRemoved` (hashes, medium) and `AllBlocksCleared`. Consecutive stores that continue one chain
with the same adapter and medium become one `BlockStored`, consecutive removals one
`BlockRemoved`, as vLLM batches them per request. Hashes are the prefix cache's own (`hashing`),
as Python ints; the wire carries them as unsigned 64-bit integers (`external_hash`).

Pure Python (no torch): `core/kv_cache` never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's name for the engine's own (device) KV cache, whatever the device: routers key the
# primary tier on it. Lower tiers report their own medium (vLLM's offloading connector: "CPU").
MEDIUM_DEVICE = "GPU"

_U64 = (1 << 64) - 1


def external_hash(block_hash: int) -> int:
    """A block hash as the wire carries it: the prefix cache's (signed, 64-bit) hash taken modulo
    2**64, an unsigned 64-bit integer (one-to-one; msgpack uint64, as vLLM sends its int hashes)."""
    return block_hash & _U64


@dataclass(slots=True)
class BlockStored:
    """Full blocks entered the cache: `block_hashes[i]` holds
    `token_ids[i * block_size : (i + 1) * block_size]` and chains on `block_hashes[i - 1]`
    (the first on `parent_block_hash`; None: it starts the sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_DEVICE


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks left the cache (evicted for new blocks, or forgotten)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_DEVICE


@dataclass(slots=True)
class AllBlocksCleared:
    """Every cached block was forgotten (`BlockPool.reset_prefix_cache`)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventRecorder:
    """Collects the pool's events between two `drain`s, merging runs (module docstring)."""

    block_size: int
    events: list[KVCacheEvent] = field(default_factory=list)

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...], lora_id: int | None = None,
               medium: str | None = MEDIUM_DEVICE) -> None:
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash and last.lora_id == lora_id
                and last.medium == medium):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self.events.append(BlockStored([block_hash], parent_hash, list(token_ids), self.block_size, lora_id, medium))

    def removed(self, block_hash: int, medium: str | None = MEDIUM_DEVICE) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def drain(self) -> list[KVCacheEvent]:
        """The events since the last drain, oldest first; the recorder starts empty again."""
        events, self.events = self.events, []
        return events
