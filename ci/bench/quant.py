"""cpu benchmark of the quantized kernels (`backends/cpu/quant.py`, `csrc/quant_gemm.cpp`).

``--suite gguf`` (the default): GGUF Q8_0, Q4_0 and Q4_K_M against llama.cpp on the same file, at
1 thread and at every usable core: decode ms/token, prefill tokens/s, the bandwidth bound, the
ratios and the kernels portside chose (`quant_gguf.py` says how). ``--quick``: 2 layers, short
prompts, 1 thread, one repeat (a smoke run on any CPU).

``--suite kernels`` (``all``: both), side by side in one run: portside fp32, bf16 (only on a CPU with native bf16 matmuls), int8 weight-only
(``--quantization int8``), int8 W8A8 (``--quantized-activations int8``), GGUF Q8_0 and Q4_K, and
llama.cpp on the same Q8_0 file (the ``llama_cpp`` Python package, in-process where this
environment has it, else in cpu.py's llama-cpp-python venv: `cpu_peers.run_llama_cpp`).

The model: a random-weight Llama of a real layer shape (hidden 2048, intermediate 5632, 16/4 heads
of 128, 8 layers, the tiny test tokenizer's vocabulary: 1.45 GB in fp32, 0.36 GB in int8), so a
decode step's weights are far larger than the caches. Figures:

- batch-1 decode ms/token and its bandwidth bound: the bytes a token reads (every weight tensor a
  step multiplies by, codes + scales, plus one embedding row) over the read bandwidth measured
  just before and after that decode (the VM's bandwidth moves; `cpu.py`);
- the kernels' weight stream alone: every quantized linear of the loaded model called on one row,
  one after another (no attention, norms or host work), against the same bound;
- throughput: N prompts x P tokens -> G tokens, EOS ignored (llama-cpp-python serves one
  sequence at a time: its prompts run one after another);
- the multi-row paths of one int8 and one Q4_K matrix (2048 x 5632) at several row counts: the
  decode kernel, the tiles dequantized per thread + GEMM (what runs from 9 rows), and the whole
  matrix dequantized + one GEMM;
- resident memory per GGUF format (Q8_0, Q4_K): a fresh process loads the file (converted on
  first use) and generates gen-len tokens after one prompt-len prompt (`portside.testing.resident`);
  the rise of its resident set over the imports, less the KV pool (set to one sequence and shown
  on its own) and less the engine's fixed cost (a control model of the same architecture with a
  few MiB of weights, measured the same way), against the file's tensor bytes. "raw" keeps the
  fixed cost in.

    python ci/bench/quant.py                                    # GGUF vs llama.cpp, 1 and all threads
    python ci/bench/quant.py --quick                            # the same, small and fast
    python ci/bench/quant.py --suite kernels --peers int8,llama.cpp-q8_0 --num-prompts 4

Writes ci/bench/results/quant.json and quant.md (the table; the analysis is in docs/cpu.md).
Random weights: speed only. On a shared machine only ratios within one run are comparable.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as _platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from cpu import RESULTS, _decode, load_info, make_prompts, matmul_gflops, measure_machine, read_bandwidth_huge_pages
from peers.llama_cpp_run import bench_llama_cpp
from quant_gguf import FORMATS
from quant_gguf import PEERS as GGUF_PEERS
from quant_gguf import markdown as gguf_markdown
from quant_gguf import run as gguf_vs_llama_cpp

from portside.testing.tiny import make_tiny_gguf, make_tiny_model

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=128, max_position_embeddings=2048)
PEERS = ("fp32", "bf16", "int8", "int8-w8a8", "int8-inductor", "int8-w8a8-inductor", "gguf-q8_0", "gguf-q4_k",
         "llama.cpp-q8_0")


def cpu_description() -> dict[str, str]:
    info = {"model_name": _platform.processor() or "?", "flags": ""}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["model_name"] = value.strip()
            elif key.strip() == "Flags":
                wanted = ("avx", "fma", "f16c", "amx", "vnni", "bf16")
                info["flags"] = " ".join(f for f in value.split() if any(w in f for w in wanted))
    except (OSError, subprocess.SubprocessError):
        pass
    try:  # lscpu's name can be as vague as "AMD EPYC": family/model tell the generation (25/17: Zen 4 Genoa)
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        f = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
        info["family_model"] = f"family {f['cpu family']} model {f['model']} stepping {f['stepping']}"
    except (OSError, KeyError):
        pass
    from portside.backends.cpu.platform import CpuPlatform

    info["portside"] = CpuPlatform.device_info().name
    return info


# ---- portside --------------------------------------------------------------------------------------


def decode_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step reads: every parameter and buffer once (codes, scales, norms,
    the LM head), the embedding table as one row, each storage once; the packed act-order copies
    are read instead of the canonical codes they duplicate."""
    from portside.quant.apply import weight_bytes

    total = weight_bytes(model)
    embed = model.model.embed_tokens
    table = embed.quant.qweight if embed.quant is not None else embed.weight
    lm_head = getattr(model, "lm_head", None)
    tied = lm_head is not None and any(
        t is not None and t.data_ptr() == table.data_ptr()
        for t in (getattr(lm_head, "weight", None), getattr(getattr(lm_head, "quant", None), "qweight", None)))
    if not tied:
        total -= table.numel() * table.element_size() * (1 - 1 / table.shape[0])
    return int(total)


