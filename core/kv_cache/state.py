"""State slots of a model's recurrent layers (linear attention, state-space, short convolution):
one slot per running request, plus checkpoint slots that keep the state at block-aligned
positions for prefix caching.

A recurrent layer's state does not grow with the sequence, so it is not paged: the runner keeps,
per recurrent layer, one tensor of `num_slots + 1` states (the last is scratch), and this class
hands each running request one slot (its *working* slot, zeroed by the kernels when the request
starts from scratch). Slots come from a `BlockPool` of their own, so checkpoints get the same
ref counts, LRU eviction and content-hash map as KV blocks.

Prefix caching (vLLM's approach for hybrid models): a prefix hit must restore the recurrent state
at the hit's end, so the state is saved at block boundaries. When a step's tokens end a request
exactly at a block boundary (the scheduler cuts a prompt's last chunk at its last boundary, see
`align_chunk`; decodes cross one every `block_size` tokens), the manager takes a free slot and
asks the runner to copy the working slot into it after the step (`copies_after`); once the block
is computed, `cache` enters that checkpoint under the block's chain hash. A hit is trimmed to its
longest prefix ending in a checkpoint (`usable_hit`); admitting it copies the checkpoint into the
request's new working slot before the step (`copies_before`), holding a reference on the
checkpoint until the request's next allocation. Pure Python, like the rest of `portside.kv_cache`.
"""

from __future__ import annotations

from portside.kv_cache.block_pool import BlockPool, KVCacheBlock

__all__ = ["StateSlots", "num_state_slots"]


def num_state_slots(max_num_seqs: int, enable_prefix_caching: bool) -> int:
    """Slots for a model with recurrent layers: one per running request, one spare (a hit's
    checkpoint is held while a request takes its working slot), and as many again for prefix-cache
    checkpoints. Every rank and the scheduler compute the same number from the config."""
    return max_num_seqs + 1 + (max_num_seqs if enable_prefix_caching else 0)


class StateSlots:
    """Working and checkpoint slots of the recurrent layers' states (see the module docstring)."""

    def __init__(self, num_slots: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_slots)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.working: dict[str, KVCacheBlock] = {}  # req_id -> its working slot
        self._restoring: dict[str, KVCacheBlock] = {}  # req_id -> checkpoint copied in at admission
        self._saving: dict[str, dict[int, KVCacheBlock]] = {}  # req_id -> block index -> checkpoint being written
        self._hit: dict[str, KVCacheBlock] = {}  # req_id -> checkpoint of its pending prefix hit
        self.copies_before: list[tuple[int, int]] = []  # (src slot, dst slot), for the next scheduler output
        self.copies_after: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return self.pool.num_free_blocks

    def slot_of(self, req_id: str) -> int:
        """The request's working slot (-1 while it holds none)."""
        block = self.working.get(req_id)
        return -1 if block is None else block.block_id

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The slot copies the runner makes around the next step (restores before, saves after)."""
        before, after = self.copies_before, self.copies_after
        self.copies_before, self.copies_after = [], []
        return before, after

    # ---- prefix hits -------------------------------------------------------------------------

    def usable_hit(self, req_id: str, hashes: list[int], tokens: list[int], num_hit_blocks: int) -> int:
        """The longest prefix (in blocks, <= `num_hit_blocks`) of a KV-cache hit whose end has a
        checkpoint; remembers that checkpoint for `allocate`. 0 without prefix caching."""
        self._hit.pop(req_id, None)
        bs = self.block_size
        for n in range(num_hit_blocks, 0, -1):
            i = n - 1
            block = self.pool.lookup(hashes[i], hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]))
            if block is not None:
                self._hit[req_id] = block
                return n
        return 0

    # ---- allocation --------------------------------------------------------------------------

    def slots_needed(self, req_id: str, with_hit: bool) -> int:
        """Free slots an allocation for the request needs: its working slot, and its hit's
        checkpoint leaving the free list. (A checkpoint to save is taken only if a slot is left
        over: saving is never a reason to wait or to preempt.)"""
        if req_id in self.working:
            return 0
        hit = self._hit.get(req_id) if with_hit else None
        return 1 + (1 if hit is not None and hit.ref_cnt == 0 else 0)

    def _saves_at(self, req_id: str, end: int) -> bool:
        return self.enable_prefix_caching and end > 0 and end % self.block_size == 0 \
            and (end // self.block_size - 1) not in self._saving.get(req_id, {})

    def allocate(self, req_id: str, with_hit: bool, start: int, end: int) -> None:
        """After `slots_needed` fit: a working slot for a request that has none (restored from its
        hit's checkpoint when `with_hit`), and a checkpoint to save at `end` when it ends a block.
        `start`: the request's computed tokens before this step (hit included)."""
        restoring = self._restoring.pop(req_id, None)
        if restoring is not None:  # its restore copy ran in the step it was admitted
            self.pool.free_blocks([restoring])
        hit = self._hit.pop(req_id, None)
        if req_id not in self.working:
            if with_hit and hit is not None:
                self.pool.touch([hit])
                self._restoring[req_id] = hit
            [slot] = self.pool.get_new_blocks(1)
            self.working[req_id] = slot
            if with_hit and hit is not None:
                self.copies_before.append((hit.block_id, slot.block_id))
        if end > start and self._saves_at(req_id, end) and self.pool.num_free_blocks > 0:
            [ckpt] = self.pool.get_new_blocks(1)
            self._saving.setdefault(req_id, {})[end // self.block_size - 1] = ckpt
            self.copies_after.append((self.working[req_id].block_id, ckpt.block_id))

    def cache(self, req_id: str, block_index: int, block_hash: int, parent_hash: int | None,
              token_ids: tuple[int, ...]) -> None:
        """Block `block_index` of the request is computed and hashed: its checkpoint (if one was
        saved there) enters the cache and is released (kept as a cached free slot, LRU)."""
        ckpt = self._saving.get(req_id, {}).pop(block_index, None)
        if ckpt is None:
            return
        self.pool.cache_block(ckpt, block_hash, parent_hash, token_ids)
        self.pool.free_blocks([ckpt])

    def free(self, req_id: str) -> None:
        """Release everything the request holds (finished or preempted), and drop the copies
        still planned for it (a request preempted in the pass that scheduled it: its slots may
        go to another request in the same pass)."""
        working = self.working.pop(req_id, None)
        saving = list(self._saving.pop(req_id, {}).values())
        held = [self._restoring.pop(req_id, None), working, *saving]
        self.pool.free_blocks(b for b in held if b is not None)
        self._hit.pop(req_id, None)
        if working is not None:
            dead = {c.block_id for c in saving}
            self.copies_before = [c for c in self.copies_before if c[1] != working.block_id]
            self.copies_after = [c for c in self.copies_after if c[0] != working.block_id and c[1] not in dead]

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for b in [*self.working.values(), *self._restoring.values(),
                  *(c for saving in self._saving.values() for c in saving.values())]:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"state slot {block}: ref_cnt vs holders"
