"""cpu benchmark: end-to-end throughput with 0, 1, 4 and 16 distinct LoRA adapters in one batch,
against the base model alone, side by side in one run (issue 21's target: 4 adapters cost under
25% of the base model's throughput).

Model: a random-weight Llama of SmolLM2-135M's layer shape (hidden 576, 9/3 heads, head_dim 64,
intermediate 1536) with 8 of its 30 layers by default (`--layers`: every cost compared here is
per layer, so the ratios hold for the full depth; 8 keeps a full run to a few minutes on 2
cores) and the tiny test tokenizer's vocabulary (so the LM head is small), fp32.
Adapters: random PEFT LoRA adapters on every linear layer peft targets in a Llama (q/k/v/o,
gate/up/down), r=16, made with `peft` and saved by its `save_pretrained`. Workload: N prompts of
P random tokens, G new tokens each, greedy, EOS ignored, prefix caching off; the requests are
assigned the adapters round-robin (request i runs adapter i % D).

Runs, each on the same prompts:

- ``base``: `enable_lora=False` (the cpu platform's default graph runner);
- ``lora-D`` for D in 0, 1, 4, 16: one engine with `enable_lora=True, max_loras=16,
  max_lora_rank=16`, D distinct adapters in the batch. ``lora-0`` separates the cost of running
  with LoRA enabled (the model runner then takes core's plain eager runner, not the platform's)
  from the cost of the LoRA terms (``lora-D`` against ``lora-0``).

Both engines live in the process at once; every round runs every configuration once (the order
rotated each round), after one warm-up round. Reported: tok/s (best and median over rounds) and
the ratio to ``base``, as the median of the per-round ratios (paired: each against the base run
of the same round) and best over best; then, per ``lora-D``, the "LoRA share": one more generate
with every LoRA layer's `apply` and the runner's `set_batch` timed, as a share of its wall time
(1 - share is the throughput against ``lora-0``, measured inside one run: on a shared machine
the load moves two runs a minute apart far more than LoRA does, see results/lora_e2e.md). One
torch thread by default, for the same reason (``--threads 0``: the cpu platform's choice).

    python ci/bench/lora_e2e.py                 # writes ci/bench/results/lora_e2e.json
    python ci/bench/lora_e2e.py --by-slot 4,16  # and the cpu kernels without their padded batch
    python ci/bench/lora_e2e.py --quick         # a small model and workload: a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform as _platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SMOLLM_SHAPE = dict(hidden_size=576, num_hidden_layers=8, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, max_position_embeddings=2048)
QUICK_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, intermediate_size=256, max_position_embeddings=512)
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKEN_BUDGET = 2048


def make_adapters(model_dir: Path, root: Path, count: int, rank: int) -> list[Path]:
    """`count` random PEFT adapters of rank `rank` on every Llama linear: one peft model, its A and
    B re-drawn per adapter (as `portside.testing.tiny.make_tiny_lora` draws them) and saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LLAMA_TARGETS),
                                                  lora_dropout=0.0, init_lora_weights=False))
    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if ".lora_A." in name:  # [r, in]
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
                elif ".lora_B." in name:  # [out, r]
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / math.sqrt(p.shape[1]))
        out = root / f"adapter{i}"
        peft_model.save_pretrained(str(out))
        paths.append(out)
    return paths


def runner_name(llm: Any) -> str:
    runner = type(llm.engine.executor.runner.graph_runner)
    return f"{runner.__module__}.{runner.__qualname__}"


def load_info() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "?"


