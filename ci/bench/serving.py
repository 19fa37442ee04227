"""Serving benchmark: a concurrency sweep against a running `portside serve`.

For each concurrency level C, C clients each send streamed completions back to back until
`--requests` have been sent in total. Reported per level: requests/s, output tokens/s, and
percentiles of time-to-first-token (TTFT) and inter-token latency (ITL, the gap between streamed
chunks). Results go to a JSON file and a PNG plot.

    portside serve MODEL --port 8000 &
    python ci/bench/serving.py --url http://127.0.0.1:8000 --model MODEL_NAME \
        --concurrency 1 2 4 8 16 --requests 64 --max-tokens 64 --out bench/serving
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

PROMPTS = [
    "Write a short story about a harbour town at dawn.",
    "Explain how a paged KV cache works in an inference server.",
    "List three things a ship's carpenter needs and why.",
    "Describe the market of a small fishing town in the morning.",
]


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds to the first content chunk
    latency: float = 0.0  # seconds to the end of the stream
    itls: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    latency_ms: dict[str, float]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99")}
    s = sorted(values)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] * 1000

    return {"mean": statistics.fmean(s) * 1000, "p50": pct(50), "p90": pct(90), "p99": pct(99)}


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: str) -> RequestResult:
    body = {
        "model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if not event["choices"] or not event["choices"][0]["text"]:
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError:
        pass
    return result


async def run_level(args: argparse.Namespace, concurrency: int) -> LevelResult:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    counter = iter(range(args.requests))
    results: list[RequestResult] = []
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600, limits=limits) as client:

        async def worker() -> None:
            for i in counter:
                results.append(await one_request(client, args, PROMPTS[i % len(PROMPTS)]))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        failed=len(results) - len(ok),
        duration_s=duration,
        requests_per_s=len(ok) / duration,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration,
        ttft_ms=percentiles([r.ttft for r in ok]),
        itl_ms=percentiles([g for r in ok for g in r.itls]),
        latency_ms=percentiles([r.latency for r in ok]),
    )


def plot(levels: list[LevelResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [lv.concurrency for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].plot(c, [lv.output_tokens_per_s for lv in levels], "o-", label="output tokens/s")
    ax2 = axes[0].twinx()
    ax2.plot(c, [lv.requests_per_s for lv in levels], "s--", color="tab:orange", label="requests/s")
    axes[0].set_ylabel("output tokens/s")
    ax2.set_ylabel("requests/s")
    axes[0].set_title("throughput")
    for ax, key, name in ((axes[1], "ttft_ms", "time to first token"), (axes[2], "itl_ms", "inter-token latency")):
        for p in ("p50", "p90", "p99"):
            ax.plot(c, [getattr(lv, key)[p] for lv in levels], "o-", label=p)
        ax.set_ylabel("ms")
        ax.set_title(name)
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default="serving_bench", help="output path prefix (.json and .png are added)")
    p.add_argument("--title", default=None, help="plot title (default: model and URL)")
    args = p.parse_args()

    levels = []
    for c in args.concurrency:
        lv = asyncio.run(run_level(args, c))
        levels.append(lv)
        print(
            f"c={c:4d}  {lv.requests_per_s:7.2f} req/s  {lv.output_tokens_per_s:8.1f} tok/s  "
            f"TTFT p50 {lv.ttft_ms['p50']:8.1f} p99 {lv.ttft_ms['p99']:8.1f} ms  "
            f"ITL p50 {lv.itl_ms['p50']:7.1f} p99 {lv.itl_ms['p99']:7.1f} ms  failed {lv.failed}",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"url": args.url, "model": args.model, "requests_per_level": args.requests, "max_tokens": args.max_tokens}
    out.with_suffix(".json").write_text(json.dumps({"config": meta, "levels": [asdict(lv) for lv in levels]}, indent=2))
    plot(levels, out.with_suffix(".png"), args.title or f"portside serve: {args.model}")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
