"""Soak benchmark: does `portside serve` hold its memory flat over many rounds of requests?

Starts the real server (`python -m portside.cli serve MODEL --device cpu`), then runs `--rounds`
rounds of `--requests` concurrent requests of `--max-tokens` new tokens each (ignore_eos; a mix
of /v1/completions and /v1/chat/completions, streamed and not). After each round, once the
server is idle (nothing running or waiting, no KV block in use), it records the server's RSS
(VmRSS of /proc/PID/status) and, with tracemalloc on (the default; `PORTSIDE_TRACEMALLOC=1`, see
`portside.server.debug_memory`), the Python heap traced by tracemalloc and the allocation sites
that grew.

The KV pool is sized for one round (`--kv-blocks`, default: every request at 128 prompt tokens
plus `--max-tokens`, in 16-token blocks, 25% over; `--max-model-len` to match): the pool is anonymous memory mapped lazily,
and the prefix cache's LRU free list hands out never-used blocks before it evicts cached ones, so
RSS climbs by the pool's size over the first rounds that cycle through it (by design, bounded by
`--kv-cache-memory`: 4 GiB on cpu by default), which would hide a leak or fake one. A pool that one
round fills is resident by the end of warm-up. `--kv-blocks 0` keeps the server's default.

Verdict: growth after warm-up = (max RSS of the last 10 rounds - RSS at the end of warm-up) /
RSS at the end of warm-up; PASS under 5%.

    /work/venv/bin/python ci/bench/soak.py                       # tiny random Llama, 40 x 64 x 200
    /work/venv/bin/python ci/bench/soak.py --model default       # the embedded SmolLM2-135M
    /work/venv/bin/python ci/bench/soak.py --env MALLOC_ARENA_MAX=2 --json /tmp/a.json
    /work/venv/bin/python ci/bench/soak.py --report before.json after.json   # side by side, markdown

`--tracemalloc` slows the server down and adds its own bookkeeping to RSS; `--no-tracemalloc`
measures RSS alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
from machine import cpu_name  # ci/bench/machine.py, beside this script

RESULTS = Path(__file__).parent / "results"
PROMPTS = [
    "Write a short story about a harbour town at dawn.",
    "Explain how a paged KV cache works in an inference server.",
    "List three things a ship's carpenter needs and why.",
    "Describe the market of a small fishing town in the morning.",
]
KINDS = ("completion", "completion-stream", "chat", "chat-stream")
LAST = 10  # the verdict takes the max RSS of the last LAST rounds
PROMPT_ALLOWANCE = 128  # tokens a prompt may take, chat template included (the prompts here take < 64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Server:
    """The real `portside serve` in a subprocess, with tracemalloc reports on SIGUSR1."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / "server.log"
        self.report_path = work / "tracemalloc.txt"
        model = [] if args.model == "default" else [args.model]
        kv = []
        if args.kv_blocks:  # and a context that fits the pool: PROMPT_ALLOWANCE + max_tokens
            max_len = 16 * -(-(PROMPT_ALLOWANCE + args.max_tokens) // 16)
            kv = ["--block-size", "16", "--num-kv-blocks", str(args.kv_blocks), "--max-model-len", str(max_len)]
        cmd = [
            sys.executable, "-m", "portside.cli", "serve", *model, "--device", "cpu", "--port", str(self.port),
            "--served-model-name", "soak", "--uvicorn-log-level", "warning", *kv, *args.server_args,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(kv.split("=", 1) for kv in args.env))
        if args.tracemalloc:
            env.update(PORTSIDE_TRACEMALLOC="1", PORTSIDE_TRACEMALLOC_OUT=str(self.report_path))
        self.tracemalloc = args.tracemalloc
        self.command = " ".join(
            [*(kv for kv in args.env), *(["PORTSIDE_TRACEMALLOC=1"] if args.tracemalloc else []), "portside", *cmd[3:]]
        )
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._reports = 0

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_path.read_text()}")

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m: dict[str, float] = {}
            for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
                if line and not line.startswith("#"):
                    key, _, value = line.rpartition(" ")
                    m[key] = float(value)
            keys = ("portside_num_requests_running", "portside_num_requests_waiting", "portside_kv_cache_used_blocks")
            if all(m.get(k) == 0 for k in keys):
                return
            time.sleep(0.2)
        raise RuntimeError("server not idle after the round")

    def heap_report(self, timeout: float = 120.0) -> dict[str, Any] | None:
        """Signal the server for a tracemalloc report and parse it (None without tracemalloc)."""
        if not self.tracemalloc:
            return None
        self.proc.send_signal(signal.SIGUSR1)
        self._reports += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reports = self.report_path.read_text().split("\n\n") if self.report_path.exists() else []
            done = [r for r in reports if r.strip()]
            if len(done) >= self._reports and reports[-1] == "":  # the last one is complete
                return parse_report(done[self._reports - 1])
            time.sleep(0.1)
        raise RuntimeError("no tracemalloc report from the server")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def parse_report(text: str) -> dict[str, Any]:
    """`portside.server.debug_memory`'s report: `current`/`peak` bytes and the growth lines."""
    lines = text.strip().splitlines()
    _, current, _, peak = lines[0].split()
    growth = []
    for line in lines[1:]:
        size_diff, size, count_diff, where = line.split("\t", 3)
        growth.append((int(size_diff), int(size), int(count_diff), where))
    return {"current": int(current), "peak": int(peak), "growth": growth}


