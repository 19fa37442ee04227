"""cpu benchmark of multi-head latent attention (MLA, DeepSeek-V2/V3): batch-1 decode of a
DeepSeek-V2-shaped model through portside against transformers, side by side in one run, and the
latent-attention kernels alone.

Model (random weights, the tiny test tokenizer's vocabulary; `--dtype`): DeepSeek-V2-Lite's
attention (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, no q LoRA) at hidden 1024, 4
dense layers (intermediate 2816), so the MLA path is a visible share of a step. Figures: batch-1
decode ms/token after a short prompt and after a long one (`--long-len`: the latent attention
then reads a thousand rows a layer; averaged over `--long-decode-tokens`, so the long prompt's
prefill, which both runs include, cancels), and the throughput of N prompts. portside runs twice: its default (`cpu_attention` auto: MLA decodes in the native
kernel, `csrc/mla.cpp`) and ``cpu_attention=torch`` (the batched-torch decodes of
`backends/cpu/mla.py`); transformers caches the decompressed per-head K/V and runs its eager MHA.

Kernels (`--kernels`): one MLA layer's decode (H heads of 512 + 64 over a bf16 or fp32 latent
cache, batch 1 and 8, contexts 512..4096) in ``portside_cpu_native::mla_decode``, the batched
torch decode and core's reference (`portside.ops.mla.latent_attention`), median of `--repeats`.

    .venv/bin/python ci/bench/mla.py                       # everything
    .venv/bin/python ci/bench/mla.py --skip-e2e            # kernels only
    .venv/bin/python ci/bench/mla.py --skip-kernels --long-len 1024

Writes ci/bench/results/mla.json and mla.md. On a shared machine only ratios within one run are
comparable; the CPU and the load are named in the output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as _platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu import RESULTS, _decode_ms, bench_hf_static, load_info, make_prompts  # noqa: E402
from machine import cpu_details, cpu_name  # noqa: E402

from portside.testing.tiny_deepseek import make_tiny_deepseek  # noqa: E402

SHAPE: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    max_position_embeddings=8192, first_k_dense_replace=4,
)


def bench_portside(path: str, prompts: list[list[int]], long_prompt: list[int], gen: int, decode_tokens: int,
                   long_tokens: int, dtype: str, attention: str) -> dict[str, Any]:  # fmt: skip
    from portside import LLM, SamplingParams

    llm = LLM(model=path, device="cpu", dtype=dtype, max_model_len=len(long_prompt) + long_tokens + 8,
              max_num_seqs=max(16, len(prompts)), max_num_batched_tokens=max(2048, len(long_prompt)),
              enable_prefix_caching=False, platform_options={"cpu_attention": attention})  # fmt: skip

    def run(ps, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        return llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)

    run(prompts[:2], 4)
    runner = llm.engine.executor.runner
    info: dict[str, Any] = {"attention_backend": type(runner.attn_backend).__name__
                            if hasattr(runner, "attn_backend") else "?"}  # fmt: skip
    t = time.perf_counter()
    outs = run(prompts, gen)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == gen for o in outs)
    info.update(output_tok_s=len(prompts) * gen / elapsed)
    info["decode_ms_per_token"] = _decode_ms(lambda n: run(prompts[:1], n), decode_tokens)
    info["decode_long_ms_per_token"] = _decode_ms(lambda n: run([long_prompt], n), long_tokens)
    llm.shutdown()
    gc.collect()
    return info


def bench_transformers(path: str, prompts: list[list[int]], long_prompt: list[int], gen: int, decode_tokens: int,
                       long_tokens: int, dtype: str) -> dict[str, Any]:  # fmt: skip
    """`cpu.py`'s static-batch transformers run, plus batch-1 decode after the long prompt."""
    info = bench_hf_static(path, prompts, gen, decode_tokens, dtype)
    info["decode_long_ms_per_token"] = bench_hf_static(path, [long_prompt], 1, long_tokens, dtype)["decode_ms_per_token"]
    gc.collect()
    return info


def _timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def _layer(dtype: torch.dtype, batch: int, ctx: int, repeats: int) -> dict[str, Any]:
    """One MLA layer's decode of `batch` sequences of `ctx` rows: native kernel, batched torch,
    core's reference (microseconds)."""
    from portside.backends.cpu.mla import native_latent_decode, torch_latent_decode
    from portside.ops import mla as ref
    from portside.testing.conformance.cases import build_metadata

    latent, rope, heads, bs = 512, 64, 16, 16
    d, n = latent + rope, ctx // bs + 1
    tables = [list(range(b * n, (b + 1) * n)) for b in range(batch)]
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(batch * n, bs, d, generator=g).to(dtype)
    md = build_metadata(tuple((ctx - 1, 1) for _ in range(batch)), tables, bs, torch.device("cpu"))
    q = torch.randn(batch, heads, d, generator=g).to(dtype)
    lat = torch.randn(batch, d, generator=g).to(dtype)
    scale = d**-0.5
    native = _timed(lambda: native_latent_decode(q, cache, md.block_tables, md.seq_lens, scale, latent), repeats)
    batched = _timed(lambda: torch_latent_decode(q, cache, md.block_tables, md.seq_lens, ctx, scale, latent), repeats)
    reference = _timed(lambda: ref.latent_attention(q, lat, cache, md, scale, latent), repeats)
    flops = 2 * batch * ctx * heads * (d + latent)
    return {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": ctx, "native_us": native,
            "torch_us": batched, "reference_us": reference, "native_gflops": flops / native / 1e3}


