"""The Ray executor (`--distributed-executor-backend ray`), on a real one-node Ray cluster:
greedy tokens equal transformers' through `LLM` and through `portside serve -tp 2`; a killed
worker actor fails the next step within seconds naming its rank, pid and node, the server's
/health turns unhealthy, and no process is left; bad values and a missing Ray are clear errors.

Ray's servers listen on every interface whatever address they are given, so each end-to-end case
runs in a network namespace with only loopback up (`unshare --net`, as root): nothing can reach
or be reached from another host. The case bodies are in `ray_netns.py`; every process a case
starts lives in its namespace, so after the case the test looks for any process still in it
(and kills those: a leak fails the test, never lingers)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from portside.cli import main
from portside.distributed.ray_cluster import RAY_MISSING, bundle_resource, forwarded_env
from portside.engine.args import EngineArgs
from portside.testing.tiny import hf_greedy

SCRIPT = Path(__file__).with_name("ray_netns.py")
CASE_TIMEOUT_S = 420  # a case's bound, Ray's start included (~30 s on 2 cores)


def _netns_unavailable() -> str | None:
    """Why the cases cannot run in a loopback-only network namespace here (None: they can)."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (pip install 'portside[ray]')"
    try:
        probe = subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up"], capture_output=True, text=True,
                               timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run unshare: {e}"
    if probe.returncode != 0:
        return f"no network namespace with loopback (unshare --net needs root or user namespaces): {probe.stderr.strip()}"
    return None


needs_netns = pytest.mark.skipif(bool(reason := _netns_unavailable()), reason=reason or "")


