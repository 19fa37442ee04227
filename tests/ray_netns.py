"""The bodies of the Ray executor's tests, run by `test_ray_executor.py` as ``python ray_netns.py
CASE MODEL_DIR`` inside a network namespace with only loopback up (Ray's servers listen on every
interface). Each case prints one ``RESULT {json}`` line for the test to check, after a
``NETNS net:[...]`` line naming the namespace (the test then finds any process left in it).
Not collected by pytest (no ``test_`` prefix)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MAX_TOKENS = 12
ENGINE = dict(device="cpu", max_model_len=128, block_size=4, num_kv_blocks=96)


def prompts_for(tokenizer: Any) -> list[list[int]]:
    base = tokenizer.encode("the quick brown fox jumps over the lazy dog while a small cat sleeps " * 3)
    return [base[:5], base[2:15], base[1:18]]  # short, across 4-token block boundaries, ragged


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def descendants(pid: int) -> list[int]:
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
        kids = [c for c, pp in parent.items() if pp == p and pid_alive(c)]
        found += kids
        frontier += kids
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


# --------------------------------------------------------------------------------------------
# LLM(..., distributed_executor_backend="ray"): the executor starts (and stops) a one-node Ray
# --------------------------------------------------------------------------------------------


def steps_until_failure(llm: Any) -> tuple[str | None, float]:
    """(the error that ended stepping, or None when the requests finished; seconds it took)."""
    t0 = time.monotonic()
    try:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def case_engine(model: Path) -> dict[str, Any]:
    import ray

    from portside import LLM, SamplingParams

    out: dict[str, Any] = {}
    from portside.testing.tiny import make_tiny_model

    odd = make_tiny_model(model.parent / "odd_mlp", "llama", intermediate_size=131)  # cannot split in 2
    try:  # a rank that raises while loading: a clear error, every actor stopped, Ray stopped
        LLM(model=str(odd), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = str(e)
    out["ray_up_after_raise"] = ray.is_initialized()
    t0 = time.monotonic()
    llm = LLM(model=str(model), tensor_parallel_size=2, distributed_executor_backend="ray",
              max_num_batched_tokens=16, **ENGINE)  # fmt: skip
    out["start_s"] = time.monotonic() - t0
    executor = llm.engine.executor
    out["executor"] = type(executor).__name__
    out["pids"] = pids = [p.pid for p in executor.places]
    out["nodes"] = [p.ip for p in executor.places]
    prompts = prompts_for(llm.get_tokenizer())
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    out["generate_s"] = time.monotonic() - t0
    out["prompts"] = prompts
    out["tokens"] = [o.outputs[0].token_ids for o in outs]
    out["used_blocks"] = llm.engine.stats().num_used_blocks

    # Kill rank 1's actor mid-generation: the next steps fail fast, naming it.
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(str(i), prompt, params)
    for _ in range(3):
        llm.engine.step()
    os.kill(pids[1], signal.SIGKILL)
    out["error"], out["fail_s"] = steps_until_failure(llm)
    out["left_after_failure"] = wait_gone(pids)
    try:  # any later call fails the same way, at once
        executor.initialize_kv_cache(8)
        out["later_error"] = None
    except RuntimeError as e:
        out["later_error"] = str(e)
    llm.engine.shutdown()  # idempotent after a failure; stops the Ray the executor started
    out["ray_up_after_shutdown"] = ray.is_initialized()
    out["left_after_shutdown"] = wait_gone(descendants(os.getpid()))
    return out


def case_pipeline(model: Path) -> dict[str, Any]:
    """PP 2 on Ray, with micro-batches in flight and without, both engines on a Ray this process
    started itself (as a user who called `ray.init()` first): the executor uses it, leaves it running."""
    import ray

    from portside import LLM, SamplingParams

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    out: dict[str, Any] = {"tokens": {}}
    try:
        for micro in (2, 1):
            llm = LLM(model=str(model), pipeline_parallel_size=2, pipeline_micro_batches=micro,
                      distributed_executor_backend="ray", max_num_batched_tokens=16, **ENGINE)  # fmt: skip
            prompts = prompts_for(llm.get_tokenizer())
            out["prompts"] = prompts
            greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            out["tokens"][micro] = [o.outputs[0].token_ids for o in outs]
            out[f"in_flight_{micro}"] = llm.engine.max_in_flight
            llm.engine.shutdown()
            out[f"ray_up_after_{micro}"] = ray.is_initialized()
    finally:
        ray.shutdown()
    out["left_after_shutdown"] = wait_gone(descendants(os.getpid()))
    return out


def case_kv_tiers(model: Path) -> dict[str, Any]:
    """TP 2 on Ray with the KV host tier, a device cache too small for six 44-token prompts replayed
    twice: each actor's connector report comes back with the step and is merged."""
    from portside import LLM, SamplingParams
    from portside.testing.engine_parity import random_prompts

    prompts = random_prompts(5, [44] * 6)
    llm = LLM(model=str(model), tensor_parallel_size=2, distributed_executor_backend="ray", device="cpu",
              max_model_len=64, block_size=4, num_kv_blocks=24, kv_offload_cpu_bytes=1 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out: dict[str, Any] = {"prompts": prompts, "tokens": [], "cached": []}
    for _ in range(2):
        for p in prompts:
            o = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0]
            out["tokens"].append(list(o.outputs[0].token_ids))
            out["cached"].append(o.num_cached_tokens)
    out["host_hit_blocks"] = llm.engine.stats().kv_transfer["host_hit_blocks"]
    out["partial"] = llm.engine.executor._kv_outputs.num_partial
    llm.engine.shutdown()
    out["left_after_shutdown"] = wait_gone(descendants(os.getpid()))
    return out