def kernels(repeats: int) -> list[dict[str, Any]]:
    """`_layer` over dtypes, batches and contexts."""
    from portside.backends.cpu import native_ops

    if native_ops.unavailable_reason() is not None:
        print("native kernels unavailable:", native_ops.unavailable_reason())
        return []
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for batch, ctx in ((1, 512), (1, 2048), (1, 4096), (8, 1024)):
            rows.append(_layer(dtype, batch, ctx, repeats))
            print("kernel", json.dumps(rows[-1]), flush=True)
    return rows


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"# MLA (DeepSeek-V2-shaped) on the cpu: portside vs transformers ({m['cpu']})", "",
             f"{m['threads']} threads; load before {result['load_before']}, after {result['load_after']}; "
             f"native score kernel: {result.get('isa', '?')}.", ""]  # fmt: skip
    if result.get("runs"):
        lines += [f"Model: {result['model']}; workload {result['workload']}; {result['dtype']}, random weights.", "",
                  "| engine | tok/s | decode ms/token (short) | decode ms/token (long) | tok/s ratio | decode speedup "
                  "(short) | decode speedup (long) |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        hf = result["runs"]["transformers"]
        for engine, r in result["runs"].items():
            lines.append(f"| {engine} | {r['output_tok_s']:.1f} | {r['decode_ms_per_token']:.2f} | "
                         f"{r['decode_long_ms_per_token']:.2f} | {r['output_tok_s'] / hf['output_tok_s']:.2f}x | "
                         f"{hf['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x | "
                         f"{hf['decode_long_ms_per_token'] / r['decode_long_ms_per_token']:.2f}x |")  # fmt: skip
    if result.get("kernels"):
        lines += ["", "One MLA layer's decode (16 heads of 512 + 64, block size 16), microseconds (median):", "",
                  "| cache | batch | context | native | batched torch | reference | native GFLOP/s | vs torch | vs reference |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in result["kernels"]:
            lines.append(f"| {r['dtype']} | {r['batch']} | {r['context']} | {r['native_us']:.0f} | {r['torch_us']:.0f} | "
                         f"{r['reference_us']:.0f} | {r['native_gflops']:.1f} | {r['torch_us'] / r['native_us']:.1f}x | "
                         f"{r['reference_us'] / r['native_us']:.1f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-decode-tokens", type=int, default=64,
                    help="tokens the long-prompt decode figure averages over (the prompt's prefill noise / this)")
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7, help="kernel timings: the median of this many")
    ap.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (both engines)")
    ap.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (0: torch's default)")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "mla"), help="output path without extension")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), **cpu_details(), "python": _platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cores": os.cpu_count()},
        "load_before": load_info(),
        "dtype": args.dtype,
        "model": SHAPE,
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "long_len": args.long_len,
                     "gen_len": args.gen_len, "decode_tokens": args.decode_tokens,
                     "long_decode_tokens": args.long_decode_tokens},
        "runs": {},
    }
    print("machine:", json.dumps(result["machine"]), flush=True)
    if not args.skip_kernels:
        result["kernels"] = kernels(args.repeats)
    if not args.skip_e2e:
        path = str(make_tiny_deepseek(tempfile.mkdtemp(), "v2", init_std=0.05, **SHAPE))
        prompts = make_prompts(400, args.num_prompts, args.prompt_len)
        long_prompt = make_prompts(400, 1, args.long_len, seed=1)[0]
        runs = result["runs"]
        runs["transformers"] = bench_transformers(path, prompts, long_prompt, args.gen_len, args.decode_tokens,
                                                 args.long_decode_tokens, args.dtype)
        print("transformers", json.dumps(runs["transformers"]), flush=True)
        for name, attention in (("portside", "auto"), ("portside (cpu_attention=torch)", "torch")):
            runs[name] = bench_portside(path, prompts, long_prompt, args.gen_len, args.decode_tokens, args.long_decode_tokens,
                                        args.dtype, attention)
            print(name, json.dumps(runs[name]), flush=True)
    from portside.backends.cpu import native_ops

    result["isa"] = str(torch.ops.portside_cpu_native.mla_isa()) if native_ops.ready() else "unavailable"
    result["load_after"] = load_info()
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(table(result))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
