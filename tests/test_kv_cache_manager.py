"""KVCacheManager: block tables, prefix-cache hits, eviction, forks; plus a randomized model check.

Exact block ids assume the pool's order: fresh blocks in id order from the head, a freed
request's uncached blocks back at the head, its cached blocks at the tail, tail block first.
"""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from portside.kv_cache import hashing
from portside.kv_cache.manager import KVCacheManager
from portside.request import Request
from portside.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, list(tokens), SamplingParams())


def compute(kv: KVCacheManager, req: Request, num_new: int, computed_blocks=None, num_hit: int = 0) -> list[int]:
    """What the scheduler + runner do for one step: allocate, compute, then cache."""
    new_ids = kv.allocate_slots(req, num_new, new_computed_blocks=computed_blocks)
    assert new_ids is not None
    req.num_computed_tokens += num_hit + num_new
    kv.cache_blocks(req, req.num_computed_tokens)
    kv.check_integrity()
    return new_ids


def prefill(kv: KVCacheManager, req: Request) -> list[int]:
    blocks, num_hit = kv.get_computed_blocks(req)
    return compute(kv, req, req.num_tokens - num_hit, blocks, num_hit)


def ref_cnts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def test_allocate_covers_tokens_with_at_most_one_partial_block() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(10)))
    assert prefill(kv, req) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    # decodes fill the partial block before a new one is taken
    req.output_token_ids.append(100)
    assert compute(kv, req, 1) == []
    req.output_token_ids.append(101)
    assert compute(kv, req, 1) == []
    req.output_token_ids.append(102)
    assert compute(kv, req, 1) == [3]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 6 and kv.usage == pytest.approx(0.4)


def test_prefix_hit_shares_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    prefill(kv, a)  # blocks 0 1 2; 0 and 1 are full and cached
    assert set(kv.pool.cached.values()) == {kv.pool.blocks[0], kv.pool.blocks[1]}
    b = make_request("b", list(range(8)) + [50, 51, 52])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_hit == 8
    assert compute(kv, b, 3, blocks, num_hit) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert ref_cnts(kv)[:4] == [2, 2, 1, 1]
    assert kv.prefix_cache_stats.queries == 21 and kv.prefix_cache_stats.hits == 8
    # a divergence inside the second block stops the hit after the first
    c = make_request("c", list(range(6)) + [99, 99, 99])
    assert kv.get_computed_blocks(c)[1] == 4


def test_hit_never_covers_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(12)))  # exactly 3 blocks
    prefill(kv, a)
    assert len(kv.pool.cached) == 3
    b = make_request("b", list(range(12)))
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_hit == 8  # num_blocks - 1
    assert compute(kv, b, 4, blocks, num_hit) == [3]
    # one more token and the third block can be hit too
    c = make_request("c", list(range(13)))
    assert kv.get_computed_blocks(c)[1] == 12
    # a one-token prompt can never hit
    assert kv.get_computed_blocks(make_request("d", [0]))[1] == 0


def test_eviction_is_lru_and_tail_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(10)))  # 0 1 (cached) 2 (partial)
    b = make_request("b", list(range(100, 108)))  # 3 4, both full and cached
    prefill(kv, a)
    prefill(kv, b)
    kv.free(a)
    kv.free(b)
    assert free_ids(kv) == [2, 5, 1, 0, 4, 3]
    assert kv.num_free_blocks == 6 and kv.usage == 0.0
    # a new 16-token request needs 4 blocks: the two plain ones, then a's tail and head
    c = make_request("c", list(range(200, 216)))
    assert prefill(kv, c) == [2, 5, 1, 0]
    assert kv.get_computed_blocks(make_request("x", list(range(10))))[1] == 0  # a is gone
    assert kv.get_computed_blocks(make_request("y", list(range(100, 109))))[1] == 8  # b is not


