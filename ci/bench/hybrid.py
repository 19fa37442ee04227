"""cpu benchmark of hybrid models (recurrent layers beside attention): portside against transformers,
side by side in one run.

Models (random weights, the tiny test tokenizer's vocabulary, fp32; `--archs` picks):
- `qwen3_next`: Qwen3-Next-80B-A3B's proportions, hidden 1024, 8 layers (6 Gated DeltaNet, 2 gated
  attention), GDN 8 key / 16 value heads of 128, attention 8 / 2 heads of 256, 64 experts top-8 of
  256 and a shared expert of 512;
- `granite_hybrid`: Granite-4.0-H-Tiny's proportions, hidden 1024, 8 layers (6 Mamba-2, 2 attention),
  Mamba-2 32 heads of 64 with state 128, attention 8 / 2 heads of 128, a shared MLP of 1024 and 64
  experts top-6 of 512.

Figures, per model: throughput (N prompts x P tokens -> G new tokens, EOS ignored), batch-1 decode
ms/token, and the prefill of one 2k-token prompt (portside: generate 1 token; transformers: one
forward over the prompt, no generation), each the best of `--repeats`.

    .venv/bin/python ci/bench/hybrid.py                                  # everything
    .venv/bin/python ci/bench/hybrid.py --archs qwen3_next --num-prompts 8 --gen-len 16   # quick

Writes ci/bench/results/hybrid.json and hybrid.md. On a shared machine only ratios within one run
are comparable; the CPU is named in the output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as _platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu import RESULTS, _best, _decode_ms, _hf_model, bench_hf_static, load_info, make_prompts  # noqa: E402
from machine import cpu_details, cpu_name  # noqa: E402

from portside.engine.kv_report import cache_report  # noqa: E402
from portside.testing.tiny_hybrid import REAL_SHAPED, make_tiny_hybrid, write_real_shaped_config  # noqa: E402

# Layer shapes in real checkpoints' proportions, scaled to 8 layers of hidden 1024: real head dims and
# state sizes (they set the recurrent kernels' share of a step), experts where the family has them.
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Qwen3-Next-80B-A3B: GDN 16/32 heads of 128, attention 16/2 heads of 256, 512 experts top-10 of 512 + shared
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=1024, num_hidden_layers=8, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, max_position_embeddings=4096,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, shared_expert_intermediate_size=512,
        norm_topk_prob=True, intermediate_size=2816, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)),
    # Granite-4.0-H-Tiny: Mamba-2 48 heads of 64 with state 128 (chunk 256), attention 12/4 heads of 128, a
    # shared MLP and 64 experts top-6 of 512
    "granite_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        hidden_size=1024, num_hidden_layers=8, mamba_n_heads=32, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=4096, num_local_experts=64, num_experts_per_tok=6, intermediate_size=512,
        shared_intermediate_size=1024, layer_types=(["mamba"] * 3 + ["attention"]) * 2, position_embedding_type="rope")),
}


def _post_init(model: torch.nn.Module) -> None:
    """Sane decay ranges for the re-drawn state-space parameters (A_log, dt_bias)."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.linspace(1, 16, p.numel())).reshape(p.shape))
        elif name.endswith("dt_bias"):
            p.copy_(torch.full_like(p, -2.0))


def bench_portside(path: str, prompts: list[list[int]], gen: int, decode_tokens: int, prefill: list[int],
                   repeats: int, dtype: str = "float32") -> dict[str, Any]:
    from portside import LLM, SamplingParams

    llm = LLM(model=path, device="cpu", dtype=dtype, max_model_len=max(len(prefill), len(prompts[0]) + gen) + 8,
              max_num_seqs=max(16, len(prompts)), max_num_batched_tokens=2048, enable_prefix_caching=False)

    def run(ps, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        return llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)

    run(prompts[:2], 4)
    runner = llm.engine.executor.runner
    info: dict[str, Any] = {"graph": runner.graph_runner.name, "model_ops": type(runner.platform.model_ops(runner.config)).__name__}
    t = time.perf_counter()
    outs = run(prompts, gen)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == gen for o in outs)
    info.update(output_tok_s=len(prompts) * gen / elapsed, throughput_s=elapsed)
    info["decode_ms_per_token"] = _decode_ms(lambda n: run(prompts[:1], n), decode_tokens)
    run([prefill[:256]], 1)
    info["prefill_2k_s"] = _best(lambda: run([prefill], 1), repeats)
    llm.shutdown()
    gc.collect()
    return info


