"""Decode paged-attention bandwidth: GB/s of KV read, per KV-cache dtype.

A decode step reads every cached key and value once, so bytes moved ~= the KV bytes of the batch
(queries, outputs and block tables are negligible). Prints one JSON line per shape and dtype.

    python ci/bench/decode_attention_bw.py [--peak-gbs 4800]          # the Triton kernel on a GPU
    python ci/bench/decode_attention_bw.py --device cpu [--threads 2]  # the cpu backend's native kernel

On the cpu the kernel is `portside.backends.cpu.kernels.paged_decode` over fp32, int8, fp8_e4m3
and fp8_e5m2 caches (`--kv-cache-dtype`), the default model's attention shape (9 query / 3 KV
heads, head size 64) and a larger one; each call reads one of several layer caches in turn, so
the caches are not served from the last-level cache, and the dtypes' rounds are interleaved. "ms"
is the median of `--repeats` timed rounds (min in "ms_min": shared machines are noisy); "cpu_ms"
the process's CPU time per call and thread, which other processes' load does not inflate (their
memory traffic still does).
"""

from __future__ import annotations

import argparse
import json

import torch

from portside.contract import AttentionMetadata

# Peak HBM bandwidth, GB/s, by a substring of the device name (vendor data sheets).
PEAK_GBS = {"H200": 4800, "H100 SXM": 3350, "H100": 2000, "A100-SXM4-80GB": 2039, "A100": 1555, "L40S": 864,
            "MI300X": 5300, "MI250": 3277}


def peak_for(name: str) -> float | None:
    for key, gbs in PEAK_GBS.items():
        if key in name:
            return gbs
    return None


def bench(batch: int, ctx: int, heads: int, kv_heads: int, head: int, block: int, dtype: torch.dtype) -> dict:
    dev = torch.device("cuda")
    blocks_per_seq = -(-ctx // block)
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(2, num_blocks, block, kv_heads, head, dtype=dtype, device=dev)
    tables = torch.randperm(num_blocks - 1, device=dev)[: batch * blocks_per_seq].view(batch, -1).int()
    md = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=dev),  # measure attention only
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        block_tables=tables, max_query_len=1, max_seq_len=ctx, block_size=block, num_decode_tokens=batch,
    )
    q = torch.randn(batch, heads, head, dtype=dtype, device=dev)
    kv = torch.empty(batch, kv_heads, head, dtype=dtype, device=dev)
    from portside.backends.triton.attention import TritonAttentionBackend

    backend = TritonAttentionBackend()
    run = lambda: backend.forward(q, kv, kv, cache, md, head**-0.5)  # noqa: E731
    import triton.testing

    ms = triton.testing.do_bench(run, warmup=25, rep=200)
    moved = 2 * batch * ctx * kv_heads * head * cache.element_size()
    gbs = moved / ms / 1e6
    name = torch.cuda.get_device_name()
    return {"batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads, "head": head, "block": block,
            "dtype": str(dtype).removeprefix("torch."), "ms": round(ms, 4), "GB/s": round(gbs, 1), "device": name}


CPU_DTYPES = {"auto": torch.float32, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _cpu_case(batch: int, ctx: int, heads: int, kv_heads: int, head: int, block: int, kv_dtype: str, layers: int):
    """(one round: a decode call over each of `layers` caches of this dtype, KV bytes one call reads)."""
    from portside.backends.cpu import kernels
    from portside.backends.cpu.attention import NativeAttentionBackend
    from portside.contract import kv_row_bytes

    dtype = CPU_DTYPES[kv_dtype]
    backend = NativeAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-ctx // block)
    num_blocks = batch * blocks_per_seq + 1
    shape = backend.cache_shape(num_blocks, block, kv_heads, head, dtype)
    caches = []
    slots = torch.arange(num_blocks * block, dtype=torch.int64)
    for _ in range(layers):
        cache = backend.allocate_kv_cache(shape, dtype, torch.device("cpu"))
        kv = torch.randn(2, num_blocks * block, kv_heads, head, generator=gen)
        backend.write_kv(cache, kv[0], kv[1], slots)  # quantized as the engine stores it
        caches.append(cache)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_seq].view(batch, -1).int().contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, heads, head, generator=gen)
    out = torch.empty_like(q)
    scale = head**-0.5

    def run() -> None:
        for cache in caches:
            kernels.paged_decode(out, q, cache, tables, lens, scale)

    run()  # warm-up (page faults, thread pool)
    return run, 2 * batch * ctx * kv_heads * kv_row_bytes(head, dtype)