def test_hit_on_free_blocks_counts_them_as_taken() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(12)))
    prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request("b", list(range(12)) + [7] * 9)  # 21 tokens: 6 blocks > 4
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    before = ref_cnts(kv)
    assert kv.allocate_slots(b, 9, new_computed_blocks=blocks) is None  # 3 hits + 3 new > 4
    assert ref_cnts(kv) == before and kv.get_block_ids("b") == [] and kv.num_free_blocks == 4
    kv.check_integrity()
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (12, 0)  # b not admitted
    b2 = make_request("b2", list(range(12)) + [7])  # 3 hits + 1 new == 4
    blocks, num_hit = kv.get_computed_blocks(b2)
    assert kv.get_computed_blocks(b2) == (blocks, num_hit)  # a retry counts once
    assert compute(kv, b2, 1, blocks, num_hit) == [3]
    assert kv.num_free_blocks == 0
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (12 + 13, 12)
    assert kv.prefix_cache_stats.hit_rate == pytest.approx(12 / 25)


def test_allocation_failure_allocates_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    prefill(kv, a)
    b = make_request("b", list(range(50, 59)))  # needs 3 blocks, 1 free
    assert kv.allocate_slots(b, 9) is None
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1
    kv.check_integrity()


def test_hash_collisions_are_rejected_by_the_token_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "hash_block_tokens", lambda parent, tokens: 0)
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    # every block hashes to 0: only the first is cached, the second collides and stays out
    assert list(kv.pool.cached) == [0] and kv.pool.cached[0].block_id == 0
    assert kv.pool.blocks[1].block_hash is None
    other = make_request("o", [40, 41, 42, 43, 44])  # same hash, other tokens
    assert kv.get_computed_blocks(other) == ([], 0)
    shifted = make_request("s", [4, 5, 6, 7, 8])  # a's second block's tokens, at the start
    assert kv.get_computed_blocks(shifted) == ([], 0)
    same = make_request("p", list(range(9)))
    blocks, num_hit = kv.get_computed_blocks(same)
    assert [b.block_id for b in blocks] == [0] and num_hit == 4  # verified, then the chain stops


def test_fork_shares_full_computed_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    parent = make_request("p", list(range(10)))
    prefill(kv, parent)
    child = make_request("c", list(range(10)))
    kv.fork(parent, child)
    assert kv.get_block_ids("c") == [0, 1] and child.num_computed_tokens == 8
    assert ref_cnts(kv)[:3] == [2, 2, 1]
    kv.check_integrity()
    assert compute(kv, child, 2) == [3]  # recomputes its partial block in a new one
    assert kv.get_block_ids("c") == [0, 1, 3]
    kv.free(parent)
    assert ref_cnts(kv)[:4] == [1, 1, 0, 1]
    kv.free(child)
    assert kv.num_free_blocks == 10 and all(r == 0 for r in ref_cnts(kv))
    assert kv.pool.cached == {}  # prefix caching off: nothing was ever cached
    kv.check_integrity()


def test_fork_of_an_exact_multiple_keeps_the_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    parent = make_request("p", list(range(8)))
    prefill(kv, parent)
    child = make_request("c", list(range(8)))
    kv.fork(parent, child)
    assert kv.get_block_ids("c") == [0] and child.num_computed_tokens == 4
    assert compute(kv, child, 4) == [2]


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    prefill(kv, make_request("a", list(range(10))))
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    assert kv.prefix_cache_stats.queries == 0


# ---- randomized model check ----------------------------------------------------------------


