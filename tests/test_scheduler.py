"""Scheduler: budgets, chunked prefill, preemption, policies, aborts, stops, n>1 forks.

`FakeRunner` plays the model runner honestly: it keeps its own copy of every request from the
`SchedulerOutput` diffs, "writes" each computed token into its slot of a fake paged KV cache,
checks that every context token it attends over is really there, and samples the next token as
a deterministic function of the sequence so far. Any bookkeeping bug (a wrong prefix hit or
fork, a block handed to two writers, a lost diff, a bad recompute) shows up as a wrong token.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from portside.config import SchedulerConfig
from portside.request import Request, RequestStatus
from portside.sampling_params import SamplingParams
from portside.sched.output import ModelRunnerOutput, SchedulerOutput
from portside.sched.scheduler import Scheduler

BS = 4
VOCAB = 11


def next_token(tokens: list[int]) -> int:
    """The fake model: depends on the whole history through its last token and length."""
    return (tokens[-1] * 7 + len(tokens) * 3 + 1) % VOCAB


def reference_outputs(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@dataclass
class RunnerState:
    tokens: list[int]
    num_computed: int
    block_ids: list[int]


class FakeRunner:
    def __init__(self, block_size: int = BS, window: int | None = None) -> None:
        self.block_size = block_size
        self.window = window  # a query at p reads only keys k > p - window
        self.reqs: dict[str, RunnerState] = {}
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token written there

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent twice without being forgotten"
            tokens = new.prompt_token_ids + new.output_token_ids
            self.reqs[new.req_id] = RunnerState(tokens, new.num_computed_tokens, list(new.block_ids))
        for cached in out.scheduled_cached_reqs:
            state = self.reqs[cached.req_id]
            assert state.num_computed == cached.num_computed_tokens
            state.block_ids += cached.new_block_ids
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        sampled: dict[str, list[int]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            start, table = state.num_computed, state.block_ids
            assert n > 0 and start + n <= len(state.tokens)
            assert len(table) == -(-(start + n) // bs), "not exactly one partial block"
            first = 0 if self.window is None else max(0, start - self.window + 1)
            for pos in range(first, start):  # the context it reads must already be in the cache
                assert self.slots[(table[pos // bs], pos % bs)] == state.tokens[pos], (req_id, pos)
            for pos in range(start, start + n):
                self.slots[(table[pos // bs], pos % bs)] = state.tokens[pos]
            state.num_computed += n
            sampled[req_id] = []
            if state.num_computed == len(state.tokens):
                token = next_token(state.tokens)
                state.tokens.append(token)
                sampled[req_id] = [token]
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    chunked: bool = True,
    prefix_caching: bool = True,
    max_model_len: int = 64,
    window: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, policy=policy, enable_chunked_prefill=chunked
    )
    return Scheduler(config, BS, num_blocks, prefix_caching, max_model_len, sliding_window=window)


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 8,
    eos: int | None = None,
    priority: int = 0,
    arrival: float = 0.0,
    parent_id: str | None = None,
    **params: object,
) -> Request:
    return Request(
        req_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_id=eos,
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=arrival,
        parent_id=parent_id,
    )


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    sched.check_integrity()
    touched = sched.update_from_output(out, runner.execute(out))
    sched.check_integrity()
    return out, touched


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "no progress"
        outs.append(step(sched, runner)[0])
    return outs


def all_blocks_free(sched: Scheduler) -> bool:
    return sched.kv.num_free_blocks == sched.kv.num_blocks and all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


# ---- budgets and chunked prefill --------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_by_the_budget() -> None:
    sched, runner = make_scheduler(budget=8), FakeRunner()
    a = make_request("a", list(range(20)), max_tokens=3)
    sched.add_request(a)
    out, touched = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 8} and touched == []
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [("a", [0, 1], 0)]
    out, touched = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 8} and touched == []
    assert [(c.new_block_ids, c.num_computed_tokens) for c in out.scheduled_cached_reqs] == [([2, 3], 8)]
    out, touched = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 4} and touched == [a]
    assert out.scheduled_cached_reqs[0].new_block_ids == [4]
    assert a.output_token_ids == reference_outputs(a.prompt_token_ids, 1)
    out, _ = step(sched, runner)  # first decode: token 21 needs a sixth block
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_cached_reqs[0].new_block_ids == [5]
    run_all(sched, runner)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == reference_outputs(a.prompt_token_ids, 3)
    assert all_blocks_free(sched)


def test_decodes_and_a_prefill_chunk_share_a_step() -> None:
    sched, runner = make_scheduler(budget=8), FakeRunner()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", list(range(20))))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["a"]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    sched, runner = make_scheduler(budget=8, chunked=False), FakeRunner()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", list(range(8))))
    sched.add_request(make_request("c", [5]))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1}  # b needs 8 > 7 and blocks c behind it (fcfs)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"b": 8} and out.finished_req_ids == {"a"}
    with pytest.raises(ValueError, match="chunked prefill"):
        sched.add_request(make_request("d", list(range(9))))


def test_without_chunked_prefill_a_recompute_longer_than_a_step_is_chunked() -> None:
    sched = make_scheduler(num_blocks=4, budget=8, chunked=False, prefix_caching=False, max_model_len=16)
    runner = FakeRunner()
    a = make_request("a", list(range(3)), max_tokens=9)
    b = make_request("b", list(range(10, 15)), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    outs = run_all(sched, runner)
    assert a.num_preemptions == 0 and b.num_preemptions == 1  # b preempted itself at its 9th token
    b_steps = [o.num_scheduled_tokens["b"] for o in outs if "b" in o.num_scheduled_tokens]
    assert b_steps == [5, 1, 1, 1, 8, 1, 1]  # its 9-token recompute exceeds a step: 8, then 1
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 6)
    assert a.output_token_ids == reference_outputs(a.prompt_token_ids, 9) and all_blocks_free(sched)


def test_max_num_seqs_limits_running_requests() -> None:
    sched, runner = make_scheduler(max_num_seqs=2), FakeRunner()
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [i + 1], max_tokens=2))
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"} and sched.make_stats().num_running == 2 and sched.make_stats().num_waiting == 1
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}  # both finish (max_tokens 2)
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"r2"} and out.finished_req_ids == {"r0", "r1"}


def test_add_request_rejects_what_can_never_run() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError):
        sched.add_request(make_request("long", list(range(17))))
    with pytest.raises(ValueError):
        sched.add_request(make_request("empty", []))
    sched.add_request(make_request("ok", [1]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", [2]))


# ---- preemption --------------------------------------------------------------------------------


def test_preemption_by_recompute_when_the_pool_is_tiny() -> None:
    sched, runner = make_scheduler(num_blocks=4, max_model_len=16), FakeRunner()
    a = make_request("a", list(range(6)), max_tokens=8)
    b = make_request("b", list(range(10, 16)), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 6, "b": 6} and sched.kv.num_free_blocks == 0
    for _ in range(2):  # tokens 7 and 8 still fit the second blocks
        out, _ = step(sched, runner)
        assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    out, _ = step(sched, runner)  # a's 9th token needs a third block: b, the newest, is preempted
    assert out.num_scheduled_tokens == {"a": 1} and out.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1 and sched.kv.get_block_ids("b") == []
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 3)
    outs = run_all(sched, runner)
    resumed = [n for o in outs for n in o.scheduled_new_reqs if n.req_id == "b"]
    assert len(resumed) == 1 and resumed[0].output_token_ids == reference_outputs(b.prompt_token_ids, 3)
    for r in (a, b):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 8)
    assert all_blocks_free(sched)


def test_the_request_needing_a_block_preempts_itself_when_it_is_the_newest() -> None:
    sched, runner = make_scheduler(num_blocks=4, max_model_len=16), FakeRunner()
    a = make_request("a", list(range(7)))  # its next token still fits its second block
    b = make_request("b", list(range(10, 18)))  # its next token needs a third block
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1} and out.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and a.status == RequestStatus.RUNNING
    run_all(sched, runner)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 8)
    assert all_blocks_free(sched)


def test_priority_policy_orders_admission_and_picks_the_lowest_priority_victim() -> None:
    sched, runner = make_scheduler(max_num_seqs=1, policy="priority"), FakeRunner()
    sched.add_request(make_request("low", [1], priority=5, arrival=0.0, max_tokens=1))
    sched.add_request(make_request("high", [2], priority=0, arrival=1.0, max_tokens=1))
    sched.add_request(make_request("high2", [3], priority=0, arrival=2.0, max_tokens=1))
    order = [next(iter(o.num_scheduled_tokens)) for o in run_all(sched, runner)]
    assert order == ["high", "high2", "low"]

    sched, runner = make_scheduler(num_blocks=4, policy="priority", max_model_len=16), FakeRunner()
    low = make_request("low", list(range(5)), priority=5, arrival=0.0)
    sched.add_request(low)
    step(sched, runner)
    high = make_request("high", list(range(10, 18)), priority=0, arrival=1.0)
    sched.add_request(high)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"low": 1, "high": 8}
    # high needs a third block; low was scheduled first this step but is the victim: undone
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"high": 1} and out.finished_req_ids == {"low"}
    assert low.status == RequestStatus.PREEMPTED and [c.req_id for c in out.scheduled_cached_reqs] == ["high"]
    run_all(sched, runner)
    for r in (low, high):
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, 8)
    assert all_blocks_free(sched)


def test_fcfs_would_have_preempted_the_newer_high_priority_request() -> None:
    sched, runner = make_scheduler(num_blocks=4, policy="fcfs", max_model_len=16), FakeRunner()
    sched.add_request(make_request("low", list(range(5)), priority=5))
    step(sched, runner)
    sched.add_request(make_request("high", list(range(10, 18)), priority=0))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"low": 1} and out.finished_req_ids == {"high"}


# ---- aborts and stops --------------------------------------------------------------------------


def test_abort_frees_blocks_whether_waiting_running_or_mid_prefill() -> None:
    sched, runner = make_scheduler(budget=8, max_num_seqs=2), FakeRunner()
    sched.add_request(make_request("dec", [1, 2], max_tokens=20))
    sched.add_request(make_request("pre", list(range(30))))
    sched.add_request(make_request("wait", [3]))
    step(sched, runner)
    step(sched, runner)
    assert sched.kv.get_block_ids("pre") and sched.kv.get_block_ids("dec")
    assert sched.get_request("pre").num_computed_tokens < 30  # type: ignore[union-attr]
    sched.finish_requests(["pre", "wait", "nope"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.get_block_ids("pre") == [] and sched.make_stats().num_waiting == 0
    sched.check_integrity()
    out = sched.schedule()
    assert out.finished_req_ids == {"pre", "wait"} and out.num_scheduled_tokens == {"dec": 1}
    # aborted between schedule() and update_from_output(): its result is dropped
    sched.finish_requests("dec", RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("dec", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    assert sched.update_from_output(out, runner.execute(out)) == []
    assert not sched.has_unfinished_requests() and all_blocks_free(sched)
    assert sched.schedule().finished_req_ids == {"dec"}
    sched.check_integrity()


def scripted_step(sched: Scheduler, tokens: dict[str, int]) -> list[Request]:
    out = sched.schedule()
    sampled = {r: [tokens[r]] for r in out.num_scheduled_tokens}
    return sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))


def test_stop_conditions() -> None:
    sched = make_scheduler(max_model_len=8)
    eos = make_request("eos", [1], eos=0, min_tokens=2)
    ign = make_request("ign", [1], eos=0, ignore_eos=True, max_tokens=2)
    stop = make_request("stop", [1], stop_token_ids=[5])
    length = make_request("len", [1], max_tokens=2)
    ctx = make_request("ctx", list(range(6)), max_tokens=50)
    for r in (eos, ign, stop, length, ctx):
        sched.add_request(r)
    touched = scripted_step(sched, {"eos": 0, "ign": 0, "stop": 4, "len": 4, "ctx": 9})
    assert touched == [eos, ign, stop, length, ctx] and not any(r.is_finished for r in touched)
    touched = scripted_step(sched, {"eos": 0, "ign": 0, "stop": 5, "len": 4, "ctx": 9})
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert eos.output_token_ids == [0, 0]  # the first eos came before min_tokens
    assert ign.status == RequestStatus.FINISHED_LENGTH and ign.output_token_ids == [0, 0]
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.stop_reason == 5
    assert length.status == RequestStatus.FINISHED_LENGTH
    assert ctx.status == RequestStatus.FINISHED_LENGTH and ctx.num_tokens == 8  # max_model_len
    assert not sched.has_unfinished_requests() and all_blocks_free(sched)
    assert sched.schedule().finished_req_ids == {"eos", "ign", "stop", "len", "ctx"}


def test_stop_string_finish_from_the_engine() -> None:
    sched, runner = make_scheduler(), FakeRunner()
    r = make_request("r", [1, 2, 3], max_tokens=20)
    sched.add_request(r)
    step(sched, runner)
    step(sched, runner)
    sched.finish_requests(["r"], RequestStatus.FINISHED_STOPPED)
    assert r.status == RequestStatus.FINISHED_STOPPED and all_blocks_free(sched)
    assert sched.schedule().finished_req_ids == {"r"}


# ---- n > 1: forks --------------------------------------------------------------------------------


def test_children_fork_from_the_parent_after_its_prompt() -> None:
    sched, runner = make_scheduler(budget=8, prefix_caching=False), FakeRunner()
    prompt = list(range(10))
    parent = make_request("p", prompt, max_tokens=4)
    kids = [make_request(f"p#{k}", prompt, max_tokens=4, parent_id="p") for k in (1, 2)]
    for r in [parent, *kids]:
        sched.add_request(r)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"p": 8}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"p": 2}  # budget left, but the prompt is not done yet
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"p": 1, "p#1": 2, "p#2": 2}
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert new["p#1"].num_computed_tokens == 8 and new["p#1"].block_ids[:2] == [0, 1]
    assert new["p#2"].block_ids[:2] == [0, 1] and new["p#1"].block_ids[2] != new["p#2"].block_ids[2]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    assert all(k.num_cached_tokens == 8 for k in kids)
    run_all(sched, runner)
    for r in [parent, *kids]:
        assert r.output_token_ids == reference_outputs(prompt, 4)  # the fake model is greedy
    assert all_blocks_free(sched)


def test_children_prefill_normally_when_the_parent_is_gone() -> None:
    sched, runner = make_scheduler(budget=8, prefix_caching=False), FakeRunner()
    prompt = list(range(10))
    sched.add_request(make_request("p", prompt))
    kid = make_request("p#1", prompt, parent_id="p")
    sched.add_request(kid)
    step(sched, runner)
    sched.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"p#1": 8} and out.scheduled_new_reqs[0].num_computed_tokens == 0
    run_all(sched, runner)
    assert kid.output_token_ids == reference_outputs(prompt, 8) and all_blocks_free(sched)


def test_prefix_cache_hit_across_requests_and_stats() -> None:
    sched, runner = make_scheduler(), FakeRunner()
    prompt = list(range(10))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_all(sched, runner)
    b = make_request("b", prompt + [3], max_tokens=2)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 3}
    assert b.num_cached_tokens == 8
    stats = sched.make_stats()
    assert stats.prefix_cache_queries == 10 + 11 and stats.prefix_cache_hits == 8
    run_all(sched, runner)
    assert b.output_token_ids == reference_outputs(b.prompt_token_ids, 2)


def test_scheduler_modules_do_not_import_torch() -> None:
    core = pathlib.Path(__file__).resolve().parents[1] / "core"
    files = [*(core / "kv_cache").glob("*.py"), *(core / "sched").glob("*.py")]
    for path in files:
        tree = ast.parse(path.read_text())
        top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]  # not TYPE_CHECKING
        names = [a.name for n in top_level if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.split(".")[0] == "torch" or m == "portside.config"], path


# ---- randomized --------------------------------------------------------------------------------

request_specs = st.lists(
    st.tuples(
        st.integers(0, 3),  # shared prefix blocks
        st.lists(st.integers(0, VOCAB - 1), max_size=9),  # own tail
        st.integers(1, 12),  # max_tokens
        st.integers(0, 3),  # priority
        st.integers(1, 3),  # n (samples)
    ),
    min_size=1,
    max_size=10,
)
actions = st.lists(st.tuples(st.sampled_from(["step", "step", "step", "add", "abort"]), st.integers(0, 100)), max_size=60)


def blocks_per_request(max_model_len: int, budget: int, window: int | None) -> int:
    """What the engine sizes the pool by (llm_engine._blocks_per_request)."""
    whole = -(-max_model_len // BS)
    if window is None:
        return whole
    return min(whole, -(-(window - 1 + min(budget, max_model_len)) // BS) + 1)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=request_specs,
    script=actions,
    num_blocks=st.integers(2, 8),
    budget=st.integers(1, 12),
    max_num_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority"]),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    window=st.sampled_from([None, None, 1, 3, 4, 6]),
    long=st.booleans(),
)
def test_random_traffic_keeps_invariants_and_outputs(
    specs, script, num_blocks, budget, max_num_seqs, policy, chunked, prefix_caching, window, long
) -> None:
    # with a window, "long" requests (up to 33 tokens) run in a pool sized by the window alone
    long = long and window is not None
    max_model_len = 40 if long else 16
    if not chunked:  # every prompt fits a step; a recompute of prompt + outputs may not
        budget = max(budget, max_model_len - 1)
    # any one request fits the pool alone: its whole length, or with a window what it holds
    # at once (the pool may then be smaller than one request's length)
    needed = blocks_per_request(max_model_len, budget, window)
    num_blocks = needed + num_blocks % 3 if long else max(num_blocks, needed)
    event(f"window {window}, pool below max_model_len: {num_blocks * BS < max_model_len}")
    sched = make_scheduler(num_blocks, budget, max_num_seqs, policy, chunked, prefix_caching, max_model_len, window)
    runner = FakeRunner(window=window)
    pending = list(specs)
    made: list[Request] = []

    def add() -> None:
        prefix, tail, max_tokens, priority, n = pending.pop(0)
        prompt = ([5] * (prefix * BS) + tail)[: max_model_len - 1] or [1]
        i = len(made)
        for k in range(n):
            r = make_request(
                f"r{i}#{k}", prompt, max_tokens=max_tokens, eos=0 if priority % 2 else None, priority=priority,
                arrival=float(i), parent_id=f"r{i}#0" if k else None,
            )
            sched.add_request(r)
            made.append(r)

    for action, x in script:
        if action == "add" and pending:
            add()
        elif action == "abort" and made:
            sched.finish_requests(made[x % len(made)].request_id, RequestStatus.FINISHED_ABORTED)
            sched.check_integrity()
        else:
            step(sched, runner)
    while pending:
        add()
    run_all(sched, runner)

    assert all_blocks_free(sched) and sched.make_stats().num_running == sched.make_stats().num_waiting == 0
    event(f"preemptions: {min(sched.num_preemptions, 3)}+")
    event(f"requests starting from shared blocks: {min(sum(r.num_cached_tokens > 0 for r in made), 2)}+")
    for r in made:
        assert r.is_finished
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.num_output_tokens)
        if r.status == RequestStatus.FINISHED_STOPPED:
            assert r.output_token_ids[-1] == 0
        elif r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens or r.num_tokens == max_model_len