def summarize(runs: dict[str, list[float]], base: str = "base") -> dict[str, Any]:
    """Per configuration: tok/s best and median over rounds; against `base`, the median of the
    per-round ratios (round i of a configuration over round i of the base) and best over best;
    and the cost (1 - ratio) of the paired median."""
    out: dict[str, Any] = {}
    for name, tps in runs.items():
        row: dict[str, Any] = {"rounds": len(tps), "best_tok_s": round(max(tps), 1),
                               "median_tok_s": round(statistics.median(tps), 1)}
        if name != base and runs.get(base):
            paired = [t / b for t, b in zip(tps, runs[base])]
            row["vs_base_paired_median"] = round(statistics.median(paired), 3)
            row["vs_base_best"] = round(max(tps) / max(runs[base]), 3)
            row["cost_vs_base"] = round(1 - row["vs_base_paired_median"], 3)
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--adapters", default="0,1,4,16", help="distinct adapters per batch, one run each")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; SmolLM2-135M has 30)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, 8 prompts, 1 round: a smoke run")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1; 0: the cpu platform's choice). On a shared machine "
                         "two threads make every OpenMP region wait for whichever thread the load descheduled")
    ap.add_argument("--by-slot", default="", metavar="COUNTS",
                    help="also run these adapter counts (e.g. 4,16) with the cpu LoRA kernels' padded batch turned "
                         "off (one matmul per adapter, as before it existed): configurations lora-D/by-slot")
    ap.add_argument("--profile", default=None, metavar="CONFIG",
                    help="also profile one generate of this configuration (e.g. lora-4) with torch.profiler")
    ap.add_argument("--out", default=str(RESULTS / "lora_e2e.json"))
    args = ap.parse_args(argv)
    shape = SMOLLM_SHAPE
    if args.quick:
        shape = QUICK_SHAPE
        args.num_prompts, args.prompt_len, args.gen_len, args.rounds = 8, 8, 4, 1
    if args.layers:
        shape = {**shape, "num_hidden_layers": args.layers}

    from portside.backends.cpu.platform import configure_threads

    configure_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="lora_e2e_"))
    try:
        result = _bench(args, shape, work, argv)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return result


def _bench(args: argparse.Namespace, shape: dict[str, Any], work: Path, argv: list[str] | None) -> dict[str, Any]:
    from portside import LLM, LoRARequest, SamplingParams
    from portside.testing.tiny import make_tiny_model

    counts = [int(c) for c in args.adapters.split(",") if c]
    t0 = time.perf_counter()
    model = make_tiny_model(work / "model", "llama", **shape)
    adapters = make_adapters(model, work / "adapters", max(counts), args.rank) if max(counts) else []
    setup_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 300, (args.num_prompts, args.prompt_len), generator=g).tolist()
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True)
    new_tokens = args.num_prompts * args.gen_len
    common = dict(device="cpu", dtype="float32", max_model_len=args.prompt_len + args.gen_len + 8,
                  max_num_seqs=max(64, args.num_prompts), max_num_batched_tokens=TOKEN_BUDGET,
                  enable_prefix_caching=False)
    slots = max(16, max(counts))
    engines = {"base": LLM(model=str(model), **common),
               "lora": LLM(model=str(model), enable_lora=True, max_loras=slots, max_lora_rank=args.rank, **common)}
    loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    configs: dict[str, tuple[Any, list[Any] | None]] = {"base": (engines["base"], None)}
    for d in counts:
        configs[f"lora-{d}"] = (engines["lora"], [loras[i % d] for i in range(args.num_prompts)] if d else None)
    for d in [int(c) for c in args.by_slot.split(",") if c]:
        configs[f"lora-{d}/by-slot"] = (engines["lora"], [loras[i % d] for i in range(args.num_prompts)])

    def run(name: str) -> float:
        llm, lora = configs[name]
        with by_slot(name.endswith("/by-slot")):
            t = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
            elapsed = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == args.gen_len for o in outs)
        return new_tokens / elapsed

    result: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "python": _platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", "ci/bench/lora_e2e.py", *(argv if argv is not None else sys.argv[1:])]),
        "model": {**shape, "dtype": "float32", "vocab_size": json.loads((model / "config.json").read_text())["vocab_size"]},
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                     "adapter_rank": args.rank, "max_loras": slots, "assignment": "round-robin",
                     "graph_runners": {k: runner_name(e) for k, e in engines.items()}},
        "setup_s": round(setup_s, 1),
        "load_before": load_info(),
        "rounds": {name: [] for name in configs},
        "round_loads": [],
    }
    print("machine:", json.dumps(result["machine"]), flush=True)
    print("workload:", json.dumps(result["workload"]), flush=True)
    names = list(configs)
    warm = {}
    for name in names:  # warm-up: first-touch allocations, slots filled, packed weights built
        warm[name] = round(run(name), 1)
        print(f"warm-up {name}: {warm[name]} tok/s", flush=True)
    result["warm_up_tok_s"] = warm
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotated: no configuration always first
        line = {}
        for name in order:
            tps = run(name)
            result["rounds"][name].append(tps)
            line[name] = round(tps, 1)
        result["round_loads"].append(load_info())
        print(f"round {r + 1}:", json.dumps(line), "load", load_info(), flush=True)
        gc.collect()
    result["load_after"] = load_info()
    result["summary"] = summarize(result["rounds"])
    four = result["summary"].get("lora-4", {}).get("cost_vs_base")
    if four is not None:
        result["summary"]["target_4_adapters_under_25pct_met"] = four < 0.25
    result["lora_time_share"] = {}
    for name in names:
        if name.startswith("lora-"):
            with by_slot(name.endswith("/by-slot")):
                result["lora_time_share"][name] = lora_time_share(*configs[name], inputs, params)
    print("LoRA time share:", json.dumps(result["lora_time_share"]), flush=True)
    if args.profile:
        result["profile"] = profile(configs, args.profile, inputs, params)
    for llm in engines.values():
        llm.shutdown()
    return result


