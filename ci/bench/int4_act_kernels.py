"""int4 (GPTQ/AWQ) decode kernels side by side: one weight matrix (default 5632 x 2048, a Llama-1B
MLP's down projection transposed: N 5632 outputs of K 2048), canonical int4 codes with fp32 scales
and zero points per group, one token row, one thread (default): the fp32-activation kernel
(``portside_cpu_native::quant_linear``, `csrc/quant_gemm.cpp`) against the int8-activation one
(``portside_cpu_native::int4_dot``, `csrc/int4_dot.cpp`) on each of its SIMD paths, and both
against the bandwidth bound (the bytes a call reads: codes, scales and zero points, over the read
bandwidth of a sum over 256 MiB, measured before and after, the faster taken). Times: the median
of many calls made in turn (a busy machine slows them alike), each on a weight copy no call read
lately (the copies together larger than the last-level cache).

Then the same for int8 weight-only per channel: the fp32-activation kernel against the W8A8 one
(``quant_linear_w8a8``, activations rounded per token: what ``cpu_int8_act=int8`` runs).

    python ci/bench/int4_act_kernels.py [--n 5632] [--k 2048] [--groups 128,32] [--rows 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from gguf_act_kernels import _cpu, _time

from portside.backends.cpu import gguf_dot, int4_dot, native_ops, quant
from portside.quant.weight import pack_int4

Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scales, zero points


def _weights(n: int, k: int, group: int, copies: int) -> list[Weight]:
    g = torch.Generator().manual_seed(0)
    return [(pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)).contiguous(),
             torch.rand(n, k // group, generator=g) * 1e-2, torch.randint(0, 16, (n, k // group), generator=g).float())
            for _ in range(copies)]


def read_bandwidth(mib: int = 256) -> float:
    """GB/s of the fastest of 5 sums over `mib` MiB of fp32 (this thread count)."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--groups", default="128,32")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if native_ops.unavailable_reason() is not None:
        raise SystemExit(f"the native library is unavailable: {native_ops.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    x = torch.randn(args.rows, args.k)
    bw = read_bandwidth()
    paths = [p for p in gguf_dot.isas() if p != "scalar"]  # (scalar: the portable fallback)
    print(f"CPU: {_cpu()}; threads {args.threads}; W {args.n} x {args.k}; {args.rows} row(s); "
          f"quant_gemm paths: {quant.isa()}; int4_dot paths: {','.join(gguf_dot.isas())}")
    rows = []
    for group in (int(s) for s in args.groups.split(",")):
        ws = _weights(args.n, args.k, group, copies=max(2, (256 << 20) // (args.n * args.k)))
        nbytes = sum(t.numel() * t.element_size() for t in ws[0])
        fns: dict[str, Callable[[Weight], object]] = {
            "fp32": lambda w, group=group: torch.ops.portside_cpu_native.quant_linear(x, w[0], w[1], w[2], None,
                                                                                      quant.FMT_INT4, group)}
        for p in paths:
            fns[p] = lambda w, group=group, p=p: int4_dot.linear(x, w[0], w[1], w[2], group, isa=p)
        rows.append((group, nbytes, _time(fns, ws, args.reps)))  # type: ignore[arg-type]
    bw = max(bw, read_bandwidth())
    print(f"read bandwidth {bw:.1f} GB/s")
    print(f"{'group':>5} {'MB':>6} {'bound us':>9} {'fp32-act us':>12} " + " ".join(f"{'int8 ' + p + ' us':>16}" for p in paths)
          + f" {'fp32/int8(best)':>16} {'int8/bound':>11} {'fp32/bound':>11}")
    for group, nbytes, per in rows:
        bound = nbytes / bw / 1e9
        best = min(per[p] for p in paths)
        print(f"{group:5d} {nbytes / 1e6:6.2f} {bound * 1e6:9.0f} {per['fp32'] * 1e6:12.0f} "
              + " ".join(f"{per[p] * 1e6:16.0f}" for p in paths)
              + f" {per['fp32'] / best:16.2f} {best / bound:11.2f} {per['fp32'] / bound:11.2f}")
    # int8 weight-only, per channel: fp32 activations vs the W8A8 kernel (per-token int8 activations)
    g = torch.Generator().manual_seed(1)
    w8 = [(torch.randint(0, 256, (args.n, args.k), generator=g, dtype=torch.uint8), torch.rand(args.n, 1, generator=g) * 1e-2,
           torch.full((args.n, 1), 128.0)) for _ in range(max(2, (256 << 20) // (args.n * args.k)))]
    nbytes = sum(t.numel() * t.element_size() for t in w8[0])
    per = _time({"fp32": lambda w: torch.ops.portside_cpu_native.quant_linear(x, w[0], w[1], w[2], None, quant.FMT_INT8, args.k),
                 "w8a8": lambda w: torch.ops.portside_cpu_native.quant_linear_w8a8(x, w[0], w[1], w[2], None, None, args.k)},
                w8, args.reps)  # type: ignore[arg-type]
    bound = nbytes / bw / 1e9
    print(f"int8 per channel: {nbytes / 1e6:.2f} MB, bound {bound * 1e6:.0f} us, fp32-act {per['fp32'] * 1e6:.0f} us, "
          f"w8a8 {per['w8a8'] * 1e6:.0f} us: fp32/w8a8 {per['fp32'] / per['w8a8']:.2f}, w8a8/bound {per['w8a8'] / bound:.2f}")


if __name__ == "__main__":
    main()
