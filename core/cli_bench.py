"""`portside bench latency` and `portside bench throughput`: offline benchmarks of the engine, as
vLLM's `vllm bench latency` and `vllm bench throughput` name their flags and figures.

Prompts are random token ids (seeded by --seed), decoding is greedy with ignore_eos, so every
request generates exactly --output-len tokens. With --speculative-config both also print the
speculative-decoding figures of the measured requests (`SpecDecodeStats`: drafts, draft tokens,
accepted tokens, mean acceptance length, acceptance per position). --output-json writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

from portside.outputs import RequestOutput, SpecDecodeStats

PERCENTILES = (10, 25, 50, 75, 90, 99)


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def add_bench_parser(sub: Any) -> None:
    """Register `bench` with its `latency` and `throughput` subcommands on the CLI's subparsers."""
    from portside.engine.args_cli import add_engine_args

    bench = sub.add_parser("bench", help="offline latency and throughput benchmarks (random prompts, greedy)")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{latency,throughput}")
    p = kinds.add_parser("latency", help="end-to-end latency of one batch, repeated (as `vllm bench latency`)")
    p.add_argument("--input-len", type=_count(1), default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--output-len", type=_count(1), default=128, help="generated tokens per request (default 128)")
    p.add_argument("--batch-size", type=_count(1), default=8, help="requests in the batch (default 8)")
    p.add_argument("--num-iters-warmup", type=_count(0), default=10, help="unmeasured iterations first (default 10)")
    p.add_argument("--num-iters", type=_count(1), default=30, help="measured iterations (default 30)")
    _add_common(p, add_engine_args)
    p.set_defaults(func=run_latency)
    p = kinds.add_parser("throughput", help="requests and tokens per second of a set of prompts sent at once "
                         "(as `vllm bench throughput`)")
    p.add_argument("--input-len", type=_count(1), default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--output-len", type=_count(1), default=128, help="generated tokens per request (default 128)")
    p.add_argument("--num-prompts", type=_count(1), default=100, help="requests (default 100)")
    _add_common(p, add_engine_args)
    p.set_defaults(func=run_throughput)


def _add_common(p: argparse.ArgumentParser, add_engine_args: Any) -> None:
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--output-json", default=None, metavar="FILE", help="also write the figures to this JSON file")
    add_engine_args(p)


def random_prompts(n: int, input_len: int, vocab_size: int, seed: int) -> list[dict[str, list[int]]]:
    """`n` prompts of `input_len` token ids drawn uniformly from the vocabulary, the same for a seed."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(input_len)]} for _ in range(n)]


def _setup(args: argparse.Namespace, num_prompts: int) -> tuple[Any, Any, list[dict[str, list[int]]]]:
    from portside.engine.args_cli import engine_kwargs
    from portside.engine.llm import LLM
    from portside.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(**{**engine_kwargs(args), "model": args.model})
    tokenizer = llm.get_tokenizer()
    vocab = min(llm.engine.vocab_size, getattr(tokenizer, "vocab_size", None) or llm.engine.vocab_size)
    return llm, params, random_prompts(num_prompts, args.input_len, vocab, args.seed)


def spec_decode_figures(outputs: list[RequestOutput]) -> dict[str, Any]:
    """The speculative-decoding figures of these requests, summed (vLLM's names)."""
    total = SpecDecodeStats()
    for out in outputs:
        if out.spec_decode_stats is not None:
            total.add(out.spec_decode_stats)
    drafts = total.num_drafts
    return {"num_drafts": drafts, "num_draft_tokens": total.num_draft_tokens,
            "num_accepted_tokens": total.num_accepted_tokens, "acceptance_rate": total.acceptance_rate,
            "acceptance_length": total.acceptance_length, "num_accepted_tokens_per_pos": total.num_accepted_tokens_per_pos,
            "acceptance_per_pos": [n / drafts for n in total.num_accepted_tokens_per_pos] if drafts else []}


def _report_spec(args: argparse.Namespace, outputs: list[RequestOutput], result: dict[str, Any]) -> None:
    if not args.speculative_config:
        return
    spec = result["spec_decode"] = spec_decode_figures(outputs)
    print(f"Drafts: {spec['num_drafts']}, draft tokens: {spec['num_draft_tokens']}, "
          f"accepted tokens: {spec['num_accepted_tokens']} (acceptance rate {spec['acceptance_rate']:.1%})")
    print(f"Mean acceptance length: {spec['acceptance_length']:.2f}")
    print("Acceptance per position: " + (" ".join(f"{a:.2f}" for a in spec["acceptance_per_pos"]) or "-"))


def _finish(args: argparse.Namespace, result: dict[str, Any]) -> int:
    result["loadavg_1m"] = os.getloadavg()[0]
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


def run_latency(args: argparse.Namespace) -> int:
    llm, params, prompts = _setup(args, args.batch_size)
    latencies, outputs = [], []
    with llm:
        for _ in range(args.num_iters_warmup):
            llm.generate(prompts, params, use_tqdm=False)
        for _ in range(args.num_iters):
            start = time.perf_counter()
            outputs += llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
    ordered = sorted(latencies)
    percentiles = {str(p): _percentile(ordered, p) for p in PERCENTILES}
    result: dict[str, Any] = {"avg_latency": sum(latencies) / len(latencies), "latencies": latencies,
                              "percentiles": percentiles, "batch_size": args.batch_size,
                              "input_len": args.input_len, "output_len": args.output_len}
    print(f"Avg latency: {result['avg_latency']:.6f} seconds")
    for p, value in percentiles.items():
        print(f"{p}% percentile latency: {value:.6f} seconds")
    _report_spec(args, outputs, result)
    return _finish(args, result)


def _percentile(ordered: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation between ranks (numpy's default)."""
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def run_throughput(args: argparse.Namespace) -> int:
    llm, params, prompts = _setup(args, args.num_prompts)
    with llm:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids or ()) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    result: dict[str, Any] = {"elapsed_time": elapsed, "num_requests": len(outputs), "total_num_tokens": total,
                              "total_output_tokens": output_tokens, "requests_per_second": len(outputs) / elapsed,
                              "tokens_per_second": total / elapsed, "output_tokens_per_second": output_tokens / elapsed}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens: {prompt_tokens}")
    print(f"Total num output tokens: {output_tokens}")
    _report_spec(args, outputs, result)
    return _finish(args, result)
