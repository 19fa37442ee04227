"""cpu benchmark of one mixture-of-experts model: portside against transformers, side by side.

The model: a random-weight Qwen3-MoE of a small real shape (hidden 512, 8 layers, 16 experts of
width 384, top-4 renormalised, 8/4 heads of 64, the tiny test tokenizer's vocabulary), fp32.
Workload as `cpu.py`'s (N prompts x P tokens -> G new tokens, EOS ignored) plus batch-1 decode
ms/token. Peers: transformers `generate` (static batch) and portside's cpu engine (eager).

The batch-1 decode bound counts the bytes one token reads: every dense weight plus its top-k
experts' (a decode touches top_k of num_experts experts per layer), at the read bandwidth
measured around the decode.

    /work/venv/bin/python ci/bench/moe.py                            # default workload
    /work/venv/bin/python ci/bench/moe.py --num-prompts 8 --gen-len 32   # quick

Writes JSON (default ci/bench/results/moe.json). Random weights: speed only, no quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as _platform
import tempfile
from pathlib import Path
from typing import Any

import torch
from cpu import RESULTS, bench_hf_static, bench_portside, load_info, make_prompts, measure_machine, model_facts

from portside.testing.tiny import make_tiny_model

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             intermediate_size=1024, moe_intermediate_size=384, num_experts=16, num_experts_per_tok=4,
             norm_topk_prob=True, max_position_embeddings=2048)


def decode_bytes_per_token(path: str) -> int:
    """fp32 bytes a batch-1 decode step reads: dense weights once, top_k / E of the experts."""
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    dense = experts = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = 1
                for s in st.get_slice(k).get_shape():
                    n *= int(s)
                if ".experts." in k:
                    experts += n
                elif "embed_tokens" not in k or cfg.tie_word_embeddings:
                    dense += n  # the embedding lookup reads one row; a tied matrix is the LM head
    return 4 * (dense + experts * cfg.num_experts_per_tok // cfg.num_experts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--paths", default="eager", help="portside cpu graph modes (eager, inductor)")
    ap.add_argument("--out", default=str(RESULTS / "moe"), help="output path without extension")
    args = ap.parse_args(argv)

    from portside.backends.cpu.platform import CpuPlatform, configure_threads

    configure_threads()
    path = str(make_tiny_model(tempfile.mkdtemp(), "qwen3_moe", **SHAPE))
    result: dict[str, Any] = {
        "machine": {"cpu": CpuPlatform.device_info().name, "python": _platform.python_version(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "cores": os.cpu_count(),
                    **measure_machine()},
        "load_before": load_info(),
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len},
        "model": {"shape": SHAPE, "params": model_facts(path)["params"],
                  "decode_bytes_per_token": decode_bytes_per_token(path)},
        "runs": {},
    }
    print("machine:", json.dumps(result["machine"]), flush=True)
    prompts = make_prompts(SHAPE.get("vocab_size", 400), args.num_prompts, args.prompt_len)
    jobs = [("transformers-static", lambda: bench_hf_static(path, prompts, args.gen_len, args.decode_tokens))]
    for mode in args.paths.split(","):
        jobs.append((f"portside-{mode}", lambda mode=mode: bench_portside(path, prompts, args.gen_len, mode, "auto",
                                                                            args.decode_tokens)))
    for name, job in jobs:
        info = job()
        bound_ms = 1000 * result["model"]["decode_bytes_per_token"] / (info["decode_read_bandwidth_gbs"] * 1e9)
        info["decode_vs_bound"] = info["decode_ms_per_token"] / bound_ms
        result["runs"][name] = info
        print(name, json.dumps(info), flush=True)
        gc.collect()
    hf = result["runs"]["transformers-static"]
    result["summary"] = {
        name: {"output_tok_s": round(r["output_tok_s"], 1), "vs_transformers": round(r["output_tok_s"] / hf["output_tok_s"], 2),
               "decode_ms_per_token": round(r["decode_ms_per_token"], 2),
               "decode_speedup_vs_transformers": round(hf["decode_ms_per_token"] / r["decode_ms_per_token"], 2),
               "decode_vs_bound_then": round(r["decode_vs_bound"], 2)}
        for name, r in result["runs"].items()
    }
    out = Path(args.out).with_suffix(".json")
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=2))
    return result


if __name__ == "__main__":
    main()