# --------------------------------------------------------------------------------------------
# Two Ray nodes (two raylets on loopback, one CPU each): ranks on both; one node lost
# --------------------------------------------------------------------------------------------


def case_nodes(model: Path) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        worker_node = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        return nodes_on(cluster, worker_node, model)
    finally:
        ray.shutdown()
        cluster.shutdown()


def nodes_on(cluster: Any, worker_node: Any, model: Path) -> dict[str, Any]:
    from ray.util import placement_group_table

    from portside import LLM, SamplingParams

    out: dict[str, Any] = {"worker_node": worker_node.node_id}
    llm = LLM(model=str(model), tensor_parallel_size=2, distributed_executor_backend="ray",
              max_num_batched_tokens=16, **ENGINE)  # fmt: skip
    places = llm.engine.executor.places
    out["node_ids"] = [p.node_id for p in places]
    prompts = prompts_for(llm.get_tokenizer())
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out["prompts"] = prompts
    out["tokens"] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                                   use_tqdm=False)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(str(i), prompt, params)
    for _ in range(2):
        llm.engine.step()
    out["lost_rank"] = out["node_ids"].index(worker_node.node_id)
    cluster.remove_node(worker_node, allow_graceful=False)  # its raylet and workers killed at once
    out["error"], out["fail_s"] = steps_until_failure(llm)
    out["left_after_failure"] = wait_gone([p.pid for p in places])
    llm.engine.shutdown()
    out["placement_groups"] = sorted({g["state"] for g in placement_group_table().values()})
    return out


# --------------------------------------------------------------------------------------------
# portside serve -tp 2 --distributed-executor-backend ray (the server starts its own Ray)
# --------------------------------------------------------------------------------------------


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def start_head() -> subprocess.Popen[bytes]:
    """`ray start --head --block` as a user starts a cluster's head (on loopback, 2 CPUs); it
    stops its Ray processes when terminated. Returns once `ray start` has recorded the cluster."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--port", "6379", "--num-cpus", "2",
                             "--node-ip-address", "127.0.0.1", "--include-dashboard", "false", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    record = Path(os.environ["RAY_TMPDIR"]) / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + 120
    while not record.exists():
        if head.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray start --head failed (exit {head.returncode})")
        time.sleep(0.2)
    return head


def serve(model: Path, port: int, log_file: Any, *flags: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "portside.cli", "serve", str(model), "--device", "cpu", "--dtype", "float32",
         "--distributed-executor-backend", "ray", "--port", str(port), "--served-model-name", "tiny",
         "--max-model-len", "128", "--block-size", "4", "--num-kv-blocks", "96", "--shutdown-timeout", "5", *flags],
        stdout=log_file, stderr=subprocess.STDOUT,
    )  # fmt: skip


def case_serve(model: Path) -> dict[str, Any]:
    """On a cluster started as the docs say (`ray start --head`, then `portside serve` on the head,
    no RAY_ADDRESS): too many ranks exit 2; -tp 2 serves; a killed actor; the server's exit leaves
    the cluster running; the case then stops the head it started."""
    head = start_head()
    try:
        out = serve_on(head, model)
    finally:
        if head.poll() is None:
            head.terminate()
        head.wait(timeout=60)
    out["left"] = wait_gone(descendants(os.getpid()))
    return out


def serve_on(head: subprocess.Popen[bytes], model: Path) -> dict[str, Any]:
    from portside.distributed.env import free_port

    out: dict[str, Any] = {}
    port = free_port()
    log = Path(os.environ.get("RAY_TEST_LOG", "/dev/null"))
    with open(log, "w") as log_file:
        too_big = serve(model, port, log_file, "-tp", "4")
        out["too_big_exit"] = too_big.wait(timeout=120)
        log_file.write("\n---- -tp 2 ----\n")
        log_file.flush()
        server = serve(model, port, log_file, "-tp", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server exited with {server.returncode}")
            try:
                if _http(url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t0 > 240:
                raise RuntimeError("server did not become healthy")
            time.sleep(0.5)
        out["start_s"] = time.monotonic() - t0
        actors = [p for p in descendants(head.pid) if cmdline(p).startswith("ray::RayWorker")]  # the head's raylet's
        out["actors"] = actors
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(model))("the quick brown fox jumps over the lazy dog").input_ids
        out["prompt"] = ids
        request = {"model": "tiny", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        out["completion"] = _http(url + "/v1/completions", request)

        os.kill(actors[-1], signal.SIGKILL)  # while the server is idle
        out["killed"] = actors[-1]
        t0 = time.monotonic()
        health: list[Any] = []
        while time.monotonic() - t0 < 20:  # the idle engine's health check notices: /health turns 503
            try:
                health.append(_http(url + "/health", timeout=2)[0])
            except OSError as e:
                health.append(str(e))
            if health[-1] == 503:
                break
            time.sleep(0.2)
        out["health"] = health
        out["health_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        out["after_kill"] = _http(url + "/v1/completions", request, timeout=60)
        out["after_kill_s"] = time.monotonic() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            out["exit"] = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            out["exit"] = "killed after 60 s"
    out["actors_left"] = wait_gone(actors)
    out["head_alive_after_server"] = head.poll() is None  # the server joined the cluster: it leaves it running
    out["log"] = log.read_text()[-8000:] if log.is_file() else ""
    return out


if __name__ == "__main__":
    print("NETNS", os.readlink("/proc/self/ns/net"), flush=True)
    case, model_dir = sys.argv[1], Path(sys.argv[2])
    result = {"engine": case_engine, "pipeline": case_pipeline, "kv_tiers": case_kv_tiers, "nodes": case_nodes,
              "serve": case_serve}[case](model_dir)
    print("RESULT", json.dumps(result), flush=True)