def kernel_stream(model: torch.nn.Module, repeats: int = 7) -> dict[str, float]:
    """ms for one row through every quantized linear of `model` in forward order (median of
    `repeats`), the bytes they read, and the read bandwidth right before and after."""
    from portside.quant.weight import QuantWeight

    ops = None
    layers = []
    for m in model.modules():
        quant = getattr(m, "quant", None)
        if isinstance(quant, QuantWeight) and hasattr(m, "ops") and not hasattr(m, "lookup"):
            ops = m.ops
            layers.append(quant)
    if not layers:
        return {}
    xs = {w.in_features: torch.randn(1, w.in_features) for w in layers}
    nbytes = sum(sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros) if t is not None) for w in layers)

    def once() -> None:
        for w in layers:
            ops.quantized_linear(xs[w.in_features], w)

    once()
    before = read_bandwidth_huge_pages(512)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    bw = max(before, read_bandwidth_huge_pages(512))
    ms = 1000 * sorted(times)[len(times) // 2]
    return {"kernel_stream_ms": ms, "kernel_stream_bytes": nbytes, "kernel_stream_read_bandwidth_gbs": bw,
            "kernel_stream_vs_bound": ms / (1000 * nbytes / (bw * 1e9)), "kernel_stream_linears": len(layers)}


def bench_portside(model: str, prompts, gen: int, decode_tokens: int, **llm_args: Any) -> dict[str, Any]:
    from portside import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, device="cpu", max_model_len=len(prompts[0]) + gen + 8, max_num_seqs=max(64, len(prompts)),
              max_num_batched_tokens=2048, enable_prefix_caching=False, **llm_args)
    runner = llm.engine.executor.runner
    info: dict[str, Any] = {"graph": runner.graph_runner.name, "attention": runner.attn_backend.name,
                            "fused_decode": runner.graph_runner._fused is not None}
    kernels = sorted({str(getattr(m.layout, "kernel", "reference")) for m in runner.model.modules() if hasattr(m, "layout")})
    info["kernels"] = kernels

    def run(ps, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)

    run(prompts[:2], 4)
    run(prompts[:1], 2)
    info["startup_s"] = time.perf_counter() - t0
    info["decode_bytes_per_token"] = decode_bytes(runner.model)
    info.update(_decode(lambda n: run(prompts[:1], n), decode_tokens))
    info.update(kernel_stream(runner.model))
    t = time.perf_counter()
    outs = run(prompts, gen)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == gen for o in outs)
    info.update(throughput_s=elapsed, output_tok_s=len(prompts) * gen / elapsed)
    llm.shutdown()
    llm = runner = None
    gc.collect()
    from portside.backends.cpu.platform import install_caching_allocator

    install_caching_allocator(0)
    return info


# ---- resident memory ---------------------------------------------------------------------------------


