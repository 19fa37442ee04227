"""The KV cache manager with recurrent layers (`portside.kv_cache.state`): a state slot per running
request, checkpoints saved at block boundaries, prefix hits trimmed to a saved state and restored
by a copy, prompt chunks cut at block boundaries, nothing leaked or copied for a freed request."""

from __future__ import annotations

from portside.kv_cache.manager import KVCacheManager
from portside.kv_cache.state import num_state_slots
from portside.request import Request
from portside.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def _run(kv: KVCacheManager, req: Request, num_new: int, hit: bool = False) -> list[int] | None:
    """Schedule `num_new` tokens (after a lookup when `hit`), then mark them computed and cache."""
    blocks, n = kv.get_computed_blocks(req) if hit else ([], 0)
    if hit:
        req.num_computed_tokens = 0
    got = kv.allocate_slots(req, num_new, new_computed_blocks=blocks)
    if got is None:
        return None
    req.num_computed_tokens += n + num_new
    kv.cache_blocks(req, req.num_computed_tokens)
    kv.check_integrity()
    return got


def test_num_state_slots():
    assert num_state_slots(8, False) == 9
    assert num_state_slots(8, True) == 17


def test_each_running_request_holds_one_slot_and_frees_it():
    kv = KVCacheManager(32, BS, enable_prefix_caching=False, num_state_slots=3)
    a, b = _req("a", list(range(10))), _req("b", list(range(20, 27)))
    assert _run(kv, a, 10) is not None and _run(kv, b, 7) is not None
    sa, sb = kv.state_slot("a"), kv.state_slot("b")
    assert sa >= 0 and sb >= 0 and sa != sb
    assert kv.take_state_copies() == ([], [])  # no prefix caching: nothing saved
    assert _run(kv, a, 1) is not None and kv.state_slot("a") == sa  # a decode keeps its slot
    kv.free(a)
    assert kv.state_slot("a") == -1
    c, d, e = _req("c", [1, 2]), _req("d", [3, 4]), _req("e", [5, 6])
    assert _run(kv, c, 2) is not None and _run(kv, d, 2) is not None  # a's slot is reused
    assert _run(kv, e, 2) is None  # 3 slots, 3 running requests
    assert "e" not in kv.req_to_blocks
    kv.check_integrity()


def test_no_free_slot_refuses_the_allocation_and_changes_nothing():
    kv = KVCacheManager(32, BS, enable_prefix_caching=False, num_state_slots=1)
    a, b = _req("a", [1, 2, 3]), _req("b", [4, 5, 6])
    assert _run(kv, a, 3) is not None
    free_blocks = kv.num_free_blocks
    assert kv.allocate_slots(b, 3) is None
    assert kv.num_free_blocks == free_blocks and "b" not in kv.req_to_blocks
    kv.check_integrity()


def test_align_chunk_ends_prompt_chunks_on_block_boundaries():
    kv = KVCacheManager(32, BS, enable_prefix_caching=True, num_state_slots=4)
    req = _req("a", list(range(10)))  # boundaries 4, 8; the last known token is index 9
    assert kv.align_chunk(req, 0, 10) == 8  # reaches the end: stop at the last boundary before it
    assert kv.align_chunk(req, 8, 2) == 2  # the rest
    assert kv.align_chunk(req, 0, 6) == 4  # budget-cut chunk: its last boundary
    assert kv.align_chunk(req, 0, 3) == 3  # no boundary inside: unchanged
    assert kv.align_chunk(req, 9, 1) == 1  # a decode
    plain = KVCacheManager(32, BS, enable_prefix_caching=True)
    assert plain.align_chunk(req, 0, 10) == 10  # no recurrent layers: unchanged
    off = KVCacheManager(32, BS, enable_prefix_caching=False, num_state_slots=4)
    assert off.align_chunk(req, 0, 10) == 10  # no prefix caching: nothing to save


def test_a_checkpoint_saved_at_a_boundary_serves_a_later_hit_through_a_copy():
    kv = KVCacheManager(32, BS, enable_prefix_caching=True, num_state_slots=num_state_slots(2, True))
    prompt = list(range(100, 110))
    a = _req("a", prompt)
    assert _run(kv, a, kv.align_chunk(a, 0, 10)) is not None  # 8 tokens: ends on a boundary
    before, after = kv.take_state_copies()
    work_a = kv.state_slot("a")
    assert before == [] and len(after) == 1 and after[0][0] == work_a
    ckpt = after[0][1]
    assert _run(kv, a, 2) is not None and kv.take_state_copies() == ([], [])
    kv.free(a)
    # the same prefix again: the hit is the 2 blocks whose end has the saved state
    b = _req("b", prompt + [7, 7])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    assert _run(kv, b, 4, hit=True) is not None
    before, after = kv.take_state_copies()
    assert before == [(ckpt, kv.state_slot("b"))]
    assert after and after[0][0] == kv.state_slot("b")  # 12 tokens: the next boundary is saved too
    assert kv.state.pool.blocks[ckpt].ref_cnt == 1  # held until b's next allocation
    assert _run(kv, b, 1) is not None
    assert kv.state.pool.blocks[ckpt].ref_cnt == 0
    kv.free(b)
    kv.check_integrity()


def test_a_hit_without_a_saved_state_is_trimmed():
    kv = KVCacheManager(32, BS, enable_prefix_caching=True, num_state_slots=5)
    prompt = list(range(10))
    a = _req("a", prompt)
    assert _run(kv, a, 10) is not None  # one chunk, not cut: blocks 0-1 cached, but no state at 4 or 8
    kv.take_state_copies()
    kv.free(a)
    b = _req("b", prompt + [1])
    blocks, n = kv.get_computed_blocks(b)
    assert blocks == [] and n == 0


def test_a_request_freed_in_the_pass_that_scheduled_it_leaves_no_copy():
    kv = KVCacheManager(32, BS, enable_prefix_caching=True, num_state_slots=6)
    a = _req("a", list(range(9)))
    assert kv.allocate_slots(a, 8) is not None
    assert kv.state.copies_after  # a save planned at 8
    kv.free(a)  # preempted before the step ran
    assert kv.take_state_copies() == ([], [])
    kv.check_integrity()
    assert kv.state.num_free == 6


def test_forks_share_nothing_with_recurrent_layers():
    kv = KVCacheManager(32, BS, enable_prefix_caching=True, num_state_slots=6)
    parent = _req("p", list(range(9)))
    assert _run(kv, parent, 9) is not None
    child = _req("c", list(range(9)))
    assert kv.get_fork_blocks(parent, child) == ([], 0)


def test_saving_a_checkpoint_never_blocks_an_allocation():
    """With no slot left over for a checkpoint, the step runs without saving (no wait, no preemption)."""
    kv = KVCacheManager(32, BS, enable_prefix_caching=True, num_state_slots=2)
    a = _req("a", list(range(13)))
    assert kv.allocate_slots(a, 4) is not None  # a's working slot, and a checkpoint at 4 (the last free slot)
    assert len(kv.take_state_copies()[1]) == 1 and kv.state.num_free == 0
    a.num_computed_tokens = 4  # (its block not cached yet: the checkpoint is still held)
    assert kv.allocate_slots(a, 4) is not None  # ends on a boundary again: no slot to save into, runs anyway
    assert kv.take_state_copies() == ([], [])
    kv.check_integrity()
