"""Per-request KV-cache block tables on top of the `BlockPool`, with prefix caching and forks.

A request's blocks cover its tokens in order; block i holds tokens [i*block_size, (i+1)*block_size).

    |<------------ num_computed_tokens ------------>|<-- num_new_tokens -->|
    | hit/fork blocks (shared) | own computed blocks | blocks for new tokens |  (last one partial)

Caching happens after compute, never before: the scheduler calls `cache_blocks(request,
request.num_computed_tokens)` once a step's tokens are in the cache, and every full block up to
there enters the prefix cache. So a hit never points at a block whose KV is still being written.
"""

from __future__ import annotations

from dataclasses import dataclass

from portside.kv_cache import hashing
from portside.kv_cache.block_pool import BlockPool, KVCacheBlock
from portside.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Token counts since start: `queries` tokens looked up, `hits` of them served from cache.
    A lookup counts once, when the request is admitted with it (see `allocate_slots`), so a
    request retried for several steps is not counted several times."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Hands out block ids to requests; the model runner turns them into slots and tables."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_to_hashes: dict[str, list[int]] = {}  # chain hashes of full blocks, by request
        self._num_cached_blocks: dict[str, int] = {}  # blocks already offered to the cache
        self._pending_lookups: dict[str, tuple[int, int]] = {}  # req_id -> (queries, hits)
        self.prefix_cache_stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    # ---- prefix cache and forks ------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `request.all_token_ids`, in whole blocks, never covering the
        last token (its logits must be computed). Takes no reference: pass the blocks to
        `allocate_slots(..., new_computed_blocks=...)` before anything else touches the pool;
        the lookup enters the hit-rate stats when that allocation succeeds."""
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hashes = self._hashes(request, max_blocks)
        hit: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(
                hashes[i], hashes[i - 1] if i else None, tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            )
            if block is None:
                break
            hit.append(block)
        num_hit_tokens = len(hit) * self.block_size
        self._pending_lookups[request.request_id] = (len(tokens), num_hit_tokens)
        return hit, num_hit_tokens

    def get_fork_blocks(self, parent: Request, child: Request) -> tuple[list[KVCacheBlock], int]:
        """The parent's full computed blocks whose tokens the child shares, never covering the
        child's last token. Takes no reference (see `get_computed_blocks`)."""
        bs = self.block_size
        n = min(parent.num_computed_tokens, child.num_tokens - 1) // bs
        parent_tokens, child_tokens = parent.all_token_ids, child.all_token_ids
        shared = 0
        while shared < n and parent_tokens[shared * bs : (shared + 1) * bs] == child_tokens[shared * bs : (shared + 1) * bs]:
            shared += 1
        blocks = self.req_to_blocks.get(parent.request_id, [])[:shared]
        return blocks, len(blocks) * bs

    def fork(self, parent: Request, child: Request) -> None:
        """The child (holding no blocks) shares the parent's full computed blocks (ref_cnt + 1
        each) and starts with `num_computed_tokens` covering them; it recomputes the rest, so no
        block is copied."""
        assert child.request_id not in self.req_to_blocks, f"{child} already holds blocks"
        blocks, num_tokens = self.get_fork_blocks(parent, child)
        child.num_computed_tokens = 0
        allocated = self.allocate_slots(child, 0, new_computed_blocks=blocks)
        assert allocated == []
        child.num_computed_tokens = num_tokens

    # ---- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[int] | None:
        """Make the request's blocks cover `num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens` tokens. `new_computed_blocks` (a prefix hit or fork, only
        for a request that holds no blocks yet and whose `num_computed_tokens` does not include
        them) are shared first. Returns the ids of the newly allocated blocks, or None, changing
        nothing, when the pool cannot supply them; cached free blocks are evicted LRU first."""
        new_computed = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        assert not (new_computed and blocks), "computed blocks can only start a block table"
        num_tokens = request.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - len(blocks) - len(new_computed))
        # free blocks among the hits leave the free list when shared, so they cannot be reused
        num_reclaimed = sum(1 for b in new_computed if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_reclaimed:
            return None
        queries, hits = self._pending_lookups.pop(request.request_id, (0, 0))
        self.prefix_cache_stats.queries += queries
        self.prefix_cache_stats.hits += hits
        if new_computed:
            self.pool.touch(new_computed)
            blocks = self.req_to_blocks.setdefault(request.request_id, [])
            blocks.extend(new_computed)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        if new_blocks:
            self.req_to_blocks.setdefault(request.request_id, []).extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's full blocks below `num_computed_tokens` (tokens whose KV is in the
        cache) in the prefix cache. Idempotent; a block already cached (shared) is skipped."""
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(req_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(start, num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], hashes[i], hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]))
        self._num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first (so its tail is evicted first).
        Safe to call for a request holding nothing."""
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, [])
        self.pool.free_blocks(reversed(blocks))
        self._req_to_hashes.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        self._pending_lookups.pop(req_id, None)

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        return hashing.hash_full_blocks(request.all_token_ids, self.block_size, hashes, num_blocks)

    # ---- checks --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The pool's invariants, plus: every block a request holds has ref_cnt equal to the
        number of requests holding it, and no request holds a block twice."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for req_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{req_id} holds a block twice: {ids}"
            for block in blocks:
                assert self.pool.blocks[block.block_id] is block
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"{block}: ref_cnt {block.ref_cnt}, held by {holders.get(block.block_id, 0)} requests"
            )
        for req_id, n in self._num_cached_blocks.items():
            assert n <= len(self.req_to_blocks.get(req_id, [])), req_id