def bench_cpu(shape: tuple[int, ...], kv_dtypes: list[str], layers: int, repeats: int) -> list[dict]:
    """Per dtype: median wall and CPU time of one decode call of the native cpu kernel, the dtypes'
    rounds interleaved (so a change in the machine's load hits every dtype alike)."""
    import statistics
    import time

    cases = {kv: _cpu_case(*shape, kv_dtype=kv, layers=layers) for kv in kv_dtypes}
    times: dict[str, list[float]] = {kv: [] for kv in kv_dtypes}
    cpu_times: dict[str, list[float]] = {kv: [] for kv in kv_dtypes}
    for _ in range(repeats):
        for kv, (run, _) in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            times[kv].append((time.perf_counter() - t0) / layers)
            cpu_times[kv].append((time.process_time() - c0) / layers)
    rows = []
    batch, ctx, heads, kv_heads, head, block = shape
    for kv, (_, moved) in cases.items():
        ms, ms_min = statistics.median(times[kv]) * 1e3, min(times[kv]) * 1e3
        # CPU seconds of the process per call, per thread: what a call costs when it has the
        # cores to itself (robust to other processes, not to their memory traffic)
        cpu_ms = statistics.median(cpu_times[kv]) * 1e3 / torch.get_num_threads()
        rows.append({"batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads, "head": head, "block": block,
                     "kv_cache_dtype": kv, "ms": round(ms, 4), "ms_min": round(ms_min, 4), "cpu_ms": round(cpu_ms, 4),
                     "GB/s": round(moved / ms / 1e6, 2), "GB/s_cpu": round(moved / cpu_ms / 1e6, 2),
                     "threads": torch.get_num_threads()})
    return rows


def main_cpu(args: argparse.Namespace) -> None:
    import os
    import platform

    if args.threads:
        torch.set_num_threads(args.threads)
    from portside.backends.cpu.platform import CpuPlatform

    name = f"{CpuPlatform.device_info().name}, load average {os.getloadavg()[0]:.1f}"
    shapes = [  # (batch, ctx, heads, kv_heads, head, block)
        (1, 1024, 9, 3, 64, 16), (16, 512, 9, 3, 64, 16), (64, 256, 9, 3, 64, 16),
        (64, 1024, 9, 3, 64, 16), (8, 2048, 32, 8, 128, 16),
    ]
    for shape in shapes:
        for row in bench_cpu(shape, args.kv_cache_dtype or list(CPU_DTYPES), args.layers, args.repeats):
            row["device"] = f"{name}, {platform.processor() or platform.machine()}"
            print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peak-gbs", type=float, default=None)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--kv-cache-dtype", action="append", choices=list(CPU_DTYPES), help="cpu: dtypes to run (default: all)")
    ap.add_argument("--threads", type=int, default=None, help="cpu: torch threads (default: torch's)")
    ap.add_argument("--layers", type=int, default=8, help="cpu: caches cycled through per round")
    ap.add_argument("--repeats", type=int, default=15, help="cpu: timed rounds")
    args = ap.parse_args()
    if args.device == "cpu":
        main_cpu(args)
        return
    peak = args.peak_gbs or peak_for(torch.cuda.get_device_name())
    shapes = [  # (batch, ctx, heads, kv_heads, head, block)
        (64, 2048, 32, 8, 128, 16), (256, 1024, 32, 8, 128, 16), (8, 8192, 32, 8, 128, 16),  # split-KV
        (1, 32768, 32, 8, 128, 64), (128, 2048, 9, 3, 64, 16),
    ]
    for shape in shapes:
        row = bench(*shape, dtype=torch.bfloat16)
        row["peak_%"] = round(100 * row["GB/s"] / peak, 1) if peak else None
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