def resident_memory(hf_dir: Path, ggufs: dict[str, Path], work: Path, prompt_len: int, gen: int) -> dict[str, Any]:
    """Per GGUF format: `resident_ratio` of a load + generate in a fresh process (each file
    converted on first use there; `make_control` for the engine's fixed cost) and the weights'
    MiB as served."""
    from portside.testing.resident import gguf_tensor_bytes, make_control, measure, resident_ratio

    out: dict[str, Any] = {"prompt_len": prompt_len, "gen_len": gen}
    for qtype in ("Q8_0", "Q4_K"):
        path = ggufs.get(qtype) or make_tiny_gguf(hf_dir, work / f"model-{qtype}.gguf", qtype)
        control = make_control(hf_dir, work / f"control-{qtype}", qtype)
        env = {"PORTSIDE_CACHE": str(work / f"resident-cache-{qtype}")}
        run = measure(path, prompt_len=prompt_len, max_tokens=gen, env=env)
        base = measure(control, prompt_len=prompt_len, max_tokens=gen, env=env)
        out[qtype] = resident_ratio(run, gguf_tensor_bytes(path), base, gguf_tensor_bytes(control))
        out[qtype]["weights_mib"] = round(run["weights_mib"], 1)
        print("resident", qtype, json.dumps(out[qtype]), flush=True)
    return out


# ---- the multi-row paths ----------------------------------------------------------------------------


def row_paths(rows=(1, 2, 4, 8, 16, 64, 256), n: int = 5632, k: int = 2048, repeats: int = 5) -> dict[str, Any]:
    """ms of one [rows, k] x [k, n] product per path, int8 per channel and Q4_K: the decode kernel
    (up to 8 rows in use), the per-thread tiles + GEMM (from 9), the whole matrix dequantized +
    one multi-threaded GEMM; fp32 oneDNN-prepacked and MKL linears of the dense matrix for scale."""
    import numpy as np

    from portside.quant.weight import quantize_per_channel

    ops = torch.ops.portside_cpu_native
    dense = torch.randn(n, k) / k**0.5
    w8 = quantize_per_channel(dense, "int8")
    try:
        from portside.testing.gguf_quants import quantize_k as kquantize

        q4k = torch.from_numpy(np.ascontiguousarray(kquantize(dense.numpy(), "Q4_K")).view(np.uint8).reshape(n, -1).copy())
    except Exception as e:  # the K-quant writer is optional here
        q4k, why = None, f"{type(e).__name__}: {e}"
    packed = torch.ops.mkldnn._reorder_linear_weight(dense, 64)
    out: dict[str, Any] = {"shape": [n, k]}

    def best(fn: Callable[..., Any], *args: Any) -> float:
        fn(*args)
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn(*args)
            ts.append(time.perf_counter() - t)
        return round(1000 * min(ts), 3)

    for t in rows:
        x = torch.randn(t, k)
        r: dict[str, float] = {
            "fp32_onednn": best(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""),
            "fp32_mkl": best(torch.nn.functional.linear, x, dense),
        }
        for name, (codes, scales, fmt) in {"int8": (w8.qweight, w8.scales, 0), "q4_k": (q4k, None, 112)}.items():
            if codes is None:
                continue
            for path, bits in (("auto", 0), ("tiles", 1 << 12), ("dense", 1 << 13)):  # quant_gemm.cpp's PATH_*
                r[f"{name}_{path}"] = best(ops.quant_linear, x, codes, scales, None, None, fmt | bits, 0)
        r["int8_w8a8"] = best(ops.quant_linear_w8a8, x, w8.qweight, w8.scales, None, None, None, 0)
        out[str(t)] = r
        print("rows", t, json.dumps(r), flush=True)
    if q4k is None:
        out["q4_k_skipped"] = why
    return out


