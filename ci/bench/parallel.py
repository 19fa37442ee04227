"""Parallelism benchmarks on this machine (cpu backend), each a ratio measured in one run.

    python ci/bench/parallel.py --what dp [--hidden 768 --layers 8 --requests 48 --prompt-len 48
                                           --max-tokens 48 --repeats 2]

`--what dp`: data parallelism. The same workload (--requests distinct prompts, all submitted at
once, greedy, ignore_eos) through the async engine front the server uses: DP = 1 (one engine,
in-process, every core) against DP = 2 (`DataParallelEngine` over two replicas, each computing
in its own worker process with cores / 2 threads). Both configurations are started once and run
alternately, --repeats times each after a warm-up; the best (shortest) run of each is kept (a
shared machine's noise only ever adds time). The model is a random-weight Llama whose layers
dominate (--hidden, --layers). Output tokens are checked equal between the two.

`--what pp`: pipeline parallelism. The same workload through `LLMEngine` (offline, all prompts
added, steps until done): PP = 1 (in-process, every core) against PP = 2 (two stage worker
processes with cores / 2 threads each) with micro-batching on (two steps in flight, each with
half the running requests, so both stages compute at once) and off (one step at a time: a stage
idles while the other computes). On one small machine PP brings no speed-up; the ratios show
what the machinery costs (the hidden-state sends, a process hop per step, smaller matmuls).

Writes ci/bench/results/parallel.json (one entry per section, replaced by a new run of that
section) and parallel.md. Leave OMP_NUM_THREADS unset: the engines divide the cores themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from machine import cpu_name  # ci/bench/machine.py, beside this script

from portside.engine.async_engine import AsyncLLMEngine
from portside.engine.data_parallel import DataParallelEngine, start_replicas
from portside.engine.llm_engine import LLMEngine
from portside.sampling_params import SamplingParams
from portside.testing.tiny import make_tiny_model

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


def make_model(tmp: str, hidden: int, layers: int) -> str:
    heads = max(4, hidden // 64)
    return str(make_tiny_model(tmp, "llama", hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=hidden // heads))


def engine_kwargs(args: argparse.Namespace, path: str) -> dict[str, Any]:
    per_request = -(-(args.prompt_len + args.max_tokens) // BLOCK) + 1
    return dict(model=path, device="cpu", dtype="float32", max_model_len=args.prompt_len + args.max_tokens + BLOCK,
                block_size=BLOCK, num_kv_blocks=args.requests * per_request + 8, max_num_seqs=args.requests)


def prompts(args: argparse.Namespace, salt: int) -> list[list[int]]:
    """Distinct prompts (no shared prefix: the router balances by load alone)."""
    return [[(salt * 131 + 7 * i + 13 * j) % 300 + 5 for j in range(args.prompt_len)] for i in range(args.requests)]


async def run_batch(front: Any, batch: list[list[int]], max_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """Seconds from submitting every prompt to the last one finishing, and the outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    streams = [await front.add_request(f"{tag}-{i}", p, params, check_capacity=False) for i, p in enumerate(batch)]

    async def last(stream: Any) -> list[int]:
        tokens: list[int] = []
        async for out in stream:
            tokens = out.outputs[0].token_ids
        return tokens

    outs = await asyncio.gather(*(last(s) for s in streams))
    return time.perf_counter() - start, list(outs)