async def one_request(client: httpx.AsyncClient, kind: str, prompt: str, max_tokens: int) -> bool:
    body: dict[str, Any] = {"model": "soak", "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True}
    if kind.startswith("chat"):
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    if kind.endswith("stream"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        async with client.stream("POST", path, json=body) as r:
            async for _ in r.aiter_lines():
                pass
            return r.status_code == 200
    r = await client.post(path, json=body)
    return r.status_code == 200


async def run_round(url: str, requests: int, max_tokens: int, offset: int) -> int:
    """One round of `requests` concurrent requests; returns how many failed."""
    limits = httpx.Limits(max_connections=requests + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        jobs = [
            one_request(client, KINDS[(offset + i) % len(KINDS)], PROMPTS[(offset + i) % len(PROMPTS)], max_tokens)
            for i in range(requests)
        ]
        ok = await asyncio.gather(*jobs, return_exceptions=True)
    return sum(1 for x in ok if x is not True)


def verdict(rss: list[float], warmup: int) -> tuple[float, bool]:
    base = rss[warmup - 1]
    growth = (max(rss[-LAST:]) - base) / base
    return growth, growth < 0.05


def soak(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="portside-soak-"))
    model_desc = args.model
    if args.model is None:
        from portside.testing.tiny import make_tiny_model

        args.model = str(make_tiny_model(work / "tiny", "llama"))
        model_desc = "tiny random Llama (portside.testing.tiny, hidden 64, 2 layers)"
    elif args.model == "default":
        model_desc = "default model (SmolLM2-135M-Instruct)"
    server = Server(args, work)
    rounds: list[dict[str, Any]] = []
    try:
        server.wait_ready()
        rss0 = rss_mib(server.proc.pid)
        heap0 = server.heap_report()
        print(f"server pid {server.proc.pid}, log {server.log_path}; idle RSS {rss0:.1f} MiB", flush=True)
        print(" round   RSS MiB   d RSS   heap MiB  peak MiB  failed    s   top heap growth this round", flush=True)
        prev_rss = rss0
        for n in range(args.rounds):
            t0 = time.perf_counter()
            failed = asyncio.run(run_round(server.url, args.requests, args.max_tokens, n))
            server.wait_idle()
            seconds = time.perf_counter() - t0
            time.sleep(args.settle)
            rss = rss_mib(server.proc.pid)
            heap = server.heap_report()
            row: dict[str, Any] = {"round": n + 1, "rss_mib": rss, "failed": failed, "seconds": seconds}
            top = ""
            if heap is not None:
                row.update(heap_mib=heap["current"] / 2**20, peak_mib=heap["peak"] / 2**20, growth=heap["growth"])
                if heap["growth"]:
                    d, _, _, where = heap["growth"][0]
                    top = f"{d / 1024:+.1f} KiB {where}"
            rounds.append(row)
            print(
                f"{n + 1:6d} {rss:9.1f} {rss - prev_rss:+7.1f} {row.get('heap_mib', float('nan')):10.2f}"
                f" {row.get('peak_mib', float('nan')):9.2f} {failed:7d} {seconds:5.1f}   {top}",
                flush=True,
            )
            prev_rss = rss
    finally:
        server.stop()
    rss_series = [r["rss_mib"] for r in rounds]
    growth, ok = verdict(rss_series, args.warmup)
    # allocation sites that grew after warm-up, summed over the per-round reports (each report's top 20)
    sites: dict[str, int] = defaultdict(int)
    for r in rounds[args.warmup :]:
        for d, _, _, where in r.get("growth", []):
            sites[where] += d
    top_sites = sorted(sites.items(), key=lambda kv: -kv[1])[:20]
    result = {
        "config": {
            "cpu": f"{cpu_name()}, {os.cpu_count()} cpus", "model": model_desc, "command": server.command, "rounds": args.rounds,
            "requests": args.requests, "max_tokens": args.max_tokens, "warmup": args.warmup,
            "tracemalloc": args.tracemalloc, "env": args.env, "label": args.label,
        },
        "idle_rss_mib": rss0,
        "idle_heap_mib": heap0["current"] / 2**20 if heap0 else None,
        "rounds": [{k: v for k, v in r.items() if k != "growth"} for r in rounds],
        "growth_after_warmup": growth,
        "pass": ok,
        "top_growth_after_warmup": top_sites,
    }  # fmt: skip
    base = rss_series[args.warmup - 1]
    print(
        f"RSS at end of warm-up (round {args.warmup}) {base:.1f} MiB, max of the last {LAST} rounds "
        f"{max(rss_series[-LAST:]):.1f} MiB: growth {100 * growth:+.1f}% -> {'PASS' if ok else 'FAIL'} (< 5%)"
    )
    if top_sites:
        print("tracemalloc: allocation sites that grew most after warm-up (sum of per-round top-20 diffs):")
        for where, d in top_sites[:10]:
            print(f"  {d / 1024:+10.1f} KiB  {where}")
    return result


def markdown(results: list[dict[str, Any]]) -> str:
    """Per-round RSS of one or more runs side by side, with each run's verdict."""
    first = results[0]["config"]
    labels = [r["config"]["label"] or f"run {i + 1}" for i, r in enumerate(results)]
    out = [
        "# Soak: server memory over repeated rounds of requests",
        "",
        f"CPU: {first['cpu']}. Model: {first['model']}. {first['rounds']} rounds of {first['requests']} concurrent "
        f"requests x {first['max_tokens']} new tokens (ignore_eos; completions and chat, streamed and not, in turn); "
        f"RSS (VmRSS) read once the server is idle after each round; warm-up {first['warmup']} rounds.",
        "",
        "Verdict: growth = (max RSS of the last 10 rounds - RSS at the end of warm-up) / RSS at the end of warm-up; "
        "PASS under 5%.",
        "",
    ]
    for label, r in zip(labels, results):
        c = r["config"]
        out.append(f"- **{label}**: `{c['command']}`")
    out += [
        "",
        "| run | idle RSS MiB | end of warm-up | max of last 10 | final | growth | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, r in zip(labels, results):
        rss = [x["rss_mib"] for x in r["rounds"]]
        w = r["config"]["warmup"]
        out.append(
            f"| {label} | {r['idle_rss_mib']:.1f} | {rss[w - 1]:.1f} | {max(rss[-LAST:]):.1f} | {rss[-1]:.1f} | "
            f"{100 * r['growth_after_warmup']:+.1f}% | {'PASS' if r['pass'] else 'FAIL'} |"
        )
    out += ["", "Per round (RSS MiB; Python heap MiB traced by tracemalloc where it was on):", ""]
    out.append("| round | " + " | ".join(f"{lb} RSS | {lb} heap" for lb in labels) + " |")
    out.append("|---:|" + "---:|---:|" * len(labels))
    for i in range(max(len(r["rounds"]) for r in results)):
        cells = []
        for r in results:
            row = r["rounds"][i] if i < len(r["rounds"]) else {}
            cells.append(f"{row['rss_mib']:.1f}" if "rss_mib" in row else "")
            cells.append(f"{row['heap_mib']:.2f}" if "heap_mib" in row else "")
        out.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    for label, r in zip(labels, results):
        if r["top_growth_after_warmup"]:
            out += [
                "",
                f"tracemalloc, {label}: allocation sites that grew most after warm-up (KiB, summed over rounds):",
                "",
                "```",
            ]
            out += [f"{d / 1024:+10.1f}  {where}" for where, d in r["top_growth_after_warmup"][:10]]
            out.append("```")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help="model folder, or 'default' for the embedded default model (default: a tiny random Llama built locally)",
    )
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--requests", type=int, default=64, help="concurrent requests per round")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5, help="rounds before the RSS baseline")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV-cache blocks of 16 tokens (default: one round's worth; 0: the server's default)",
    )
    p.add_argument("--settle", type=float, default=0.5, help="seconds to wait after a round before reading RSS")
    p.add_argument(
        "--tracemalloc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Python heap and top growth per round (slower)",
    )
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment for the server (repeatable)"
    )
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="the rest goes to `portside serve`")
    p.add_argument("--label", default="", help="name of this run in the markdown")
    p.add_argument("--json", default=None, help="write the run's results to this JSON file")
    p.add_argument(
        "--md", default=None, help="write markdown to this file (default: ci/bench/results/soak.md with --report)"
    )
    p.add_argument(
        "--report",
        nargs="+",
        default=None,
        metavar="JSON",
        help="only render these runs' JSON files side by side as markdown",
    )
    args = p.parse_args()
    if args.report:
        results = [json.loads(Path(f).read_text()) for f in args.report]
    else:
        if args.warmup < 1 or args.rounds < args.warmup + LAST:
            p.error(f"need --warmup >= 1 and --rounds >= warmup + {LAST}")
        if args.kv_blocks is None:
            args.kv_blocks = args.requests * -(-(PROMPT_ALLOWANCE + args.max_tokens) // 16) * 5 // 4
        results = [soak(args)]
        if args.json:
            Path(args.json).write_text(json.dumps(results[0], indent=2))
    md = args.md or (str(RESULTS / "soak.md") if args.report else None)
    if md:
        Path(md).write_text(markdown(results))
        print(f"wrote {md}")
    if not args.report and not results[0]["pass"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
