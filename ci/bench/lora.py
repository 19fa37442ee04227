"""cpu micro-benchmark of the batched multi-LoRA kernels: the cpu backend's grouped path
(`portside.backends.cpu.lora`) against core's reference (`portside.ops.lora`), per layer.

One linear layer of a 2048-wide model (in = N = 2048), rank 16, 16 adapter slots: shrink then
expand (what a LoRA layer adds to its base matmul), for T tokens over D distinct adapters laid
out as `LAYOUTS` says, in fp32 and bf16. The base layer's own matmul (x @ W.T, [2048, 2048]) is
timed alongside, so the LoRA overhead reads as a fraction of the layer. The step's `LoRAMapping`
and its grouping are built once and reused by every call, as the layers of a step share them;
building them (with the cpu path's plan) is timed on its own: once per step, not per layer.
Each figure is the fastest of N calls.

    /work/venv/bin/python ci/bench/lora.py            # writes ci/bench/results/lora.json
    /work/venv/bin/python ci/bench/lora.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from portside.contract import LoRAMapping, ModelOps

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, RANK, SLOTS = 2048, 16, 16


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return _platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return " ".join(f"{k.strip()}: {fields[k].strip()}" for k in ("Model name", "CPU family", "Model", "CPU(s)") if k in fields)


def timed(fn: Any, iters: int) -> float:
    """Fastest seconds of one call of `iters` (after two warm-up calls): on a shared machine the
    minimum is the figure least moved by other load."""
    fn()
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def case(ops: ModelOps, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor):
    def run() -> None:
        ops.lora_expand(ops.lora_shrink(x, a, mapping), b, mapping, out, 0)

    return run


# (distinct adapters, layout): "round-robin" puts token t on adapter t % D (no two neighbours
# share one: the worst case, a decode batch in arrival order); "blocks" gives each adapter T / D
# consecutive tokens (prefill chunks, or a batch sorted by adapter); "half-base" is round-robin
# with every other token on no adapter.
LAYOUTS = ((1, "blocks"), (4, "round-robin"), (4, "blocks"), (16, "round-robin"), (16, "blocks"), (4, "half-base"))


def slot_map(t: int, distinct: int, layout: str) -> torch.Tensor:
    if layout == "blocks":
        return torch.arange(t) * distinct // t
    slots = torch.arange(t) % distinct
    if layout == "half-base":
        slots[1::2] = -1
    return slots


def build_mapping(slots: torch.Tensor) -> LoRAMapping:
    from portside.backends.cpu.lora import plan

    mapping = LoRAMapping(slots, SLOTS)
    plan(mapping)  # the grouping (and the cpu path's plan) every layer of the step reuses
    return mapping


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations and cases")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the cpu platform's choice)")
    ap.add_argument("--out", default=str(RESULTS / "lora.json"))
    args = ap.parse_args(argv)

    from portside.backends.cpu.moe import CpuModelOps
    from portside.backends.cpu.platform import configure_threads

    configure_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    iters = 10 if args.quick else 40
    gen = torch.Generator().manual_seed(0)
    cpu_ops, ref_ops = CpuModelOps(), ModelOps()
    result: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "python": _platform.python_version()},
        "shape": {"in": HIDDEN, "out": HIDDEN, "rank": RANK, "slots": SLOTS},
        "cases": [],
    }
    print("machine:", json.dumps(result["machine"]), flush=True)
    token_counts = (1, 64) if args.quick else (1, 8, 64, 512)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(HIDDEN, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype)
        a = (torch.randn(SLOTS, RANK, HIDDEN, generator=gen) * HIDDEN**-0.5).to(dtype)
        b = (torch.randn(SLOTS, HIDDEN, RANK, generator=gen) * RANK**-0.5).to(dtype)
        for t in token_counts:
            x = torch.randn(t, HIDDEN, generator=gen).to(dtype)
            out = torch.zeros(t, HIDDEN, dtype=dtype)
            base_s = timed(lambda x=x, w=w: torch.mm(x, w.t()), iters)
            for distinct, layout in LAYOUTS:
                if distinct > t or (layout == "blocks" and 1 < distinct == t):
                    continue
                slots = slot_map(t, distinct, layout)
                mapping = build_mapping(slots)
                step_s = timed(lambda slots=slots: build_mapping(slots), iters)
                ref_s = timed(case(ref_ops, x, a, b, mapping, out), iters)
                cpu_s = timed(case(cpu_ops, x, a, b, mapping, out), iters)
                row = {"dtype": str(dtype).removeprefix("torch."), "tokens": t, "adapters": distinct,
                       "layout": layout, "base_linear_us": round(base_s * 1e6, 1),
                       "mapping_per_step_us": round(step_s * 1e6, 1),
                       "reference_us": round(ref_s * 1e6, 1), "cpu_us": round(cpu_s * 1e6, 1),
                       "speedup": round(ref_s / cpu_s, 2), "cpu_vs_base_linear": round(cpu_s / base_s, 3)}
                result["cases"].append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