def bench_transformers(path: str, prompts: list[list[int]], gen: int, decode_tokens: int, prefill: list[int],
                       repeats: int, dtype: str = "float32") -> dict[str, Any]:
    """`cpu.py`'s static-batch transformers run, plus one forward over the 2k-token prompt."""
    info = bench_hf_static(path, prompts, gen, decode_tokens, dtype)
    model = _hf_model(path, dtype)
    x = torch.tensor([prefill])

    def forward():
        with torch.inference_mode():
            model(x, use_cache=False, logits_to_keep=1)

    forward()
    info["prefill_2k_s"] = _best(forward, repeats)
    model = None  # noqa: F841 (frees the weights before the next run)
    gc.collect()
    return info


def memory(budget: float = 8 * 2**30, seq: int = 4096) -> dict[str, Any]:
    """The KV budget report of real-shaped 24-layer models (18 recurrent layers) against the same models
    with attention in every layer: sequences of `seq` tokens in `budget` bytes, bf16, SSM state auto / fp32."""
    rows: dict[str, Any] = {}
    for family in REAL_SHAPED:
        with tempfile.TemporaryDirectory() as d:
            hybrid = write_real_shaped_config(Path(d) / "h", family, True)
            full = cache_report(write_real_shaped_config(Path(d) / "f", family, False), torch.bfloat16).sequences(budget, seq)
            for state in ("auto", "float32"):
                n = cache_report(hybrid, torch.bfloat16, mamba_ssm_cache_dtype=state).sequences(budget, seq)
                rows[f"{family} (state {state})"] = {"hybrid": n, "all_attention": full, "ratio": n / full}
    return rows


def table(result: dict[str, Any]) -> str:
    lines = [f"# Hybrid models on the cpu: portside vs transformers ({result['machine']['cpu']})", "",
             f"{result['machine']['threads']} threads; workload {result['workload']}; {result['dtype']}, random weights.",
             "",
             "| model | engine | tok/s | decode ms/token | prefill 2k s | tok/s ratio | decode speedup | prefill speedup |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for arch, runs in result["runs"].items():
        hf = runs["transformers"]
        for engine, r in runs.items():
            lines.append(f"| {arch} | {engine} | {r['output_tok_s']:.1f} | {r['decode_ms_per_token']:.2f} | "
                         f"{r['prefill_2k_s']:.3f} | {r['output_tok_s'] / hf['output_tok_s']:.2f}x | "
                         f"{hf['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x | "
                         f"{hf['prefill_2k_s'] / r['prefill_2k_s']:.2f}x |")
    lines += ["", "KV budget: sequences of 4096 tokens in 8 GiB, bf16, 24 layers (18 recurrent) vs attention in every layer",
              "", "| model | hybrid | all attention | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['hybrid']} | {v['all_attention']} | {v['ratio']:.2f}x |" for k, v in result["memory"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default=",".join(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (both engines)")
    ap.add_argument("--out", default=str(RESULTS / "hybrid"), help="output path without extension")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), **cpu_details(), "python": _platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cores": os.cpu_count()},
        "load_before": load_info(),
        "dtype": args.dtype,
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                     "prefill_len": args.prefill_len},
        "runs": {},
        "memory": memory(),
    }
    print("machine:", json.dumps(result["machine"]), flush=True)
    for arch in args.archs.split(","):
        config_cls, architecture, shape = SHAPES[arch]
        path = str(make_tiny_hybrid(tempfile.mkdtemp(), config_cls, architecture, post_init=_post_init, init_std=0.05,
                                    **shape))
        prompts = make_prompts(400, args.num_prompts, args.prompt_len)
        prefill = make_prompts(400, 1, args.prefill_len, seed=1)[0]
        runs = result["runs"][arch] = {}
        for name, fn in (("transformers", bench_transformers), ("portside", bench_portside)):
            runs[name] = fn(path, prompts, args.gen_len, args.decode_tokens, prefill, args.repeats, args.dtype)
            print(arch, name, json.dumps(runs[name]), flush=True)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(table(result))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
