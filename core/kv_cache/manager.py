"""Per-request KV-cache block tables on top of the `BlockPool`, with prefix caching and forks.

A request's blocks cover its tokens in order; block i holds tokens [i*block_size, (i+1)*block_size).

    |<------------ num_computed_tokens ------------>|<-- num_new_tokens -->|
    | hit/fork blocks (shared) | own computed blocks | blocks for new tokens |  (last one partial)

Caching happens after compute, never before: the scheduler calls `cache_blocks(request,
request.num_computed_tokens)` once a step's tokens are in the cache, and every full block up to
there enters the prefix cache. So a hit never points at a block whose KV is still being written.

Sliding window (`sliding_window=W`, only for a model whose every layer has the same window): a
query at position p sees keys k with p - W < k <= p, so once a request has `n` computed tokens
(its next query is at position >= n) the blocks wholly below n - W + 1, i.e. blocks i with
(i + 1) * block_size <= n - W + 1, are dead. `free_out_of_window_blocks` (called by the scheduler
after each step) enters them in the prefix cache, returns them to the pool and puts `null_block`
in their place: the table keeps its length, and the nulls always form a prefix of it. The runner
keeps the old ids in its own table; they are only ever read under the window mask. A null is
never shared (forks stop before one; a prefix hit takes cached blocks, never a table's entries)
nor sent to the runner (the scheduler only sends a table once, at admission, before any null).

Recurrent layers (`num_state_slots > 0`: a hybrid model's linear-attention or state-space layers):
besides its blocks each running request holds one state slot (`StateSlots`); a prefix hit is
trimmed to a prefix whose end has a saved state, a fork shares nothing (the child recomputes),
and `align_chunk` ends prompt chunks on block boundaries so their states can be saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from portside.kv_cache import hashing
from portside.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from portside.kv_cache.state import StateSlots
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

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None,
        num_state_slots: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        # the placeholder for a freed out-of-window block: in no pool list, never handed out
        self.null_block = KVCacheBlock(-1)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_to_hashes: dict[str, list[int]] = {}  # chain hashes of full blocks, by request
        self._num_cached_blocks: dict[str, int] = {}  # blocks already offered to the cache
        self._stale: set[str] = set()  # requests holding blocks at a prefix-cache reset: never cached again
        self._pending_lookups: dict[str, tuple[int, int]] = {}  # req_id -> (queries, hits)
        self.prefix_cache_stats = PrefixCacheStats()
        # blocks held for a request by someone else than its table (a KV connector's loads, `portside.sched.kv_loads`)
        self.external_holds: dict[str, list[KVCacheBlock]] = {}
        self.on_reset: Callable[[], None] | None = None  # called after `reset_prefix_cache` (a KV connector forgets too)
        self.state = StateSlots(num_state_slots, block_size, enable_prefix_caching) if num_state_slots else None

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
        """The request's block ids in table order; a freed out-of-window block reads -1."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_null_blocks(self, request_id: str) -> int:
        """How many leading entries of the request's table are freed out-of-window blocks."""
        blocks = self.req_to_blocks.get(request_id, [])
        i = 0
        while i < len(blocks) and blocks[i] is self.null_block:
            i += 1
        return i

    # ---- prefix cache and forks ------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `request.all_token_ids`, in whole blocks, never covering the
        last token (its logits must be computed). Takes no reference: pass the blocks to
        `allocate_slots(..., new_computed_blocks=...)` before anything else touches the pool;
        the lookup enters the hit-rate stats when that allocation succeeds. A request that asked
        for prompt logprobs gets no hit until it has them (the positions a hit skips would have no
        logits; vLLM disables the cache for such requests): its recompute after outputs may hit."""
        if not self.enable_prefix_caching or (request.sampling_params.prompt_logprobs is not None
                                              and not request.output_token_ids):
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
        if self.state is not None and hit:  # the recurrent layers' state must be restorable at the hit's end
            hit = hit[: self.state.usable_hit(request.request_id, hashes, tokens, len(hit))]
        num_hit_tokens = len(hit) * self.block_size
        self._pending_lookups[request.request_id] = (len(tokens), num_hit_tokens)
        return hit, num_hit_tokens

    def get_fork_blocks(self, parent: Request, child: Request) -> tuple[list[KVCacheBlock], int]:
        """The parent's full computed blocks whose tokens the child shares, never covering the
        child's last token. Takes no reference (see `get_computed_blocks`). None with recurrent
        layers (the parent's state at the shared end is not kept): the child recomputes."""
        if self.state is not None:
            return [], 0
        bs = self.block_size
        n = min(parent.num_computed_tokens, child.num_tokens - 1) // bs
        parent_tokens, child_tokens = parent.all_token_ids, child.all_token_ids
        shared = 0
        parent_blocks = self.req_to_blocks.get(parent.request_id, [])
        n = min(n, len(parent_blocks))
        # a freed out-of-window block (a null, always at the table's start) is never shared
        while (
            shared < n
            and parent_blocks[shared] is not self.null_block
            and parent_tokens[shared * bs : (shared + 1) * bs] == child_tokens[shared * bs : (shared + 1) * bs]
        ):
            shared += 1
        blocks = parent_blocks[:shared]
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
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None,
        num_state_tokens: int | None = None,
    ) -> list[int] | None:
        """Make the request's blocks cover `num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens` tokens. `new_computed_blocks` (a prefix hit or fork, only
        for a request that holds no blocks yet and whose `num_computed_tokens` does not include
        them) are shared first. `num_state_tokens`: of the new tokens, those after which the
        recurrent layers' state is known to be the sequence's, where a checkpoint may be saved
        (default all; fewer with a draft's lookahead slots; 0 in a step that verifies proposals,
        whose state ends at the accepted length). Returns the ids of the newly allocated blocks,
        or None, changing nothing, when the pool cannot supply them; cached free blocks are
        evicted LRU first."""
        new_computed = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        assert not (new_computed and blocks), "computed blocks can only start a block table"
        num_tokens = request.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - len(blocks) - len(new_computed))
        # free blocks among the hits leave the free list when shared, so they cannot be reused
        num_reclaimed = sum(1 for b in new_computed if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_reclaimed:
            return None
        if self.state is not None and self.state.slots_needed(request.request_id, bool(new_computed)) > self.state.num_free:
            return None
        queries, hits = self._pending_lookups.pop(request.request_id, (0, 0))
        self.prefix_cache_stats.queries += queries
        self.prefix_cache_stats.hits += hits
        if new_computed:
            self.pool.touch(new_computed)
            blocks = self.req_to_blocks.setdefault(request.request_id, [])
            blocks.extend(new_computed)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        if self.state is not None:
            start = request.num_computed_tokens + len(new_computed) * self.block_size
            end = num_tokens if num_state_tokens is None else start + num_state_tokens
            self.state.allocate(request.request_id, bool(new_computed), start, end)
        if new_blocks:
            self.req_to_blocks.setdefault(request.request_id, []).extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's full blocks below `num_computed_tokens` (tokens whose KV is in the
        cache) in the prefix cache. Idempotent; a block already cached (shared) is skipped."""
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        if req_id in self._stale:
            return
        blocks = self.req_to_blocks.get(req_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(req_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(start, num_full):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            if blocks[i].block_hash is None and blocks[i] is not self.null_block:
                self.pool.cache_block(blocks[i], hashes[i], hashes[i - 1] if i else None, block_tokens,
                                      request.lora_id)
            if self.state is not None:
                self.state.cache(req_id, i, hashes[i], hashes[i - 1] if i else None, block_tokens)
        self._num_cached_blocks[req_id] = num_full

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Blocks no query at a position >= `num_computed_tokens` can see (0 without a window):
        block i is dead when its last token (i + 1) * block_size - 1 < n - W + 1."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def free_out_of_window_blocks(self, request: Request) -> int:
        """Free the request's blocks that fell wholly out of the sliding window, given its
        `num_computed_tokens`, leaving `null_block` in their place. They are entered in the
        prefix cache first (`cache_blocks`), so they stay findable as cached free blocks.
        Returns how many were freed; a no-op without a window."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return 0
        num_dead = min(self.num_dead_blocks(request.num_computed_tokens), len(blocks))
        if num_dead == 0 or blocks[num_dead - 1] is self.null_block:
            return 0
        self.cache_blocks(request, request.num_computed_tokens)
        dead: list[KVCacheBlock] = []
        for i in range(num_dead - 1, -1, -1):  # tail first, like `free`; the nulls are a prefix
            if blocks[i] is self.null_block:
                break
            dead.append(blocks[i])
            blocks[i] = self.null_block
        self.pool.free_blocks(dead)
        return len(dead)

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first (so its tail is evicted first).
        Safe to call for a request holding nothing, or holding nulls."""
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, [])
        self.pool.free_blocks(b for b in reversed(blocks) if b is not self.null_block)
        self._req_to_hashes.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        self._stale.discard(req_id)
        self._pending_lookups.pop(req_id, None)
        if self.state is not None:
            self.state.free(req_id)

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache (`BlockPool.reset_prefix_cache`; the recurrent state
        checkpoints too). A request holding blocks keeps them but offers none of its later
        blocks to the cache: their KV was computed over stale blocks. Returns the blocks forgotten."""
        n = self.pool.reset_prefix_cache()
        if self.state is not None:
            self.state.pool.reset_prefix_cache()
        self._stale.update(self.req_to_blocks)
        if self.on_reset is not None:
            self.on_reset()
        return n

    def align_chunk(self, request: Request, start: int, num_new: int) -> int:
        """A chunk's token count, shortened (with recurrent layers and prefix caching) to end on a
        block boundary, so the state there can be saved: a chunk that reaches the last known
        token ends at the last boundary before it (the rest is the next step), a shorter chunk
        at its last boundary. Unchanged otherwise, or when no boundary is left to end on."""
        if self.state is None or not self.enable_prefix_caching or num_new <= 1:
            return num_new
        bs, end = self.block_size, start + num_new
        boundary = ((request.num_tokens - 1) // bs) * bs if end >= request.num_tokens else (end // bs) * bs
        return boundary - start if start < boundary < end else num_new

    def state_slot(self, request_id: str) -> int:
        """The request's recurrent-state slot (-1: none, or a model without recurrent layers)."""
        return -1 if self.state is None else self.state.slot_of(request_id)

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The state-slot copies the runner makes before and after the next step."""
        return ([], []) if self.state is None else self.state.take_copies()

    def block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The chain hashes of the request's first `num_blocks` full blocks (fewer if it has fewer)."""
        return self._hashes(request, num_blocks)[:num_blocks]

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        return hashing.hash_full_blocks(request.all_token_ids, self.block_size, hashes, num_blocks, request.block_hash_root,
                                        request.block_extra_keys if request.mm_features else None)

    # ---- checks --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The pool's invariants, plus: every block a request holds has ref_cnt equal to the
        number of requests holding it, no request holds a block twice, and a request's nulls
        (freed out-of-window blocks, only with a window) form a prefix of its table and were
        offered to the prefix cache before being freed."""
        self.pool.check_integrity()
        if self.state is not None:
            self.state.check_integrity()
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None and not FreeBlockQueue.contains(null), null
        holders: dict[int, int] = {}
        for req_id, blocks in self.req_to_blocks.items():
            num_null = sum(1 for b in blocks if b is null)
            assert all(b is null for b in blocks[:num_null]), f"{req_id}: nulls are not a prefix of its table"
            assert num_null == 0 or self.sliding_window is not None, f"{req_id} holds nulls without a window"
            if self.enable_prefix_caching:
                assert req_id in self._stale or num_null <= self._num_cached_blocks.get(req_id, 0), f"{req_id} freed an unhashed block"
            ids = [b.block_id for b in blocks[num_null:]]
            assert len(ids) == len(set(ids)), f"{req_id} holds a block twice: {ids}"
            for block in blocks[num_null:]:
                assert self.pool.blocks[block.block_id] is block
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for held in self.external_holds.values():
            for block in held:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"{block}: ref_cnt {block.ref_cnt}, held by {holders.get(block.block_id, 0)} requests"
            )
        for req_id, n in self._num_cached_blocks.items():
            assert n <= len(self.req_to_blocks.get(req_id, [])), req_id
