"""The pool of KV-cache blocks: ref counts, an O(1) LRU free list and the prefix-cache map.

Pure Python bookkeeping (no torch): a block is an id into the runner's KV tensors.

Invariants (checked by `BlockPool.check_integrity`):
- every block id in 0..num_blocks-1 is usable (there is no reserved null block);
- `ref_cnt >= 0`; a block is in the free list iff its `ref_cnt == 0`, and at most once;
- `cached[h] is b` iff `b.block_hash == h`; a cached block also records the token ids it holds
  (and its parent's hash), so a hit is verified against the tokens, never trusted on the hash.

Eviction order. Taking a new block pops the head of the free list. When a request frees its
blocks (in reverse order, so a sequence's tail blocks come first):
- a cached block goes to the tail: cached-but-free blocks are evicted least recently freed
  first, and within one request the tail of the chain before its head;
- an uncached block goes to the head: it holds nothing reusable, so it is handed out before any
  cached block is evicted.
A prefix hit on a free cached block unlinks it from the middle of the list in O(1).

Events: with a `KVEventRecorder` in `events` (KV events for routers, `kv_events`), every block
entering the prefix cache is reported stored, every cached block evicted removed, and a reset
clears them all (one `AllBlocksCleared`, no removals).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from portside.kv_cache.kv_events import KVEventRecorder


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One block of `block_size` token slots in every layer's paged KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set while the block is in the prefix cache
    token_ids: tuple[int, ...] | None = None  # the tokens it holds, while cached
    parent_hash: int | None = None  # the previous block's hash in the chain, while cached
    # intrusive free-list links; both None iff the block is not in the free list
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Not a deque: a prefix hit removes a block from the middle, which must be O(1), and the links
    live on the block objects so no node is allocated per operation. Two sentinels make every
    insert and unlink branch-free.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    @staticmethod
    def contains(block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def popleft(self) -> KVCacheBlock:
        if self._len == 0:
            raise IndexError("no free block")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"{block} is already in the free list")
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1


class BlockPool:
    """All KV-cache blocks, their ref counts, the free list and the prefix-cache map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> the full block holding it
        # called with a cached block just before it is evicted for reuse (not on a reset); KV tiers
        self.on_evict: Callable[[KVCacheBlock], None] | None = None
        self.events: KVEventRecorder | None = None  # KV events for routers (None: not recorded)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not (a cached free block can be evicted)."""
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the head of the free list (evicting cached ones), ref_cnt 1."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if self.on_evict is not None and block.block_hash is not None:
                self.on_evict(block)  # a KV connector may save it (its KV is intact until the next forward)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        """The cached block for this chain link, or None (also when only the hash matches)."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(
        self, block: KVCacheBlock, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...],
        lora_id: int | None = None,
    ) -> bool:
        """Enter a full, computed block in the prefix cache. False if the hash is taken.
        `lora_id`: the adapter its KV was computed with (reported in events only)."""
        assert block.ref_cnt > 0 and block.block_hash is None, block
        if block_hash in self.cached:
            return False  # same content cached elsewhere, or a hash collision: keep the first
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, token_ids, lora_id)
        return True

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order (callers pass a sequence's
        blocks tail first); a block reaching 0 joins the free list (see the module docstring)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (free or held), so that no later lookup finds one: after a
        weight update their KV is stale. Held blocks stay with their requests, uncached. Returns
        how many blocks were forgotten."""
        blocks = list(self.cached.values())
        events, self.events = self.events, None  # one AllBlocksCleared, not a removal per block
        for block in blocks:
            self._evict(block)
        self.events = events
        if events is not None:
            events.cleared()
        return len(blocks)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = block.parent_hash = block.token_ids = None

    def check_integrity(self) -> None:
        """Assert every invariant in the module docstring."""
        in_queue = list(self.free_queue)
        ids = [b.block_id for b in in_queue]
        assert len(ids) == len(set(ids)) == len(self.free_queue), "a block is in the free list twice"
        queued = set(ids)
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.block_id in queued) == (block.ref_cnt == 0), f"{block}: free list vs ref_cnt"
            assert FreeBlockQueue.contains(block) == (block.ref_cnt == 0), block
            if block.block_hash is None:
                assert block.token_ids is None and block.parent_hash is None, block
            else:
                assert self.cached.get(block.block_hash) is block, f"{block} not in the cache map"
                assert block.token_ids is not None, block
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash and self.blocks[block.block_id] is block, block
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert num_used + len(self.free_queue) == self.num_blocks, "block counts do not add up"
