"""Tensor parallelism over real worker processes and gloo: greedy parity with TP=1 and with
transformers (heads split evenly, and fewer KV heads than ranks), failure handling (a killed or
raising worker gives a clear error within seconds, no process left behind), clean shutdown (no
gloo thread outliving `destroy_process_group`), a launcher-started (torchrun-style) world on
loopback, and `portside serve -tp 2`."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from portside import LLM, SamplingParams
from portside.distributed.env import free_port, launcher_env
from portside.testing.tiny import hf_greedy, make_tiny_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(device="cpu", max_model_len=128, block_size=4, num_kv_blocks=96)

pytestmark = pytest.mark.slow  # every test starts worker processes (CI runs them)


def prompts_for(llm: LLM) -> list[list[int]]:
    base = llm.get_tokenizer().encode("the quick brown fox jumps over the lazy dog while a small cat sleeps " * 3)
    return [base[:5], base[2:15], base[1:18]]  # short, across block boundaries, ragged


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    """Live descendants of `pid`, from /proc."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and alive(c)]
        found += kids
        frontier += kids
    return found


def spawned_workers() -> set[int]:
    """This process's live worker processes (named portside-tp<rank>; not the fork server, not
    the resource tracker)."""
    found = set()
    for pid in children(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().startswith("portside-"):
                    found.add(pid)
        except FileNotFoundError:
            pass
    return found


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


# --------------------------------------------------------------------------------------------
# Parity
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def even_model(tmp_path_factory) -> Path:  # 4 heads / 2 KV heads: both split over 2 ranks
    return make_tiny_model(tmp_path_factory.mktemp("tp_even"), "llama")


@pytest.fixture(scope="module")
def tp2(even_model):
    llm = LLM(model=str(even_model), tensor_parallel_size=2, max_num_batched_tokens=16, **ENGINE)
    pids = llm.engine.executor.pids
    assert len(pids) == 2 and all(alive(p) for p in pids)
    yield llm
    llm.engine.shutdown()
    assert wait_gone(pids) == [], "workers outlived engine.shutdown()"


@pytest.fixture(scope="module")
def tp1(even_model):
    return LLM(model=str(even_model), tensor_parallel_size=1, max_num_batched_tokens=16, **ENGINE)


def test_tp2_greedy_equals_tp1_and_transformers(even_model, tp2, tp1):
    prompts = prompts_for(tp2)
    got = greedy(tp2, prompts)  # batched, chunked prefill (16-token budget), 4-token blocks
    assert got == greedy(tp1, prompts)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(even_model, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
    assert tp2.engine.stats().num_used_blocks == 0


def test_cpu_workers_are_forks_of_one_fork_server_named_by_rank(tp2):
    """On cpu the ranks are forked from multiprocessing's fork server (a child of this process),
    not spawned interpreters, and name themselves by rank for ps and top."""
    from multiprocessing import forkserver

    if os.environ.get("PORTSIDE_WORKER_MULTIPROC_METHOD", "forkserver") != "forkserver":
        pytest.skip("PORTSIDE_WORKER_MULTIPROC_METHOD asks for another start method")
    pids = tp2.engine.executor.pids
    comms, parents = [], set()
    for pid in pids:
        with open(f"/proc/{pid}/comm") as f:
            comms.append(f.read().strip())
        with open(f"/proc/{pid}/stat") as f:
            parents.add(int(f.read().rsplit(")", 1)[1].split()[1]))
    assert comms == ["portside-tp0", "portside-tp1"]
    assert len(parents) == 1 and parents != {os.getpid()}
    with open(f"/proc/{parents.pop()}/cmdline", "rb") as f:
        assert forkserver.__name__.encode() in f.read()  # `python -c 'from multiprocessing.forkserver import main; ...'`


def test_worker_start_method(monkeypatch):
    """Fork server on cpu, spawn on accelerators and when asked. The forks take the engine's
    environment when they start, but once a variable read on import changed since the fork
    server started (its forks would keep the old value), spawn."""
    from portside.backends.cpu.platform import CpuPlatform
    from portside.executor import multiproc as mpe

    class Accelerator(CpuPlatform):
        device_type = "cuda"

    def method(platform: type[CpuPlatform]) -> str:
        return mpe.worker_context(platform).get_start_method()

    monkeypatch.delenv("PORTSIDE_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setattr(mpe, "_forkserver_env", None)
    assert method(Accelerator) == "spawn"
    assert method(CpuPlatform) == "forkserver" and mpe._forkserver_env == dict(os.environ)
    monkeypatch.setenv("MY_APP_SETTING", "1")  # read at run time: the forks are given it
    assert method(CpuPlatform) == "forkserver"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read when torch loads
    assert method(CpuPlatform) == "spawn"
    monkeypatch.setenv("PORTSIDE_WORKER_MULTIPROC_METHOD", "forkserver")
    monkeypatch.setattr(mpe, "_forkserver_env", dict(os.environ))
    assert method(Accelerator) == "forkserver"  # asked for
    monkeypatch.setenv("PORTSIDE_WORKER_MULTIPROC_METHOD", "spawn")
    assert method(CpuPlatform) == "spawn"
    monkeypatch.setenv("PORTSIDE_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(ValueError, match="use forkserver or spawn"):
        method(CpuPlatform)


def test_tp2_random_sampling_matches_tp1_with_seeds(tp2, tp1):
    """Seeded rows draw from their own generators, so TP=2 (rank 0's tokens broadcast to every
    rank) must reproduce TP=1's samples; the unseeded request must simply run consistently."""
    prompts = prompts_for(tp2)
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    run = lambda llm, params: [o.outputs[0].token_ids for o in llm.generate(  # noqa: E731
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert run(tp2, seeded) == run(tp1, seeded)
    unseeded = run(tp2, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(len(t) == MAX_TOKENS for t in unseeded)
    assert greedy(tp2, prompts[:1]) == greedy(tp1, prompts[:1])  # the ranks still agree afterwards


def test_tp2_fewer_kv_heads_than_ranks_then_del_stops_workers(tmp_path):
    path = make_tiny_model(tmp_path / "kv1", "llama", num_key_value_heads=1)  # KV head replicated
    llm = LLM(model=str(path), tensor_parallel_size=2, **ENGINE)
    assert llm.engine.executor.kv_cache_spec.num_kv_heads == 1
    prompts = prompts_for(llm)
    for prompt, tokens in zip(prompts, greedy(llm, prompts), strict=True):
        assert tokens == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
    pids = llm.engine.executor.pids
    del llm  # no shutdown(): dropping the last reference must stop the workers
    gc.collect()
    assert wait_gone(pids) == [], "workers outlived their LLM"


# --------------------------------------------------------------------------------------------
# Failure
# --------------------------------------------------------------------------------------------


def test_killed_worker_fails_fast_with_clear_error(even_model):
    llm = LLM(model=str(even_model), tensor_parallel_size=2, **ENGINE)
    pids = llm.engine.executor.pids
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, prompt in enumerate(prompts_for(llm)):
        llm.engine.add_request(str(i), prompt, params)
    for _ in range(3):  # mid-generation
        llm.engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL") as info:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert time.monotonic() - start < 10, "the engine took too long to notice"
    assert wait_gone(pids) == [], f"workers left running: {info.value}"
    assert not spawned_workers() & set(pids)
    with pytest.raises(RuntimeError, match="rank 1"):  # later calls fail the same way at once
        llm.engine.step()
    llm.engine.shutdown()  # idempotent after a failure


def test_raising_worker_names_rank_and_cause(tmp_path):
    path = make_tiny_model(tmp_path / "odd", "llama", intermediate_size=130 + 1)  # MLP cannot split in 2
    before = spawned_workers()  # other tests' engines may still be running
    with pytest.raises(RuntimeError, match=r"rank [01] raised ValueError: output features \(131\) is not divisible"):
        LLM(model=str(path), tensor_parallel_size=2, **ENGINE)
    assert wait_gone(list(spawned_workers() - before), timeout=5) == []


# --------------------------------------------------------------------------------------------
# Launcher environment (torchrun-style), on loopback
# --------------------------------------------------------------------------------------------


def test_launcher_env_parsing():
    assert launcher_env({}) is None
    env = launcher_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"})
    assert env is not None and (env.rank, env.world_size, env.local_rank) == (1, 2, 1)
    assert env.init_method == "tcp://10.0.0.5:1234"
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        launcher_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="outside WORLD_SIZE"):
        launcher_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "x"})


# Prepended to the subprocess scripts below: gloo's threads in this process, by name.
GLOO_THREADS = """
import os
def gloo_threads():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except FileNotFoundError:  # the thread ended between the listing and the read
            pass
    return sorted(n for n in names if n.startswith(("gloo", "pt_gloo")))
"""

DESTROY = GLOO_THREADS + """
import os, sys
from portside.distributed.env import destroy_process_group, free_port, init_process_group
from portside.model.registry import read_model_args
from portside.platform import resolve_platform
init_process_group(resolve_platform("cpu"), 0, 1, f"tcp://127.0.0.1:{free_port()}")
read_model_args(sys.argv[1])  # as every rank does while loading its shard
import torch.distributed.nn  # what that imports under transformers 5; explicit for other versions
print("BEFORE", gloo_threads())
destroy_process_group()
print("AFTER", gloo_threads())
"""


def test_destroy_process_group_stops_gloo_threads(even_model):
    """After `destroy_process_group` no gloo thread is left running into interpreter exit, even
    though reading a model config imported torch.distributed.nn (whose defaults would capture the
    live group): a launched worker whose group outlived it aborted at exit in CI ("terminate
    called without an active exception", exit -6)."""
    out = subprocess.run([sys.executable, "-c", DESTROY, str(even_model)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("BEFORE", "AFTER")))
    assert lines["BEFORE"] != "[]", "no gloo threads while the group was up: the check would prove nothing"
    assert lines["AFTER"] == "[]", f"gloo threads still running after destroy_process_group: {lines['AFTER']}"


COMPILED = GLOO_THREADS + """
import gc, os, sys, torch
from portside.distributed.env import destroy_process_group, init_process_group, launcher_env
from portside.platform import resolve_platform
env = launcher_env()
platform = resolve_platform("cpu")
init_process_group(platform, env.rank, env.world_size, env.init_method)
comm = platform.communicator()
def step(x):  # what a compiled model does under tensor parallelism
    y = comm.all_reduce(x * 2.0)
    z = comm.broadcast(y + env.rank, src=1)
    return comm.all_gather(z, dim=0)
compiled = torch.compile(step, backend=sys.argv[1], fullgraph=True)
out = compiled(torch.full((3,), float(env.rank + 1)))
assert out.tolist() == [7.0] * 6, out.tolist()  # 2 * (1 + 2) + rank 1, gathered from both ranks
print("BEFORE", gloo_threads())
destroy_process_group()
gc.collect()
print("AFTER", gloo_threads())  # `compiled` is still alive: it must not hold the group
"""


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_collectives_release_the_group(backend):
    """Collectives traced by torch.compile (the inductor graph runner under tensor parallelism)
    compute the right values and leave no gloo thread after `destroy_process_group`: a graph that
    took the ProcessGroup as an input would keep it alive into interpreter exit."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen([sys.executable, "-c", COMPILED, backend], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, results, strict=True):
        assert p.returncode == 0, stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in stdout.splitlines() if line.startswith(("BEFORE", "AFTER")))
        assert lines["BEFORE"] != "[]", "no gloo threads while the group was up: the check would prove nothing"
        assert lines["AFTER"] == "[]", f"gloo threads still running after destroy_process_group: {lines['AFTER']}"


RANK0 = """
import json, sys
from portside import LLM, SamplingParams
llm = LLM(model=sys.argv[1], device="cpu", tensor_parallel_size=2, max_model_len=128, block_size=4, num_kv_blocks=96,
          platform_options={"cpu_graph": sys.argv[4]})
prompts = json.loads(sys.argv[2])
greedy = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
for name, batch in (("TOKENS", prompts), ("ALONE", prompts[1:2])):  # batched; then batch-1 decode steps
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
    print(name, json.dumps([o.outputs[0].token_ids for o in outs]))
llm.engine.shutdown()
"""


# `python -m portside.distributed.worker`, reporting the gloo threads still running at exit.
LAUNCHED_WORKER = GLOO_THREADS + """
import atexit, runpy, sys
atexit.register(lambda: print("EXIT", gloo_threads(), flush=True))
sys.argv = ["portside.distributed.worker", "--device", "cpu"]
runpy.run_module("portside.distributed.worker", run_name="__main__")
"""


@pytest.mark.parametrize("graph", ["eager", "inductor"])
def test_launcher_world_on_loopback(even_model, tp1, graph):
    """Two processes given MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK, as torchrun does:
    rank 0 runs the engine, rank 1 `python -m portside.distributed.worker`. Rank 1 exits cleanly
    with no gloo thread left, also when its compiled graphs ran the collectives (inductor).

    Greedy tokens equal TP=1's and transformers', batched (inductor: the graph with a symbolic
    token count) and alone (the one-token graph): with `--cpu-graph inductor` each rank's compiled
    graphs trace the row-parallel all-reduces as the opaque `portside::all_reduce`. This is the
    suite's one inductor engine under tensor parallelism (two fresh processes compiling: ~2
    minutes on the 2-core CI machine); the worker code a rank runs is the same whether it was
    spawned (`MultiprocExecutor`, tested eagerly above) or launched."""
    prompts = prompts_for(tp1)
    port = free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    worker = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", LAUNCHED_WORKER],
        env={**base, "RANK": "1", "LOCAL_RANK": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        engine = subprocess.run(
            [sys.executable, "-c", RANK0, str(even_model), json.dumps(prompts), str(MAX_TOKENS), graph],
            env={**base, "RANK": "0", "LOCAL_RANK": "0"}, capture_output=True, text=True, timeout=300,
        )
        assert engine.returncode == 0, engine.stderr[-3000:]
        assert worker.wait(timeout=30) == 0, worker.stdout.read()[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert "EXIT []" in worker.stdout.read().splitlines(), "gloo threads left running at the worker's exit"
    printed = dict(x.split(" ", 1) for x in engine.stdout.splitlines() if x.startswith(("TOKENS ", "ALONE ")))
    expected = [hf_greedy(even_model, p, MAX_TOKENS) for p in prompts]
    assert json.loads(printed["TOKENS"]) == greedy(tp1, prompts) == expected
    assert json.loads(printed["ALONE"]) == expected[1:2]


# --------------------------------------------------------------------------------------------
# portside serve -tp 2
# --------------------------------------------------------------------------------------------


def test_serve_tensor_parallel_chat_completion(even_model):
    pytest.importorskip("fastapi")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "portside.cli", "serve", str(even_model), "--device", "cpu",
         "--tensor-parallel-size", "2", "--port", str(port), "--max-model-len", "128", "--num-kv-blocks", "96",
         "--shutdown-timeout", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.5)
        workers = children(server.pid)
        assert len(workers) >= 2
        body = json.dumps({"model": str(even_model), "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "the quick brown fox"}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.load(r)
        assert reply["object"] == "chat.completion"
        assert reply["usage"]["completion_tokens"] > 0
        assert isinstance(reply["choices"][0]["message"]["content"], str)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert server.returncode == 0, server.stdout.read()[-3000:]
    assert wait_gone(workers) == [], "serve left tensor-parallel workers behind"