@contextlib.contextmanager
def by_slot(on: bool) -> Iterator[None]:
    """With `on`, the cpu LoRA kernels never take their padded batch (`backends/cpu/lora.py`)."""
    from portside.backends.cpu import lora as cpu_lora

    padded = cpu_lora._padded
    if on:
        cpu_lora._padded = lambda mapping, runs: None
    try:
        yield
    finally:
        cpu_lora._padded = padded


def lora_time_share(llm: Any, lora: list[Any] | None, inputs: list[Any], params: Any) -> dict[str, float]:
    """One more generate, timing what LoRA adds inside it (load-independent, unlike a throughput
    ratio): every LoRA layer's `apply` (shrink + expand, the grouping's first build included),
    also split into the steps with more tokens than the batch has sequences (prefill) and the
    others (decode), and the runner's `set_batch` (slots filled, the step's mapping built), as
    shares of the wall time."""
    from portside.lora.layers import LoRALayer
    from portside.lora.manager import LoRAModelManager

    spent = {"apply": 0.0, "apply_prefill": 0.0, "set_batch": 0.0}
    apply, set_batch = LoRALayer.apply, LoRAModelManager.set_batch

    def timed_apply(layer: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        t = time.perf_counter()
        try:
            apply(layer, x, y)
        finally:
            dt = time.perf_counter() - t
            spent["apply"] += dt
            if x.shape[0] > len(inputs):
                spent["apply_prefill"] += dt

    def timed_set_batch(*a: Any, **kw: Any) -> None:
        t = time.perf_counter()
        try:
            set_batch(*a, **kw)
        finally:
            spent["set_batch"] += time.perf_counter() - t

    LoRALayer.apply, LoRAModelManager.set_batch = timed_apply, timed_set_batch  # type: ignore[method-assign]
    try:
        t = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
        wall = time.perf_counter() - t
    finally:
        LoRALayer.apply, LoRAModelManager.set_batch = apply, set_batch  # type: ignore[method-assign]
    return {
        "wall_s": round(wall, 3),
        "apply_s": round(spent["apply"], 3),
        "apply_prefill_s": round(spent["apply_prefill"], 3),
        "set_batch_s": round(spent["set_batch"], 3),
        "share": round((spent["apply"] + spent["set_batch"]) / wall, 3),
    }


def profile(configs: dict[str, Any], name: str, inputs: list[Any], params: Any) -> list[dict[str, Any]]:
    """The top operators of one generate of configuration `name` (self CPU time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    llm, lora = configs[name]
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:25]:
        rows.append({"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1000, 1)})
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return rows


def table(result: dict[str, Any]) -> str:
    """The summary as a markdown table; "LoRA share" is `lora_time_share`'s (measured inside one run)."""
    lines = [
        "| configuration | tok/s best | tok/s median | vs base (paired median) | vs base (best/best) | cost | LoRA share |",
        "|---|---|---|---|---|---|---|",
    ]
    shares = result.get("lora_time_share", {})
    for name, s in result["summary"].items():
        if not isinstance(s, dict):
            continue
        ratio = s.get("vs_base_paired_median")
        vs = "" if ratio is None else f"{ratio:.3f}"
        cost = "" if ratio is None else f"{100 * s['cost_vs_base']:.1f}%"
        share = f"{100 * shares[name]['share']:.1f}%" if name in shares else ""
        lines.append(f"| {name} | {s['best_tok_s']} | {s['median_tok_s']} | {vs} | {s.get('vs_base_best', '')} | {cost} "
                     f"| {share} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
