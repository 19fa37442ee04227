"""Decode paged-attention bandwidth of the Triton kernel on a GPU: GB/s and % of the GPU's peak.

A decode step reads every cached key and value once, so bytes moved ~= the KV bytes of the batch
(queries, outputs and block tables are negligible). Prints one JSON line per shape.

    python ci/bench/decode_attention_bw.py [--peak-gbs 4800]
"""

from __future__ import annotations

import argparse
import json

import torch

from portside.backend_api import AttentionMetadata
from portside.backends.triton.attention import TritonAttentionBackend

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
    backend = TritonAttentionBackend()
    run = lambda: backend.forward(q, kv, kv, cache, md, head**-0.5)  # noqa: E731
    import triton.testing

    ms = triton.testing.do_bench(run, warmup=25, rep=200)
    moved = 2 * batch * ctx * kv_heads * head * cache.element_size()
    gbs = moved / ms / 1e6
    name = torch.cuda.get_device_name()
    return {"batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads, "head": head, "block": block,
            "dtype": str(dtype).removeprefix("torch."), "ms": round(ms, 4), "GB/s": round(gbs, 1), "device": name}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peak-gbs", type=float, default=None)
    args = ap.parse_args()
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