# ---- report ------------------------------------------------------------------------------------------


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    best_bw = max([result["machine"]["read_bandwidth_gbs"]]
                  + [r[k] for r in result["runs"].values() for k in ("decode_read_bandwidth_gbs", "read_bandwidth_after_gbs") if k in r])
    result["read_bandwidth_best_gbs"] = best_bw
    summary = {}
    for name, r in result["runs"].items():
        if "decode_ms_per_token" not in r:
            summary[name] = {"not_measured": r.get("not_measured") or r.get("error")}
            continue
        bound_then = 1000 * r["decode_bytes_per_token"] / (r["decode_read_bandwidth_gbs"] * 1e9)
        s = {"decode_ms_per_token": round(r["decode_ms_per_token"], 2), "decode_mb_per_token": round(r["decode_bytes_per_token"] / 1e6, 1),
             "decode_vs_bound_then": round(r["decode_ms_per_token"] / bound_then, 3),
             "decode_vs_bound_strict": round(r["decode_ms_per_token"] / (1000 * r["decode_bytes_per_token"] / (best_bw * 1e9)), 3),
             "output_tok_s": round(r["output_tok_s"], 1)}
        if "kernel_stream_vs_bound" in r:
            s["kernel_stream_vs_bound"] = round(r["kernel_stream_vs_bound"], 3)
        summary[name] = s
    fp32 = summary.get("fp32", {}).get("decode_ms_per_token")
    lcpp = summary.get("llama.cpp-q8_0", {}).get("decode_ms_per_token")
    for s in summary.values():
        if "decode_ms_per_token" in s:
            if fp32:
                s["decode_speedup_vs_fp32"] = round(fp32 / s["decode_ms_per_token"], 2)
            if lcpp:
                s["decode_speedup_vs_llama_cpp_q8_0"] = round(lcpp / s["decode_ms_per_token"], 2)
    result["summary"] = summary
    return summary


def write_markdown(result: dict[str, Any], path: Path) -> None:
    m, w = result["machine"], result["workload"]
    lines = [
        "# Quantized kernels benchmark (`ci/bench/quant.py`)", "",
        f"Run of {result['date']}: {m['cpu']['model_name']} ({m['cpu'].get('family_model', '?')}; {m['cpu']['portside']}), "
        f"flags: {m['cpu']['flags']}; "
        f"quantized kernel paths `{result['quant_isa']}`; torch {m['torch']}, {m['threads']} threads; read bandwidth "
        f"{m['read_bandwidth_gbs']:.1f} GB/s at the start, best of the run {result['read_bandwidth_best_gbs']:.1f}; "
        f"load {result['load_before']} before.", "",
        f"Model: random Llama {SHAPE['hidden_size']} hidden, {SHAPE['intermediate_size']} intermediate, "
        f"{SHAPE['num_hidden_layers']} layers, {SHAPE['num_attention_heads']}/{SHAPE['num_key_value_heads']} heads of "
        f"{SHAPE['head_dim']}.", ""]
    if "gguf_vs_llama_cpp" in result:
        lines += ["## GGUF formats vs llama.cpp", "", *gguf_markdown(result["gguf_vs_llama_cpp"]), ""]
    if result["runs"]:
        lines += _kernels_table(result, w)
    _other_sections(result, lines)
    path.write_text("\n".join(lines) + "\n")