def bench_dp(args: argparse.Namespace, path: str) -> dict[str, Any]:
    kwargs = engine_kwargs(args, path)
    t0 = time.perf_counter()
    single = LLMEngine.from_args(**kwargs)
    start_1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    replicas = start_replicas(2, **kwargs)
    start_2 = time.perf_counter() - t0

    async def main() -> dict[str, Any]:
        fronts = {"dp1": AsyncLLMEngine(single, manage_gc=False),
                  "dp2": DataParallelEngine(replicas, block_size=BLOCK)}
        for front in fronts.values():
            front.start()
        times: dict[str, list[float]] = {name: [] for name in fronts}
        tokens: dict[str, list[list[int]]] = {}
        try:
            for name, front in fronts.items():  # warm-up: allocator, caches, first-call paths
                await run_batch(front, prompts(args, 99)[:8], 8, f"warm-{name}")
            for r in range(args.repeats):
                for name, front in fronts.items():
                    seconds, outs = await run_batch(front, prompts(args, r), args.max_tokens, f"{name}-{r}")
                    times[name].append(seconds)
                    if r == 0:
                        tokens[name] = outs
                    print(f"  repeat {r}: {name} {seconds:.2f} s", flush=True)
            loads = [s.num_running + s.num_waiting for s in fronts["dp2"].engine_stats()]
            per_replica = [s.generation_tokens_total for s in fronts["dp2"].engine_stats()]
        finally:
            for front in fronts.values():
                await front.shutdown(10)
        assert tokens["dp1"] == tokens["dp2"], "DP 2 gave other tokens than DP 1"
        assert loads == [0, 0]
        out_tokens = args.requests * args.max_tokens
        best = {name: min(t) for name, t in times.items()}
        runs = {name: {"best_s": round(best[name], 3), "runs_s": [round(t, 3) for t in times[name]],
                       "output_tok_s": round(out_tokens / best[name], 1)} for name in fronts}
        runs["dp1"]["start_s"], runs["dp2"]["start_s"] = round(start_1, 1), round(start_2, 1)
        runs["dp2"]["generated_tokens_per_replica"] = per_replica
        return {"runs": runs, "ratio_dp2_over_dp1": round(best["dp1"] / best["dp2"], 3)}

    return asyncio.run(main())