def _in_netns(netns: str) -> list[int]:
    """The processes whose network namespace is `netns` ("net:[inode]")."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == netns:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def run_case(case: str, model: Path, tmp_path: Path, **env: str) -> dict[str, Any]:
    """Run `ray_netns.py CASE MODEL` in a fresh loopback-only network namespace, bounded in time;
    fail if any process it started outlives it."""
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # never a cluster from outside
    # Ray's files (sessions, sockets, the record `ray start` leaves) in a short private directory
    # (socket paths are limited to ~107 bytes): no cluster started elsewhere on this machine is seen
    ray_tmp = tempfile.mkdtemp(prefix="psray", dir="/tmp")
    environ.update(PYTHONUNBUFFERED="1", RAY_TEST_LOG=str(tmp_path / "server.log"), RAY_TMPDIR=ray_tmp, **env)
    cmd = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, str(SCRIPT), case,
           str(model)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[timed out after {CASE_TIMEOUT_S} s]"
    netns = re.search(r"^NETNS (net:\[\d+\])$", output, re.M)
    assert netns, output[-5000:]
    deadline = time.monotonic() + 15
    while (left := _in_netns(netns.group(1))) and time.monotonic() < deadline:
        time.sleep(0.2)
    left_commands = []
    for pid in left:  # the test's own processes (its namespace): stop them, then fail
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                left_commands.append(f.read().replace(b"\0", b" ").decode(errors="replace")[:200])
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"processes outlived the case: {left_commands}\n{output[-3000:]}"
    result = re.search(r"^RESULT (.*)$", output, re.M)
    assert proc.returncode == 0 and result, output[-8000:]
    return json.loads(result.group(1))


# --------------------------------------------------------------------------------------------
# End to end, on Ray
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_netns
def test_llm_on_ray_equals_transformers_and_a_killed_actor_fails_fast(tiny_llama: Path, tmp_path: Path) -> None:
    """`LLM(..., distributed_executor_backend="ray")` with no cluster given starts a one-node Ray; a
    rank that raises while loading is named with its cause and traceback; TP 2 gives transformers' greedy tokens (batched, chunked, across blocks); killing rank 1's
    actor fails the step naming it within seconds and kills the other actor; shutdown stops the
    Ray the executor started."""
    r = run_case("engine", tiny_llama, tmp_path)
    assert re.match(r"Ray worker failed: rank [01] \(pid \d+ on node 127\.0\.0\.1, node id [0-9a-f]+\) raised ValueError: "
                    r"output features \(131\) is not divisible", r["raised"] or ""), r["raised"]  # fmt: skip
    assert "--- rank" in r["raised"] and "traceback ---" in r["raised"]
    assert not r["ray_up_after_raise"]
    assert r["executor"] == "RayExecutor" and r["nodes"] == ["127.0.0.1"] * 2
    for prompt, tokens in zip(r["prompts"], r["tokens"], strict=True):
        assert tokens == hf_greedy(tiny_llama, prompt, 12), f"prompt of {len(prompt)} tokens"
    assert r["used_blocks"] == 0
    pid1 = r["pids"][1]
    assert re.match(rf"Ray worker failed: rank 1 \(pid {pid1} on node 127\.0\.0\.1, node id [0-9a-f]+\) died: ",
                    r["error"] or ""), r["error"]  # fmt: skip
    assert r["fail_s"] < 10, r
    assert r["left_after_failure"] == []
    assert (r["later_error"] or "").startswith("Ray worker failed: rank 1 ")  # later calls: the same error, at once
    assert not r["ray_up_after_shutdown"]
    assert r["left_after_shutdown"] == []  # Ray's own processes too
    print(f"ray engine: start {r['start_s']:.1f} s, generate {r['generate_s']:.2f} s, failure noticed in {r['fail_s']:.2f} s")


@pytest.mark.slow
@needs_netns
def test_pipeline_parallel_on_ray_equals_transformers(tiny_llama: Path, tmp_path: Path) -> None:
    """PP 2 on Ray actors, with two steps in flight and with one, gives transformers' greedy tokens;
    both engines run on the Ray their process started, and leave it running."""
    r = run_case("pipeline", tiny_llama, tmp_path)
    assert (r["in_flight_2"], r["in_flight_1"]) == (2, 1)
    assert r["ray_up_after_2"] and r["ray_up_after_1"], r
    for micro in ("2", "1"):
        for prompt, tokens in zip(r["prompts"], r["tokens"][micro], strict=True):
            assert tokens == hf_greedy(tiny_llama, prompt, 12), f"micro-batches {micro}, prompt of {len(prompt)} tokens"
    assert r["left_after_shutdown"] == []


@pytest.mark.slow
@needs_netns
def test_kv_host_tier_on_ray_merges_every_actors_loads(tiny_llama: Path, tmp_path: Path) -> None:
    """TP 2 on Ray actors with the KV host tier: replayed prompts load 10 of their 11 blocks back
    on both ranks, greedy tokens equal transformers' and the first round's."""
    r = run_case("kv_tiers", tiny_llama, tmp_path)
    n = len(r["prompts"])
    assert r["tokens"][n:] == r["tokens"][:n]
    for prompt, tokens in zip(r["prompts"], r["tokens"][:n], strict=True):
        assert tokens == hf_greedy(tiny_llama, prompt, 6)
    assert r["cached"][n:] == [40] * n and r["host_hit_blocks"] == 10 * n and r["partial"] == 0
    assert r["left_after_shutdown"] == []


@pytest.mark.slow
@needs_netns
def test_ranks_on_two_nodes_and_a_lost_node(tiny_llama: Path, tmp_path: Path) -> None:
    """Two Ray nodes of one CPU each (two raylets on loopback, `ray.cluster_utils.Cluster`): the
    ranks land on both and still give transformers' tokens; removing one node (its raylet and
    actor killed at once) fails the step within seconds naming the rank on it and its node."""
    r = run_case("nodes", tiny_llama, tmp_path)
    assert len(set(r["node_ids"])) == 2 and r["worker_node"] in r["node_ids"], r
    for prompt, tokens in zip(r["prompts"], r["tokens"], strict=True):
        assert tokens == hf_greedy(tiny_llama, prompt, 12), f"prompt of {len(prompt)} tokens"
    lost, node = r["lost_rank"], r["worker_node"][:12]
    assert re.search(rf"rank {lost} \(pid \d+ on node 127\.0\.0\.1, node id {node}\) (died|gave no reply)",
                     r["error"] or ""), r["error"]  # fmt: skip
    assert r["error"].startswith("Ray worker failed: ") and r["fail_s"] < 10, r
    assert r["left_after_failure"] == [] and r["placement_groups"] == ["REMOVED"], r
    print(f"ray nodes: lost node noticed in {r['fail_s']:.2f} s")


@pytest.mark.slow
@needs_netns
def test_serve_on_a_ray_cluster_then_a_killed_actor_makes_it_unhealthy(tiny_llama: Path, tmp_path: Path) -> None:
    """As the docs run it: `ray start --head`, then `portside serve -tp 2 --distributed-executor-backend
    ray` on the head joins that cluster (no RAY_ADDRESS). More ranks than its CPUs exit 2; -tp 2
    answers with transformers' greedy tokens; after one actor is killed while idle /health says
    503 within seconds and the next request fails, the log names the rank and its pid, SIGTERM exits 0, the
    actors are gone and the cluster still runs until the test stops its head."""
    from transformers import AutoTokenizer

    # the interface variable exercises the environment the actors get from the engine
    r = run_case("serve", tiny_llama, tmp_path, GLOO_SOCKET_IFNAME="lo")
    log = r.pop("log")
    # 2 CPUs is the head's (`ray start --num-cpus 2`): the server joined it rather than start its own Ray
    assert r["too_big_exit"] == 2 and "the Ray cluster has 2 CPU but 4 ranks" in log, log
    status, body = r["completion"]
    assert status == 200, body
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    want = tok.decode(hf_greedy(tiny_llama, r["prompt"], 16), skip_special_tokens=True)
    text = body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 16 and want.startswith(text.rstrip("\ufffd")), (text, want)
    assert len(r["actors"]) == 2, r
    assert r["health"][-1] == 503 and r["health_s"] < 10, r  # noticed while idle
    assert r["after_kill"][0] != 200 and r["after_kill_s"] < 10, r
    assert re.search(rf"Ray worker failed: rank [01] \(pid {r['killed']} on node 127\.0\.0\.1, node id [0-9a-f]+\) died",
                     log), log  # fmt: skip
    assert r["exit"] == 0, log
    assert r["actors_left"] == [] and r["head_alive_after_server"], r
    assert r["left"] == [], log
    print(f"ray serve: start {r['start_s']:.1f} s, /health 503 {r['health_s']:.2f} s after the kill")


# --------------------------------------------------------------------------------------------
# Configuration (no Ray started)
# --------------------------------------------------------------------------------------------


def test_bad_backend_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", "--distributed-executor-backend", "foo"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'foo'" in capsys.readouterr().err


def test_missing_ray_is_a_clear_error(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray looks like to find_spec
    with pytest.raises(ValueError, match=re.escape("pip install 'portside[ray]'")):
        EngineArgs(model=str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray")._resolve_parallel()
    code = main(["serve", str(tiny_llama), "--device", "cpu", "-tp", "2", "--distributed-executor-backend", "ray"])
    assert code == 2 and RAY_MISSING in capsys.readouterr().err


def test_ray_address_makes_ray_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # read, never contacted
    assert EngineArgs(model="m", tensor_parallel_size=2)._resolve_parallel().distributed_executor_backend == "ray"
    monkeypatch.delenv("RAY_ADDRESS")
    assert EngineArgs(model="m", tensor_parallel_size=2)._resolve_parallel().distributed_executor_backend == "mp"


def test_actor_environment_and_bundles() -> None:
    env = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "ib0", "PORTSIDE_DIST_TIMEOUT": "60",
           "OMP_NUM_THREADS": "4", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0"}  # fmt: skip
    assert forwarded_env(env) == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "ib0",
                                  "PORTSIDE_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "4"}  # fmt: skip

    from portside.backends.cpu.platform import CpuPlatform
    from portside.backends.cuda.platform import CudaPlatform
    from portside.backends.xla.platform import XlaPlatform

    assert [bundle_resource(p) for p in (CpuPlatform, CudaPlatform, XlaPlatform)] == ["CPU", "GPU", "TPU"]

    class Npu(CudaPlatform):  # a plugin's own resource, declared; one that declares none reserves a GPU
        ray_resource = "NPU"

    assert (bundle_resource(Npu), bundle_resource(CudaPlatform)) == ("NPU", "GPU")