class KVCacheMachine(RuleBasedStateMachine):
    """Random allocate / decode / fork / free / preempt sequences against a model of what each
    block physically holds: a hit or a fork must hand out blocks holding exactly the request's
    tokens, and a request only ever writes into blocks it holds alone."""

    window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=self.window)
        self.live: dict[str, Request] = {}
        self.content: dict[int, list[int | None]] = {}  # block id -> token written per slot
        self.next_id = 0

    def _check_holds(self, req: Request, block_ids: list[int], num_tokens: int) -> None:
        """Every held block holds the request's tokens; with a window, only blocks no query
        at >= num_tokens can see are freed (-1)."""
        tokens = req.all_token_ids
        first_visible = 0 if self.window is None else max(0, num_tokens - self.window + 1)
        for pos in range(num_tokens):
            if block_ids[pos // BS] == -1:
                assert pos < first_visible and (pos // BS + 1) * BS <= first_visible, (req, pos)
                continue
            assert self.content[block_ids[pos // BS]][pos % BS] == tokens[pos], (req, pos)

    def _run(self, req: Request, num_new: int, blocks=(), num_hit: int = 0) -> bool:
        if self.kv.allocate_slots(req, num_new, new_computed_blocks=list(blocks)) is None:
            return False
        ids = self.kv.get_block_ids(req.request_id)
        self._check_holds(req, ids, num_hit + req.num_computed_tokens)
        tokens = req.all_token_ids
        start = req.num_computed_tokens + num_hit
        for pos in range(start, start + num_new):
            block = self.kv.pool.blocks[ids[pos // BS]]
            assert block.ref_cnt == 1, f"{req} writes into shared {block}"
            self.content.setdefault(block.block_id, [None] * BS)[pos % BS] = tokens[pos]
        req.num_computed_tokens = start + num_new
        self.kv.cache_blocks(req, req.num_computed_tokens)
        self.kv.free_out_of_window_blocks(req)
        return True

    @rule(prefix=st.integers(0, 3), tail=st.lists(st.integers(0, 2), max_size=9), chunk=st.integers(1, 12))
    def add(self, prefix: int, tail: list[int], chunk: int) -> None:
        # shared prefixes over a tiny vocabulary make hits (and near misses) common
        prompt = [7] * (prefix * BS) + tail or [1]
        req = make_request(f"r{self.next_id}", prompt)
        self.next_id += 1
        blocks, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit < req.num_tokens and num_hit % BS == 0
        event(f"prefix hit of {num_hit // BS} blocks")
        if self._run(req, min(chunk, req.num_tokens - num_hit), blocks, num_hit):
            self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12), token=st.integers(0, 2))
    def step(self, data: st.DataObject, chunk: int, token: int) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(token)  # sampled: one more token to compute
        self._run(req, min(chunk, req.num_tokens - req.num_computed_tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = make_request(f"r{self.next_id}", parent.prompt_token_ids)
        self.next_id += 1
        self.kv.fork(parent, child)
        assert child.num_computed_tokens % BS == 0 and child.num_computed_tokens < child.num_tokens
        event(f"fork shares {child.num_computed_tokens // BS} blocks")
        self._check_holds(child, self.kv.get_block_ids(child.request_id), child.num_computed_tokens)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.kv.free(req)
        req.num_computed_tokens = 0
        blocks, num_hit = self.kv.get_computed_blocks(req)
        if not self._run(req, req.num_tokens - num_hit, blocks, num_hit):
            del self.live[req.request_id]  # no room to resume: it stays out

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()
        for req in self.live.values():
            assert len(self.kv.get_block_ids(req.request_id)) == -(-req.num_computed_tokens // BS)
            # every dead block is freed as soon as the step that killed it is done
            assert self.kv.num_null_blocks(req.request_id) == self.kv.num_dead_blocks(req.num_computed_tokens)
            self._check_holds(req, self.kv.get_block_ids(req.request_id), req.num_computed_tokens)

    def teardown(self) -> None:
        for req in self.live.values():
            self.kv.free(req)
        self.kv.check_integrity()
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        assert self.kv.num_free_blocks == self.kv.num_blocks


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class WindowedKVCacheMachine(KVCacheMachine):
    """The same, with a sliding window of 6 (not a multiple of the block size): dead blocks are
    freed after every step, and hits and forks still hand out exactly the request's tokens."""

    window = 6


TestWindowedKVCacheMachine = WindowedKVCacheMachine.TestCase
TestWindowedKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_block_hashes_are_equal_across_processes_with_lora_and_images() -> None:
    """A restarted server (another PYTHONHASHSEED) must find its disk-tier blocks again: the LoRA
    root and image identifiers enter the chain as stable digests, not per-process `str` hashes."""
    import os
    import subprocess
    import sys

    code = ("from portside.kv_cache import hashing; from portside.lora.request import LoRARequest;"
            "from portside.request import Request; from portside.sampling_params import SamplingParams;"
            "r = Request('r', list(range(20)), SamplingParams(), lora_request=LoRARequest('ad', 3, '/a'));"
            "print(r.block_hash_root, hashing.hash_full_blocks(list(range(20)), 4, [], root=r.block_hash_root,"
            " extra_keys=lambda s, e: ('img-sha256-abc',) if s < 8 else ()))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1, outs
    root = int(outs.pop().split()[0])
    assert root != hashing.stable_key("lora", "other", "/a")
