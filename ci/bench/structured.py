"""Structured output's per-step overhead, side by side in one run: decode steps of B constrained
rows (a JSON schema whose one string field keeps every row going for the whole run) against B
free rows, B = 1 and 64, on the default model (SmolLM2-135M-Instruct, 49152-token vocabulary) in
fp32 on the cpu backend, greedy, llguidance (and xgrammar when installed).

Also the parts of a step alone, at B rows: filling the masks (llguidance's thread pool) and
applying them in the sampler (core's torch reference, the cpu native kernel).

    /work/venv/bin/python ci/bench/structured.py [--steps 48] [--threads 2] [--repeats 3]

Writes ci/bench/results/structured.json and structured.md. The mask is filled on a worker thread
while the model runs its forward pass; on a 2-core machine the two compete for the cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from machine import cpu_name  # ci/bench/machine.py, beside this script

from portside import LLMEngine, SamplingParams
from portside.sampling_params import StructuredOutputsParams

RESULTS = Path(__file__).parent / "results"
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}
PROMPT = "Write a long description of a harbour town in winter, as JSON."


def decode_step_ms(engine: LLMEngine, batch: int, constrained: bool, steps: int) -> float:
    """Median wall time of the decode steps (every row running, past the prefill)."""
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=not constrained, structured_outputs=so)
    for i in range(batch):
        engine.add_request(f"{'c' if constrained else 'f'}{batch}-{i}", PROMPT, params)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    decode = times[2 : 2 + steps]  # past the prefill step(s)
    return 1e3 * statistics.median(decode)


def part_times(engine: LLMEngine, batch: int, reps: int) -> dict[str, float]:
    """ms to fill B masks, and to apply them (reference, and the platform's sampler kernel)."""
    from portside.sample.bitmask import apply_token_bitmask

    manager = engine.structured
    grammar = manager.compile(StructuredOutputsParams(json=SCHEMA))
    prompt = engine.tokenizer.encode(PROMPT)
    states = [manager.new_state(grammar, prompt) for _ in range(batch)]
    fill = []
    for _ in range(reps):
        t0 = time.perf_counter()
        bitmask = manager._fill(states)
        fill.append(time.perf_counter() - t0)
    logits = torch.randn(batch, engine.vocab_size)
    rows = torch.arange(batch)
    out: dict[str, float] = {"fill": 1e3 * statistics.median(fill)}
    sampler = engine.executor.runner.sampler
    for name, fn in (("apply (torch reference)", apply_token_bitmask), ("apply (platform kernel)", sampler.apply_token_bitmask)):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(logits, bitmask, rows)
            ts.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(ts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="llguidance,xgrammar")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    parts: dict[str, Any] = {}
    for backend in args.backends.split(","):
        if backend == "xgrammar":
            try:
                import xgrammar  # noqa: F401
            except ImportError:
                continue
        engine = LLMEngine.from_args(device="cpu", dtype="float32", max_num_seqs=64, structured_outputs_backend=backend)
        decode_step_ms(engine, 2, False, 4)  # warm-up: kernels, grammar engine
        decode_step_ms(engine, 2, True, 4)
        for batch in (1, 64):
            # alternating runs, the best median of each kind: the machine's load drifts
            free, constrained = float("inf"), float("inf")
            for _ in range(args.repeats):
                free = min(free, decode_step_ms(engine, batch, False, args.steps))
                constrained = min(constrained, decode_step_ms(engine, batch, True, args.steps))
            rows.append({"backend": backend, "batch": batch, "free_ms": free, "constrained_ms": constrained,
                         "overhead": constrained / free - 1})  # fmt: skip
            print(rows[-1], flush=True)
        parts[backend] = {b: part_times(engine, b, 20) for b in (1, 64)}
        print(backend, parts[backend], flush=True)
        engine.shutdown()
    cpu = cpu_name()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured.json").write_text(json.dumps({"cpu": cpu, "threads": args.threads, "rows": rows, "parts": parts}, indent=1))
    lines = [
        "# Structured output: per-step overhead",
        "",
        f"CPU: {cpu}; torch threads {args.threads}; default model (SmolLM2-135M, V = 49152) fp32, greedy; per kind the best of "
        f"{args.repeats} alternating runs of the median of {args.steps} decode steps. Side by side in one process; on a shared "
        "machine only the ratios are comparable.",
        "",
        "| backend | batch | free rows ms/step | constrained rows ms/step | overhead |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['backend']} | {r['batch']} | {r['free_ms']:.2f} | {r['constrained_ms']:.2f} | {100 * r['overhead']:+.1f}% |" for r in rows]
    lines += ["", "Parts of a step alone (ms, median of 20):", "", "| backend | batch | fill masks | apply (torch reference) | apply (platform kernel) |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    for backend, by_batch in parts.items():
        for b, p in by_batch.items():
            lines.append(f"| {backend} | {b} | {p['fill']:.3f} | {p['apply (torch reference)']:.3f} | {p['apply (platform kernel)']:.3f} |")
    (RESULTS / "structured.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