def run_offline(engine: LLMEngine, batch: list[list[int]], max_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return time.perf_counter() - start, [outs[f"{tag}-{i}"] for i in range(len(batch))]


def bench_pp(args: argparse.Namespace, path: str) -> dict[str, Any]:
    kwargs = engine_kwargs(args, path)
    configs = {"pp1": {}, "pp2_micro": {"pipeline_parallel_size": 2},
               "pp2_one_step": {"pipeline_parallel_size": 2, "pipeline_micro_batches": 1}}
    engines = {}
    start_s = {}
    for name, extra in configs.items():
        t0 = time.perf_counter()
        engines[name] = LLMEngine.from_args(**kwargs, **extra)
        start_s[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for name, engine in engines.items():  # warm-up
            run_offline(engine, prompts(args, 99)[:8], 8, f"warm-{name}")
        for r in range(args.repeats):
            for name, engine in engines.items():
                seconds, outs = run_offline(engine, prompts(args, r), args.max_tokens, f"{name}-{r}")
                times[name].append(seconds)
                tokens.setdefault(name, outs)
                print(f"  repeat {r}: {name} {seconds:.2f} s", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    assert tokens["pp1"] == tokens["pp2_micro"] == tokens["pp2_one_step"], "PP 2 gave other tokens than PP 1"
    out_tokens = args.requests * args.max_tokens
    best = {name: min(t) for name, t in times.items()}
    runs = {name: {"start_s": round(start_s[name], 1), "best_s": round(best[name], 3),
                   "runs_s": [round(t, 3) for t in times[name]], "output_tok_s": round(out_tokens / best[name], 1)}
            for name in engines}
    return {"runs": runs, "ratio_pp2_micro_over_pp1": round(best["pp1"] / best["pp2_micro"], 3),
            "ratio_pp2_one_step_over_pp1": round(best["pp1"] / best["pp2_one_step"], 3)}


SECTIONS: dict[str, Callable[[argparse.Namespace, str], dict[str, Any]]] = {"dp": bench_dp, "pp": bench_pp}


def _section(title: str, entry: dict[str, Any], how: str, labels: dict[str, str]) -> list[str]:
    """A section's heading, its run line and its table of runs (`labels`: run name -> row label)."""
    w, m, runs = entry["workload"], entry["model"], entry["runs"]
    lines = [
        f"## {title}", "",
        f"Run of {entry['date']}, `{entry['command']}`; {entry['cpu']}, {entry['cores']} cores; torch {entry['torch']}. "
        f"Random-weight Llama, hidden {m['hidden']}, {m['layers']} layers, fp32, cpu backend (eager). "
        f"{w['requests']} distinct prompts of {w['prompt_len']} tokens, {w['max_tokens']} new tokens each, {how}, "
        f"greedy; best of {w['repeats']} alternating runs. Tokens checked equal.", "",
        "| | start s | best s | runs s | output tok/s |", "|---|---:|---:|---|---:|",
    ]
    for name, label in labels.items():
        r = runs[name]
        lines.append(f"| {label} | {r['start_s']} | {r['best_s']} | {', '.join(map(str, r['runs_s']))} | {r['output_tok_s']} |")
    return lines


def write_md(results: dict[str, Any]) -> None:
    lines = ["# Parallelism benchmark (`ci/bench/parallel.py`)", ""]
    dp = results.get("dp")
    if dp is not None:
        runs = dp["runs"]
        lines += _section("Data parallelism: DP = 2 against DP = 1", dp, "all submitted at once",
                          {"dp1": "DP = 1 (in-process, all cores)", "dp2": "DP = 2 (2 worker processes)"})
        lines += ["", f"**DP 2 / DP 1 throughput: {dp['ratio_dp2_over_dp1']}x** "
                      f"(tokens per replica: {runs['dp2']['generated_tokens_per_replica']}).", ""]
        lines += [
            f"Load average (1 min) when the run started: {dp.get('load_avg_before', '?')}, when it ended: "
            f"{dp.get('load_avg_after', '?')}. Other work on the machine slows single runs, and hurts the 2-thread "
            "DP = 1 engine more than the 1-thread replicas (an OpenMP barrier waits for a descheduled thread); the "
            "best of the alternating runs is the figure; trust it most when both loads are well below the core count.", "",
            "Reading it: on a machine of C cores DP = 1 runs one engine whose model uses all C threads in the "
            "front's process; DP = 2 runs two replicas on disjoint batches, each replica's model in its own worker "
            "process with C / 2 threads (its scheduler on a thread of the front's process, one pipe round trip per "
            "step). On cpu the ratio is what running two narrower engines side by side gains over one wider one "
            "(less time in thread synchronisation and in the single-threaded parts of a step, which now overlap), "
            "minus the pipe hop; on accelerators, where each replica has its own devices, DP scales with them.",
            "",
        ]
    pp = results.get("pp")
    if pp is not None:
        lines += _section("Pipeline parallelism: PP = 2 against PP = 1", pp, "offline (`LLMEngine`)",
                          {"pp1": "PP = 1 (in-process, all cores)",
                           "pp2_micro": "PP = 2, two steps in flight (micro-batching on)",
                           "pp2_one_step": "PP = 2, one step at a time (off)"})
        lines += ["", f"**PP 2 / PP 1 throughput: {pp['ratio_pp2_micro_over_pp1']}x with micro-batching, "
                      f"{pp['ratio_pp2_one_step_over_pp1']}x without.**", "",
                  f"Load average when the run started: {pp.get('load_avg_before', '?')}.", "",
                  "Reading it: PP = 2 runs each stage in its own process with C / 2 threads; with micro-batching "
                  "each step carries half the running requests and at most the platform's micro-batch token cap "
                  "(256 on cpu), so both stages compute at once. What remains of the overhead is mostly the "
                  "smaller matmuls: a stage's decode micro-batch has half the rows, and oneDNN's per-row cost "
                  "on one thread at 24 rows is ~1.3x that at 256 (measured on Zen 3); the hand-over of hidden "
                  "states (torch.distributed send/recv, a rendezvous) and the pipeline's fill and drain cost a "
                  "few percent. Before the cap (1024-token micro-batches from the 2048-token budget) this ratio "
                  "was 0.82x on the same machine.", ""]
    (RESULTS / "parallel.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", choices=sorted(SECTIONS), nargs="+", default=["dp"])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if "OMP_NUM_THREADS" in os.environ:
        print("warning: OMP_NUM_THREADS is set; the engines will not divide the cores themselves")
    out_file = RESULTS / "parallel.json"
    results = json.loads(out_file.read_text()) if out_file.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(tmp, args.hidden, args.layers)
        for what in args.what:
            print(f"== {what}", flush=True)
            load = os.getloadavg()[0]
            entry = SECTIONS[what](args, path)
            entry |= {
                "load_avg_before": round(load, 2), "load_avg_after": round(os.getloadavg()[0], 2),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "command": "ci/bench/parallel.py " + " ".join(sys.argv[1:]),
                "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                "model": {"hidden": args.hidden, "layers": args.layers},
                "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                             "repeats": args.repeats},
            }  # fmt: skip
            results[what] = entry
            print(json.dumps({k: entry[k] for k in ("runs",) if k in entry}, indent=1))
            print(f"{what}: " + ", ".join(f"{k} {v}" for k, v in entry.items() if k.startswith("ratio")))
    RESULTS.mkdir(exist_ok=True)
    out_file.write_text(json.dumps(results, indent=1) + "\n")
    write_md(results)


if __name__ == "__main__":
    main()
