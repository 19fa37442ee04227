"""BlockPool and its intrusive free list: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import pytest

from portside.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_free_queue_is_a_linked_list_with_o1_middle_removal() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert [b.block_id for b in q] == [2, 1, 3, 4, 0] and len(q) == 5
    with pytest.raises(ValueError):
        q.append(blocks[3])  # already queued
    for _ in range(5):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[1])


def test_new_blocks_come_from_the_head_in_id_order() -> None:
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0]
    assert free_ids(pool) == [3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.check_integrity()


def test_freed_cached_blocks_go_to_the_tail_uncached_to_the_head() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2
    assert pool.cache_block(a[0], 100, None, (1, 2))
    assert pool.cache_block(a[1], 101, 100, (3, 4))  # a[2] is a partial block: not cached
    pool.free_blocks(reversed(a))
    # uncached 2 at the head; cached chain 0-1 at the tail, its tail (1) evicted before 0
    assert free_ids(pool) == [2, 3, 4, 5, 1, 0]
    pool.check_integrity()
    # eviction: 2,3,4,5 are plain; the 5th and 6th blocks taken evict 1 then 0
    taken = pool.get_new_blocks(5)
    assert [b.block_id for b in taken] == [2, 3, 4, 5, 1]
    assert 101 not in pool.cached and pool.blocks[1].block_hash is None and pool.blocks[1].token_ids is None
    assert pool.cached == {100: pool.blocks[0]}
    pool.check_integrity()


def test_lru_order_across_requests() -> None:
    pool = BlockPool(4)
    first = pool.get_new_blocks(2)
    second = pool.get_new_blocks(2)
    for h, block in enumerate(first + second):
        pool.cache_block(block, h, None, (h,))
    pool.free_blocks(reversed(second))  # freed first -> least recently used
    pool.free_blocks(reversed(first))
    assert free_ids(pool) == [3, 2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]
    assert set(pool.cached) == {0, 1}


def test_touch_takes_a_free_cached_block_out_of_the_middle() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 10 + i, None, (i,))
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1, 0]
    hit = pool.lookup(12, None, (2,))
    assert hit is pool.blocks[2]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_ids(pool) == [4, 3, 1, 0]
    pool.touch([hit])  # a second sharer: ref count only
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 4
    pool.check_integrity()
    pool.free_blocks([hit, hit])
    assert free_ids(pool) == [4, 3, 1, 0, 2]  # most recently used: evicted last
    pool.check_integrity()


def test_lookup_verifies_tokens_and_parent_not_just_the_hash() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_block(block, 7, None, (1, 2, 3))
    assert pool.lookup(7, None, (1, 2, 3)) is block
    assert pool.lookup(7, None, (1, 2, 4)) is None  # same hash, other tokens: a collision
    assert pool.lookup(7, 5, (1, 2, 3)) is None  # same tokens, other parent
    assert pool.lookup(8, None, (1, 2, 3)) is None
    (other,) = pool.get_new_blocks(1)
    assert not pool.cache_block(other, 7, None, (9, 9, 9))  # hash taken: stays uncached
    assert other.block_hash is None and pool.cached[7] is block
    pool.check_integrity()


def test_double_free_is_rejected() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError):
        pool.free_blocks([block])
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    blocks[0].ref_cnt = 0  # held count dropped without joining the free list
    with pytest.raises(AssertionError):
        pool.check_integrity()
    blocks[0].ref_cnt = 1
    pool.check_integrity()
    blocks[1].block_hash = 5  # claims to be cached but is not in the map
    with pytest.raises(AssertionError):
        pool.check_integrity()