def _kernels_table(result: dict[str, Any], w: dict[str, Any]) -> list[str]:
    lines = [
        "## Quantized kernels (`--suite kernels`)", "",
        f"Throughput: {w['num_prompts']} prompts x {w['prompt_len']} -> "
        f"{w['gen_len']} tokens. Decode: batch 1, {w['decode_tokens']} tokens after a {w['prompt_len']}-token prompt; "
        "\"then\": against the bound at the bandwidth read around that decode, \"strict\": at the run's best; "
        "kernel stream: every quantized linear on one row, nothing else.", "",
        "| peer | MB/token | decode ms/token | vs bound then / strict | kernel stream vs bound | vs fp32 | vs llama.cpp Q8_0 | output tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        if "decode_ms_per_token" not in s:
            lines.append(f"| {name} | not measured: {s['not_measured']} | | | | | | |")
            continue
        lines.append(
            f"| {name} | {s['decode_mb_per_token']} | {s['decode_ms_per_token']} | {s['decode_vs_bound_then']}x / "
            f"{s['decode_vs_bound_strict']}x | {str(s.get('kernel_stream_vs_bound', '')) + 'x' if 'kernel_stream_vs_bound' in s else '-'} | "
            f"{s.get('decode_speedup_vs_fp32', '-')}x | {s.get('decode_speedup_vs_llama_cpp_q8_0', '-')}x | {s['output_tok_s']} |")
    return lines


def _other_sections(result: dict[str, Any], lines: list[str]) -> None:
    if "memory" in result:
        mem = result["memory"]
        lines += ["", f"Resident memory, load + generate ({mem['prompt_len']} -> {mem['gen_len']} tokens) in a fresh process, "
                  "MiB: the rise over the imports, the KV pool (one sequence, taken out), the engine's fixed cost (a control "
                  "model, taken out), what is left against the file's tensor bytes (once idle, and right after generate "
                  "returned); raw: the fixed cost left in.", "",
                  "| format | tensor MiB | weights as served | rise | KV pool | engine fixed | model | ratio | at return | raw |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for q in ("Q8_0", "Q4_K"):
            r = mem[q]
            lines.append(f"| {q} | {r['tensor_mib']} | {r['weights_mib']} | {r['rise_mib']} | {r['kv_mib']} | "
                         f"{r['engine_fixed_mib']} | {r['model_mib']} | {r['ratio']}x | {r['ratio_at_return']}x | {r['raw_ratio']}x |")
    if "row_paths" in result:
        rp = result["row_paths"]
        cols = [c for c in next(v for k, v in rp.items() if k.isdigit())]
        lines += ["", f"Multi-row paths, one {rp['shape'][0]} x {rp['shape'][1]} matrix, ms (best of 5):", "",
                  "| rows | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for k, v in rp.items():
            if k.isdigit():
                lines.append(f"| {k} | " + " | ".join(str(v.get(c, "")) for c in cols) + " |")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=("gguf", "kernels", "all"), default="gguf",
                    help="gguf: the GGUF formats vs llama.cpp; kernels: --peers, memory, row paths; all: both")
    ap.add_argument("--quick", action="store_true", help="2 layers, 32-token prompts, 16 decode tokens, 1 thread, one repeat")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=None, help="default: 128 (gguf), 32 (kernels)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="gguf suite: comma-separated GGUF formats")
    ap.add_argument("--thread-counts", default="1,all", help="gguf suite: comma-separated thread counts, 'all': every usable core")
    ap.add_argument("--gguf-peers", default=",".join(GGUF_PEERS), help=f"gguf suite: of {', '.join(GGUF_PEERS)}")
    ap.add_argument("--batch", type=int, default=4, help="gguf suite: prompts of the batched prefill")
    ap.add_argument("--repeats", type=int, default=3, help="gguf suite: best of this many timings")
    ap.add_argument("--rounds", type=int, default=1,
                    help="gguf suite: measure the peers in turn this many times, each keeping its best (interleaved)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="gguf suite: no llama.cpp (files by make_tiny_gguf)")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"kernels suite: comma-separated, of {', '.join(PEERS)}")
    ap.add_argument("--skip-row-paths", action="store_true")
    ap.add_argument("--skip-memory", action="store_true", help="no resident-memory measurement of the GGUF formats")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="decoder layers of the random model")
    ap.add_argument("--threads", type=int, default=None, help="kernels suite: threads for every peer (default: the usable cores)")
    ap.add_argument("--out", default=None, help="output path without extension (default: ci/bench/results/quant; "
                    "with --quick <tmp>/portside-quant-quick/quant, so a smoke run leaves the recorded results alone)")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.prompt_len, args.batch, args.repeats, args.thread_counts = 2, 32, 2, 1, "1"
        args.decode_tokens, args.num_prompts, args.skip_memory, args.skip_row_paths = args.decode_tokens or 16, 4, True, True
    if args.decode_tokens is None:
        args.decode_tokens = 32 if args.suite == "kernels" else 128
    if args.out is None:
        args.out = str(Path(tempfile.gettempdir()) / "portside-quant-quick" / "quant" if args.quick else RESULTS / "quant")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    from portside.backends.cpu import quant
    from portside.backends.cpu.platform import configure_threads, has_native_bf16, usable_cores

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = configure_threads()
    SHAPE["num_hidden_layers"] = args.layers
    work = Path(tempfile.mkdtemp(prefix="portside-quant-bench-"))
    path = make_tiny_model(work / "hf", "llama", **SHAPE)
    peers = [p for p in args.peers.split(",") if p] if args.suite != "gguf" else []
    ggufs: dict[str, Path] = {}
    for qtype in ("Q8_0", "Q4_K"):
        if any(p.endswith(qtype.lower()) for p in peers):
            t = time.perf_counter()
            ggufs[qtype] = make_tiny_gguf(path, work / f"model-{qtype}.gguf", qtype)
            print(f"wrote {qtype} GGUF in {time.perf_counter() - t:.0f} s", flush=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": cpu_description(), "python": _platform.python_version(), "torch": torch.__version__,
                    "threads": threads, "cores": os.cpu_count(), **measure_machine()},
        "quant_isa": quant.isa(),
        "load_before": load_info(),
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                     "decode_tokens": args.decode_tokens},
        "model": {"shape": dict(SHAPE)},
        "runs": {},
    }
    print("machine:", json.dumps(result["machine"]), flush=True)
    prompts = make_prompts(400, args.num_prompts, args.prompt_len)
    if args.suite != "kernels":
        counts = sorted({usable_cores() if c == "all" else int(c) for c in args.thread_counts.split(",") if c})
        result["gguf_vs_llama_cpp"] = gguf_vs_llama_cpp(
            path, work, make_prompts(400, max(args.batch, 1), args.prompt_len), formats=args.formats.split(","),
            thread_counts=counts, peers=args.gguf_peers.split(","), decode_tokens=args.decode_tokens,
            batch=args.batch, repeats=args.repeats, llama_cpp=not args.no_llama_cpp,
            rounds=args.rounds)
        _summary(result)
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "fp32": lambda: bench_portside(str(path), prompts, args.gen_len, args.decode_tokens, dtype="float32"),
        "bf16": lambda: bench_portside(str(path), prompts, args.gen_len, args.decode_tokens, dtype="bfloat16"),
        "int8": lambda: bench_portside(str(path), prompts, args.gen_len, args.decode_tokens, dtype="float32",
                                       quantization="int8"),
        "int8-w8a8": lambda: bench_portside(str(path), prompts, args.gen_len, args.decode_tokens, dtype="float32",
                                            quantization="int8", quantized_activations="int8"),
        "int8-inductor": lambda: bench_portside(str(path), prompts, args.gen_len, args.decode_tokens, dtype="float32",
                                                quantization="int8", platform_options={"cpu_graph": "inductor"}),
        "int8-w8a8-inductor": lambda: bench_portside(str(path), prompts, args.gen_len, args.decode_tokens,
                                                     dtype="float32", quantization="int8", quantized_activations="int8",
                                                     platform_options={"cpu_graph": "inductor"}),
        "gguf-q8_0": lambda: bench_portside(str(ggufs["Q8_0"]), prompts, args.gen_len, args.decode_tokens, dtype="float32"),
        "gguf-q4_k": lambda: bench_portside(str(ggufs["Q4_K"]), prompts, args.gen_len, args.decode_tokens, dtype="float32"),
        "llama.cpp-q8_0": lambda: bench_llama_cpp(str(ggufs["Q8_0"]), prompts, args.gen_len, args.decode_tokens, threads),
    }
    if _missing("llama_cpp"):  # not in this environment: cpu.py's peer venv, built on first use
        from cpu_peers import run_llama_cpp

        jobs["llama.cpp-q8_0"] = lambda: run_llama_cpp(ggufs["Q8_0"], {
            "prompts": prompts, "gen": args.gen_len, "decode_tokens": args.decode_tokens, "threads": threads},
            work / "llama.cpp-q8_0.json")
    for name in peers:
        info: dict[str, Any]
        if name == "bf16" and not has_native_bf16():
            info = {"not_measured": "this CPU has no native bf16 matmul (AVX512-BF16/AMX-BF16): ~100x slower than fp32"}
        else:
            try:
                info = jobs[name]()
            except Exception as e:  # one peer failing must not lose the others' figures
                info = {"error": f"{type(e).__name__}: {e}"}
        info["load_after"] = load_info()
        info["read_bandwidth_after_gbs"] = read_bandwidth_huge_pages()
        result["runs"][name] = info
        print(name, json.dumps(info), flush=True)
        gc.collect()
        _summary(result)
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    if peers and not args.skip_memory:
        result["memory"] = resident_memory(path, ggufs, work, args.prompt_len, args.gen_len)
    if peers and not args.skip_row_paths:
        result["row_paths"] = row_paths()
        result["machine"]["fp32_after"] = matmul_gflops()
    _summary(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    shutil.rmtree(work, ignore_errors=True)  # GB of model files and their converted copies
    return result


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


if __name__ == "__main__":
    main()
