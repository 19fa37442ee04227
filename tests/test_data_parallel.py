"""Data parallelism: the router's rule, the stats merge, the refusals, and `DataParallelEngine`
over real engines. Here the replicas are in-process engines (the front does not care how a
replica runs); `tests/server/test_data_parallel_serving.py` runs `portside serve -dp 2` with worker
processes end to end."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from portside.engine.async_engine import EngineStoppedError, QueueFullError
from portside.engine.data_parallel import DataParallelEngine, merge_stats
from portside.engine.dp_router import AFFINITY_BLOCKS, AFFINITY_SLACK, PrefixRouter
from portside.engine.llm_engine import LLMEngine
from portside.engine.stats import EngineStats, RequestRecord
from portside.outputs import SpecDecodeStats
from portside.sampling_params import SamplingParams
from portside.testing.tiny import hf_greedy

BLOCK = 4
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, block_size=BLOCK, num_kv_blocks=256)

# --------------------------------------------------------------------------------------------
# PrefixRouter: the rule
# --------------------------------------------------------------------------------------------


def prompt(first: int, length: int) -> list[int]:
    return [first + i for i in range(length)]


def test_idle_replicas_take_turns_and_load_wins_without_a_shared_prefix():
    router = PrefixRouter(3, BLOCK)
    assert [router.choose(prompt(100 * i, 12), [0, 0, 0]) for i in range(4)] == [0, 1, 2, 0]
    assert router.choose(prompt(999, 12), [5, 2, 7]) == 1
    assert router.choose(None, [3, 3, 1]) == 2  # unknown ids (a text prompt): load alone


def test_a_shared_prefix_goes_to_the_replica_that_has_it_until_it_is_clearly_busier():
    router = PrefixRouter(2, BLOCK)
    shared = prompt(7, 3 * BLOCK)
    first = router.choose(shared + [1, 2], [0, 0])
    other = 1 - first
    loads = [0, 0]
    for k in range(AFFINITY_SLACK):  # up to the slack ahead it stays
        loads[first] = k + 1
        assert router.choose(shared + [50 + k], loads) == first
    loads[first] = AFFINITY_SLACK + 1  # now more than the slack ahead of an idle replica: spill
    assert router.choose(shared + [90], loads) == other
    assert router.choose(shared + [91], [12, 10]) == other  # the spill took the prefix: it is preferred now
    # the slack grows with load: a quarter of the least loaded replica's on top
    loads = [0, 0]
    loads[other], loads[first] = 40, 40 + AFFINITY_SLACK + 10
    assert router.choose(shared, loads) == other


def test_the_longest_remembered_prefix_decides():
    router = PrefixRouter(2, BLOCK)
    a = prompt(1, 4 * BLOCK)
    assert router.choose(a[:BLOCK] + prompt(500, 3 * BLOCK), [0, 0]) == 0  # shares a's first block only
    assert router.choose(a, [0, 0]) == 0  # one block in common with replica 0's prompt: preferred
    b = a[:2 * BLOCK] + prompt(700, 2 * BLOCK)
    router._owner[router.prefix_hashes(a)[1]] = 1  # pretend replica 1 last took a's first two blocks
    assert router.choose(b, [0, 0]) == 1


def test_short_prompts_lora_adapters_and_the_table_bound():
    router = PrefixRouter(2, BLOCK, table_size=10)
    assert router.prefix_hashes(prompt(1, BLOCK - 1)) == []  # no full block: no affinity
    assert len(router.prefix_hashes(prompt(1, 10 * BLOCK))) == AFFINITY_BLOCKS
    same = prompt(1, 2 * BLOCK)
    assert router.prefix_hashes(same, salt=3) != router.prefix_hashes(same)  # another adapter, another cache
    for i in range(20):
        router.choose(prompt(1000 * i, 3 * BLOCK), [0, 0])
    assert len(router._owner) == 10
    with pytest.raises(ValueError, match="expected 2 loads"):
        router.choose(same, [0])


def test_merge_stats_sums_counts_and_recomputes_usage():
    a = EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_used_blocks=50, num_total_blocks=100,
                    prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=0, prompt_tokens_total=30,
                    generation_tokens_total=7, weight_bytes=1000, spec_decode=SpecDecodeStats(1, 3, 2, [1, 1]),
                    step_tokens=5, token_intervals=[0.1])
    b = EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.25, num_used_blocks=75, num_total_blocks=300,
                    prefix_cache_queries=5, prefix_cache_hits=5, num_preemptions=2, prompt_tokens_total=3,
                    generation_tokens_total=1, weight_bytes=1000, spec_decode=SpecDecodeStats(2, 4, 1, [1]),
                    step_tokens=1, token_intervals=[0.2, 0.3])
    m = merge_stats([a, b])
    assert (m.num_running, m.num_waiting, m.num_used_blocks, m.num_total_blocks) == (3, 1, 125, 400)
    assert m.kv_cache_usage == pytest.approx(125 / 400)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.num_preemptions) == (15, 9, 2)
    assert m.spec_decode == SpecDecodeStats(3, 7, 3, [2, 1])
    assert m.token_intervals == [0.1, 0.2, 0.3] and m.step_tokens == 6
    assert merge_stats([a, None]) is None


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


def test_llm_refuses_data_parallelism_naming_the_server(tiny_llama: Path):
    from portside import LLM

    with pytest.raises(ValueError, match=r"portside serve MODEL -dp 2"):
        LLM(model=str(tiny_llama), data_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match="data_parallel_size must be an integer of at least 1"):
        LLM(model=str(tiny_llama), data_parallel_size=0, **ENGINE)


def test_the_front_needs_two_replicas():
    with pytest.raises(ValueError, match="at least two replicas"):
        DataParallelEngine([object()], block_size=BLOCK)  # type: ignore[list-item]


# --------------------------------------------------------------------------------------------
# DataParallelEngine over two real (in-process) engines
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> Any:
    replicas = [LLMEngine.from_args(model=str(tiny_llama), **ENGINE) for _ in range(2)]
    yield replicas
    for e in replicas:
        e.shutdown()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def collect(stream: Any) -> list[int]:
    tokens: list[int] = []
    async for out in stream:
        tokens = out.outputs[0].token_ids
    return tokens


def test_front_routes_by_prefix_and_load_with_transformers_greedy_tokens(engines: list[LLMEngine], tiny_llama: Path):
    shared = [(7 * i) % 200 + 3 for i in range(5 * BLOCK)]  # a long common prefix
    grouped = [shared + [300 + i, 301 + i] for i in range(4)]
    distinct = [[(11 * i + 13 * k) % 250 + 2 for k in range(9)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)  # all still running when the last is routed

    async def main() -> tuple[list[list[int]], list[int], list[Any], list[RequestRecord]]:
        front = DataParallelEngine(engines, block_size=BLOCK, max_waiting_requests=64)
        records: list[RequestRecord] = []
        front.on_request_done = records.append
        front.start()
        try:
            streams = [await front.add_request(f"g{i}", p, params) for i, p in enumerate(grouped)]
            streams += [await front.add_request(f"d{i}", p, params) for i, p in enumerate(distinct)]
            loads = front.loads()
            outs = [await collect(s) for s in streams]
            stats = front.engine_stats()
        finally:
            await front.shutdown(5)
        return outs, loads, stats, records

    outs, loads, stats, records = run(main())
    for p, got in zip(grouped + distinct, outs, strict=True):
        assert got == hf_greedy(tiny_llama, p, 64)
    assert loads == [4, 4]  # the grouped prompts together, the others on the other replica
    owner = {r.request_id: r.engine_index for r in records}
    assert len({owner[f"g{i}"] for i in range(4)}) == 1
    assert {owner[f"d{i}"] for i in range(4)} == {1 - owner["g0"]}
    hits = [s.prefix_cache_hits for s in stats]
    assert hits[owner["g0"]] >= 3 * 5 * BLOCK - BLOCK and hits[1 - owner["g0"]] == 0  # later grouped ones hit


def test_front_aborts_at_the_owner_refuses_duplicates_and_bounds_waiting(engines: list[LLMEngine], monkeypatch: Any):
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    go = threading.Event()  # the replicas accept requests but take no step until it is set
    for e in engines:
        monkeypatch.setattr(e, "step", lambda step=e.step: (go.wait(10), step())[1])

    async def main() -> None:
        front = DataParallelEngine(engines, block_size=BLOCK, max_waiting_requests=3)
        front.start()
        try:
            a = await front.add_request("a", [5, 6, 7], params)
            b = await front.add_request("b", [8, 9, 10], params)
            assert front.loads() == [1, 1] and front.num_waiting == 2
            with pytest.raises(ValueError, match="already in use"):
                await front.add_request("a", [1, 2], params)
            front.check_capacity(1)  # the bound spans both replicas' waiting sequences
            with pytest.raises(QueueFullError):
                front.check_capacity(2)
            with pytest.raises(ValueError, match="more than the 3"):
                front.check_capacity(4)
            go.set()
            front.abort("a")  # reaches the replica that owns it
            assert sorted(front.loads()) == [0, 1] and a.finished and not b.finished
            b.close()
            await asyncio.sleep(0.2)
            assert front.num_unfinished == 0
        finally:
            go.set()
            await front.shutdown(5)
        assert not front.is_running
        with pytest.raises(EngineStoppedError):
            await front.add_request("c", [1, 2, 3], params)

    run(main())
    assert all(not e.has_unfinished_requests() and e.scheduler.make_stats().kv_cache_usage == 0 for e in engines)


def test_front_shares_grammar_cache_and_adapter_registry(engines: list[LLMEngine]):
    DataParallelEngine(engines, block_size=BLOCK)
    assert engines[1].structured is engines[0].structured
    assert engines[1].loras is engines[0].loras


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2}], ids=["tp1", "tp2"])
def test_replicas_compute_in_their_own_worker_processes(tiny_llama: Path, layout: dict[str, int]):
    """`start_replicas`: every replica runs its TP group in worker processes of its own (also a
    world of one rank), gives transformers' greedy tokens, and shutdown leaves no worker."""
    import os

    from portside.engine.data_parallel import start_replicas

    replicas = start_replicas(2, model=str(tiny_llama), **ENGINE, **layout)
    pids = [pid for e in replicas for pid in e.executor.pids]
    assert len(set(pids)) == 2 * layout.get("tensor_parallel_size", 1)
    prompts = [[(5 * i + 3 * k) % 300 + 2 for k in range(7 + i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def main() -> list[list[int]]:
        front = DataParallelEngine(replicas, block_size=BLOCK)
        front.start()
        try:
            streams = [await front.add_request(str(i), p, params) for i, p in enumerate(prompts)]
            assert front.loads() == [2, 2] or sum(front.loads()) < 4  # balanced (unless some finished already)
            return [await collect(s) for s in streams]
        finally:
            await front.shutdown(5)

    for p, got in zip(prompts, run(main()), strict=True):
        assert got == hf_greedy(tiny_llama, p, 8)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


@pytest.mark.slow
def test_a_failed_start_leaves_no_replica_running(tiny_llama: Path):
    """Every replica's workers start, then the KV cache cannot hold one request: the error is
    raised once and no worker outlives it."""
    import multiprocessing

    from portside.engine.data_parallel import start_replicas

    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="fewer than one request may need"):
        start_replicas(2, model=str(tiny_llama), **(ENGINE | {"num_kv_blocks": 2}))
    assert {p.pid for p in multiprocessing.active_children()} <= before
