"""Batch-invariant mode (--batch-invariant) on the cpu backend: how often a request's outputs
change with its batch when the mode is off, that they never do when it is on, and what the mode
costs in throughput, side by side in one run.

Workload (as tests/test_batch_invariant.py): 64 prompts of 3..60 tokens on a random-weight Llama
built here; 16 of them (every 4th) sample with a seed (temperature 0.8, top-p 0.9, top-k 40) and
ask for 3 logprobs, the others mix greedy, seeded and unseeded sampling.

- invariance: each of the 16 runs alone (one engine, a generous token budget), then all 64 run
  together in another engine with a 24-token budget (chunked prefill) and a KV pool too small to
  hold them (preemption). Reported per mode: targets whose token ids differ, and token steps
  whose logprobs differ (of those where the ids still agree);
- throughput: the 64 together with the default budget, block size and a large pool, after one warm-up run
  of the same batch in each engine (prefix caching off), the three engines timed in turn for 3 rounds, each
  one's fastest run: generated tokens per second with the mode off (the cpu backend's default graph runner,
  and eager) and on, and the ratios.

    .venv/bin/python ci/bench/batch_invariant.py               # writes results/batch_invariant.{json,md}
    .venv/bin/python ci/bench/batch_invariant.py --quick       # a smaller model, nothing written
    .venv/bin/python ci/bench/batch_invariant.py --model ~/.cache/portside/models/smollm2-135m-instruct
                                                  # the default model (dense fp32): results/batch_invariant-<folder>.*
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from portside import LLM, SamplingParams
from portside.testing.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_details  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = ("the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun "
         "and the river runs to the sea under a bright sky full of birds").split()
MAX_TOKENS = 16
RUNS = 3  # rounds of timed runs of the throughput batch, one per configuration each (after one warm-up)
SHAPES = {  # hidden, intermediate, heads, kv heads, layers
    "full": dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=6),
    "quick": dict(hidden_size=96, intermediate_size=200, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3),
}


def workload(tokenizer: Any) -> tuple[list[list[int]], list[SamplingParams]]:
    rnd = random.Random(0)
    base = tokenizer.encode(" ".join(WORDS * 6))
    prompts, params = [], []
    for i in range(64):
        n = rnd.randint(3, 60)
        start = 0 if i % 3 == 0 else rnd.randint(1, 40)
        prompts.append(base[start : start + n])
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1000 + i, max_tokens=MAX_TOKENS,
                                         logprobs=3, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=rnd.choice([0.0, 0.7, 1.2]), seed=rnd.choice([None, i]),
                                         max_tokens=rnd.randint(4, 20), logprobs=rnd.choice([None, 1]), ignore_eos=True))
    return prompts, params


def result(out: Any) -> tuple[list[int], list[list[tuple[int, float]]]]:
    o = out.outputs[0]
    return list(o.token_ids), [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.logprobs]


def invariance(model: str, invariant: bool, common: dict[str, Any]) -> dict[str, Any]:
    alone_llm = LLM(model=model, max_num_batched_tokens=2048, batch_invariant=invariant, **common)
    prompts, params = workload(alone_llm.get_tokenizer())
    targets = list(range(0, 64, 4))
    alone = {i: result(alone_llm.generate([{"prompt_token_ids": prompts[i]}], params[i], use_tqdm=False)[0]) for i in targets}
    del alone_llm
    llm = LLM(model=model, max_num_batched_tokens=24, num_kv_blocks=40, batch_invariant=invariant, **common)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ids_differ = steps = lp_differ = 0
    for i in targets:
        ids, lps = result(outs[i])
        if ids != alone[i][0]:
            ids_differ += 1
        for a, b, x, y in zip(ids, alone[i][0], lps, alone[i][1]):
            if a != b:
                break  # past the first different token the contexts differ
            steps += 1
            lp_differ += x != y
    return {"targets": len(targets), "targets_ids_differ": ids_differ, "logprob_steps_compared": steps,
            "logprob_steps_differ": lp_differ, "preemptions": llm.engine.stats().num_preemptions}


def throughput(model: str, common: dict[str, Any]) -> dict[str, Any]:
    """The 64 together in three engines (mode off with the default graph runner, off eager, on),
    timed in turn, `RUNS` rounds: each configuration's fastest run, so that all three see the
    same load on a shared machine."""
    kwargs = {k: v for k, v in common.items() if k != "block_size"}  # the platform's default block size
    configs = {"off_default_graph": (False, None), "off_eager": (False, "eager"), "on": (True, None)}
    engines, batch, params = {}, None, None
    for name, (invariant, graph) in configs.items():
        options = dict(common.get("platform_options", {}), **({"cpu_graph": graph} if graph else {}))
        llm = LLM(model=model, batch_invariant=invariant, enable_prefix_caching=False,  # the warm-up's prefixes
                  **{**kwargs, "platform_options": options})
        prompts, params = workload(llm.get_tokenizer())
        batch = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(batch, params, use_tqdm=False)  # warm-up: compilation, caches
        engines[name] = llm
    best = {name: float("inf") for name in configs}
    tokens = {}
    for _ in range(RUNS):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            best[name] = min(best[name], time.perf_counter() - t0)
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outs)
    return {name: {"seconds": round(best[name], 3), "generated_tokens": tokens[name],
                   "tokens_per_s": round(tokens[name] / best[name], 1)} for name in configs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the test's tiny shapes; writes nothing")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (cpu_threads); 1 on a shared machine")
    ap.add_argument("--model", default=None, help="a local HF folder (default: a random Llama built here)")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        shape = SHAPES["quick" if args.quick else "full"]
        model = args.model or str(make_tiny_model(Path(tmp) / "model", "llama", **shape))
        common = dict(device="cpu", dtype=args.dtype, max_model_len=128, block_size=4,
                      platform_options={"cpu_threads": str(args.threads)})
        report: dict[str, Any] = {
            "cpu": cpu_details(), "threads": args.threads, "torch": torch.__version__, "dtype": args.dtype,
            "model": args.model or f"random Llama {shape}", "load_average_before": [round(x, 2) for x in load_before],
        }
        report["invariance_off"] = invariance(model, False, common)
        report["invariance_on"] = invariance(model, True, common)
        t = throughput(model, common)
        on = t["on"]["tokens_per_s"]
        report["throughput"] = {**t, "on_vs_off_default": round(on / t["off_default_graph"]["tokens_per_s"], 3),
                                "on_vs_off_eager": round(on / t["off_eager"]["tokens_per_s"], 3)}
        report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=2))
    if not args.quick:
        suffix = ("" if args.model is None else f"-{Path(args.model).name}") + \
            ("" if args.dtype == "float32" else f"-{args.dtype}")
        (RESULTS / f"batch_invariant{suffix}.json").write_text(json.dumps(report, indent=2) + "\n")
        (RESULTS / f"batch_invariant{suffix}.md").write_text(markdown(report))
    return 0


def markdown(r: dict[str, Any]) -> str:
    t = r["throughput"]
    rows = [f"| mode off | {r['invariance_off']['targets_ids_differ']} / {r['invariance_off']['targets']} | "
            f"{r['invariance_off']['logprob_steps_differ']} / {r['invariance_off']['logprob_steps_compared']} | "
            f"{t['off_default_graph']['tokens_per_s']} (default graph), {t['off_eager']['tokens_per_s']} (eager) |",
            f"| mode on | {r['invariance_on']['targets_ids_differ']} / {r['invariance_on']['targets']} | "
            f"{r['invariance_on']['logprob_steps_differ']} / {r['invariance_on']['logprob_steps_compared']} | "
            f"{t['on']['tokens_per_s']} |"]
    return "\n".join([
        "# Batch-invariant mode: outputs alone vs in a batch of 64, and its cost (ci/bench/batch_invariant.py)",
        "",
        f"CPU: {r['cpu'].get('model_name')} ({', '.join(r['cpu'].get('flags', []))}); {r['threads']} torch thread(s); "
        f"torch {r['torch']}; {r['dtype']}; model: {r['model']}; load average before {r['load_average_before']}, "
        f"after {r['load_average_after']}.",
        "",
        "| | targets whose token ids differ | logprob steps that differ | throughput, tokens/s (64 requests) |",
        "|---|---|---|---|",
        *rows,
        "",
        f"Throughput with the mode on: {t['on_vs_off_default']}x the default graph runner's, "
        f"{t['on_vs_off_eager']}x the eager runner's.",
        "",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
