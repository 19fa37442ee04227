"""Embedding throughput: portside against sentence-transformers on the same machine, in one run.

1,000 inputs of 128 tokens each through one sentence-transformers folder, random weights built
locally: by default an all-MiniLM-L6-v2-shaped BERT (hidden 384, 6 layers, 12 heads, mean pooling,
Normalize); `--arch qwen3` a Qwen3-Embedding-shaped decoder (last-token pooling) of the same
width; `--dtype` for both engines. portside: `LLM.embed` of all inputs at once (the scheduler
batches them); sentence-transformers: `encode` with its default batch size (`--st-batch-size`).
Both in this process, with the same torch threads, each warmed up first, their runs alternated
(so a change in the machine's load falls on both); the figure is inputs/s, best of `--repeats`.
The embeddings are checked to agree (cosine) so the two compute the same thing.

    python ci/bench/pooling.py                  # writes ci/bench/results/pooling.json and .md
    python ci/bench/pooling.py --inputs 200 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_details, cpu_name  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)


def build_folder(root: Path, arch: str) -> Path:
    from portside.testing.tiny import make_tiny_model
    from portside.testing.tiny_encoder import make_tiny_encoder
    from portside.testing.tiny_pooling import make_tiny_st_folder

    if arch == "bert":
        base = make_tiny_encoder(root / "base", "bert", max_position_embeddings=512, **SHAPE)
        return make_tiny_st_folder(root / "st", base, pooling_mode="mean")
    base = make_tiny_model(root / "base", "qwen3", num_key_value_heads=4, head_dim=32, **SHAPE)
    return make_tiny_st_folder(root / "st", base, pooling_mode="lasttoken")


def make_texts(path: Path, n: int, tokens: int) -> tuple[list[str], float]:
    """`n` distinct texts of about `tokens` tokens each (special tokens included), and their mean length."""
    from transformers import AutoTokenizer

    from portside.testing.tiny_tokenizer import _CORPUS

    tok = AutoTokenizer.from_pretrained(str(path))
    words = _CORPUS.split()
    special = len(tok("x").input_ids) - len(tok("x", add_special_tokens=False).input_ids)
    texts = []
    for i in range(n):
        start = (i * 7) % len(words)
        ids = tok(" ".join((words * 4)[start : start + tokens * 2]), add_special_tokens=False).input_ids
        texts.append(tok.decode(ids[: tokens - special]))
    lengths = [len(tok(t).input_ids) for t in texts]
    return texts, sum(lengths) / len(lengths)


def timed(fn: Any, cpu: list[float] | None = None) -> float:
    """Wall seconds of `fn()`; with `cpu`, its process CPU seconds (all threads) appended."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["bert", "qwen3"], default="bert")
    ap.add_argument("--inputs", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--st-batch-size", type=int, default=32)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both engines' (default fp32)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default=str(RESULTS / "pooling"))
    args = ap.parse_args()

    from sentence_transformers import SentenceTransformer

    from portside import LLM

    load_before = os.getloadavg()[0]  # a shared machine: other work slows both engines (their runs alternate)
    with tempfile.TemporaryDirectory(prefix="pooling-bench-") as tmp:
        path = build_folder(Path(tmp), args.arch)
        texts, mean_len = make_texts(path, args.inputs, args.tokens)
        dtype = getattr(torch, args.dtype)
        st = SentenceTransformer(str(path), device="cpu").to(dtype)
        st.encode(texts[:64], batch_size=args.st_batch_size)  # warm-up
        want = torch.tensor(st.encode(texts[:32]))
        with LLM(model=str(path), device="cpu", dtype=args.dtype, max_model_len=512,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256) as llm:
            llm.embed(texts[:64], use_tqdm=False)  # warm-up
            got = torch.tensor([o.outputs.embedding for o in llm.embed(texts[:32], use_tqdm=False)])
            st_times, ps_times, st_cpu, ps_cpu = [], [], [], []  # type: ignore[var-annotated]
            for _ in range(args.repeats):
                st_times.append(timed(lambda: st.encode(texts, batch_size=args.st_batch_size), st_cpu))
                ps_times.append(timed(lambda: llm.embed(texts, use_tqdm=False), ps_cpu))
        st_rate, ps_rate = len(texts) / min(st_times), len(texts) / min(ps_times)
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double()).min().item()
    result = {
        "arch": args.arch, "dtype": args.dtype, "shape": SHAPE, "inputs": args.inputs, "mean_tokens": round(mean_len, 1),
        "torch_threads": torch.get_num_threads(), "cpu": cpu_name(), "cpu_details": cpu_details(),
        "portside_inputs_per_s": round(ps_rate, 1), "sentence_transformers_inputs_per_s": round(st_rate, 1),
        "st_batch_size": args.st_batch_size, "max_num_batched_tokens": args.max_num_batched_tokens,
        "ratio": round(ps_rate / st_rate, 2), "min_cosine": cos,
        # CPU seconds (both engines' threads) per run, min over repeats: on a shared machine the
        # wall figures move with other work; these much less
        "portside_cpu_s": round(min(ps_cpu), 2), "sentence_transformers_cpu_s": round(min(st_cpu), 2),
        "cpu_time_ratio": round(min(st_cpu) / min(ps_cpu), 2),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"# Embedding throughput ({args.arch}, {args.dtype}, {args.inputs} inputs of ~{mean_len:.0f} tokens)\n\n"
        f"CPU: {result['cpu']}; torch threads {result['torch_threads']}; 1-min load average "
        f"{result['load_average_1min'][0]} before, {result['load_average_1min'][1]} after\n\n"
        "| engine | inputs/s |\n|---|---|\n"
        f"| portside (LLM.embed, max_num_batched_tokens {args.max_num_batched_tokens}) | {ps_rate:.1f} |\n"
        f"| sentence-transformers (encode, batch {args.st_batch_size}) | {st_rate:.1f} |\n\n"
        f"portside / sentence-transformers: **{ps_rate / st_rate:.2f}x** (issue 49's target: >= 1.5x); "
        f"embeddings agree to cosine >= {cos:.6f}\n\n"
        f"CPU seconds per run (all threads, best run): portside {result['portside_cpu_s']}, sentence-transformers "
        f"{result['sentence_transformers_cpu_s']} ({result['cpu_time_ratio']}x)\n")


if __name__ == "__main__":
    main()
