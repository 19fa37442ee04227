"""The scheduler with pipeline micro-batches (`num_micro_batches` > 1, `send_token_ids`): steps
scheduled while others are in flight never share a request, never preempt one in flight, split
the running requests into turns, and tell an earlier stage every token it never sampled; outputs
equal the reference continuation whatever the pool size."""

from __future__ import annotations

from collections import deque

import pytest
from test_scheduler import BS, FakeRunner, make_request, reference_outputs

from portside.config import SchedulerConfig
from portside.sched.scheduler import Scheduler


def make(num_blocks: int, micro: int = 2) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8)
    return Scheduler(config, BS, num_blocks, True, 64, num_micro_batches=micro, send_token_ids=True)


@pytest.mark.parametrize("num_blocks", [64, 14], ids=["roomy", "preempting"])
def test_batches_in_flight_are_disjoint_and_outputs_exact(num_blocks):
    sched, runner = make(num_blocks), FakeRunner()
    prompts = {f"r{i}": [3 + i, 5, 7 + i, 11][: 2 + i % 3] * (1 + i % 2) for i in range(7)}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=12))
    early_stage: dict[str, list[int]] = {}  # what a runner that never samples knows of each request
    in_flight: deque = deque()
    done: dict[str, list[int]] = {}
    seen_sizes = set()
    for _ in range(400):
        if not sched.has_unfinished_requests() and not in_flight:
            break
        if len(in_flight) < 2:
            out = sched.schedule()
            sched.check_integrity()
            busy = {rid for o, _ in in_flight for rid in o.num_scheduled_tokens}
            assert not busy & set(out.num_scheduled_tokens), "a request in two batches at once"
            assert not busy & out.finished_req_ids, "a request in flight was preempted"
            for rid in out.finished_req_ids:
                early_stage.pop(rid, None)
            for new in out.scheduled_new_reqs:
                early_stage[new.req_id] = new.prompt_token_ids + new.output_token_ids
            for cached in out.scheduled_cached_reqs:
                early_stage[cached.req_id] += cached.new_token_ids
            for rid in out.num_scheduled_tokens:
                request = sched.requests[rid]
                assert early_stage[rid] == request.prompt_token_ids + request.output_token_ids
            if not out.is_empty:
                seen_sizes.add(len(out.num_scheduled_tokens))
                in_flight.append((out, runner.execute(out)))
                if len(in_flight) < 2:
                    continue
        out, result = in_flight.popleft()
        for request in sched.update_from_output(out, result):
            if request.is_finished:
                done[request.request_id] = list(request.output_token_ids)
        sched.check_integrity()
    assert not sched.has_unfinished_requests() and not in_flight
    for rid, p in prompts.items():
        assert done[rid] == reference_outputs(p, 12), rid
    assert sched.kv.pool.num_free_blocks == num_blocks
    if num_blocks == 14:
        assert sched.num_preemptions > 0
    else:
        assert max(seen_sizes) <= 7 and 4 in seen_sizes  # seven running requests: turns of ceil(7 / 2)


def test_one_micro_batch_is_the_plain_scheduler():
    sched = make(64, micro=1)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [1, 2, 3], max_tokens=4))
    first = sched.schedule()
    assert len(first.num_scheduled_tokens) == 3


def test_micro_batch_tokens_cap_a_burst_of_prompts_but_never_a_turn_of_decodes():
    """`micro_batch_tokens` (the platform's or --pipeline-micro-batch-tokens) splits a burst of
    prompts into micro-batches of at most that many tokens, below budget / P; a turn of decodes
    (ceil(max_num_seqs / P) requests) always fits, so no running request waits a round."""
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8)
    sched = Scheduler(config, BS, 64, True, 64, num_micro_batches=2, micro_batch_tokens=5, send_token_ids=True)
    runner = FakeRunner()
    for i in range(8):
        sched.add_request(make_request(f"r{i}", [3 + i, 5, 7, 11, 13, 17], max_tokens=6))
    in_flight: deque = deque()
    sizes: list[int] = []
    prefill_sizes: list[int] = []
    while sched.has_unfinished_requests() or in_flight:
        if len(in_flight) < 2:
            out = sched.schedule()
            if not out.is_empty:
                sizes.append(out.total_num_scheduled_tokens)
                if any(n > 1 for n in out.num_scheduled_tokens.values()):
                    prefill_sizes.append(out.total_num_scheduled_tokens)
                in_flight.append((out, runner.execute(out)))
                if len(in_flight) < 2:
                    continue
        out, result = in_flight.popleft()
        sched.update_from_output(out, result)
    assert max(prefill_sizes) == 5 and len(prefill_sizes) >= 48 // 5  # 48 prompt tokens in chunks of 5
    # decodes: 8 running requests in two turns of 4 each, over the cap of 5 tokens with 1 + 0 spec
    sched = Scheduler(config, BS, 64, True, 64, num_micro_batches=2, micro_batch_tokens=1, send_token_ids=True)
    for i in range(8):
        sched.add_request(make_request(f"d{i}", [3 + i], max_tokens=3))
    turns = [sched.schedule(), sched.schedule()]
    assert [t.total_num_scheduled_tokens for t in turns] == [4, 4]
    assert not set(turns[0].num_scheduled_tokens) & set(turns[1].num_scheduled_tokens)
