"""GGUF decode kernels side by side: one weight matrix (default 5632 x 2048, a Llama-1B MLP's
down projection transposed: N 5632 outputs of K 2048), one token row, one thread (default),
the fp32-activation kernel (``portside_cpu_native::quant_linear``, `csrc/quant_gemm.cpp`) against
the int8-activation one (``portside_cpu_native::gguf_dot``, `csrc/gguf_dot*.cpp`) on each of its
instruction-set paths; times are the median of many calls, made in turn, the weight streamed
from memory each call (several copies cycled, together larger than the last-level cache);
GB/s: the packed bytes over the best int8 time. The weights lie on transparent huge pages
(`host_zeros`), as the engine's packed weights do (on 4 KiB pages a stream reads ~25% slower).

    python ci/bench/gguf_act_kernels.py [--n 5632] [--k 2048] [--rows 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from portside.backends.cpu import gguf_dot, native_ops, quant
from portside.contract import host_zeros
from portside.quant.gguf_blocks import block_shape

TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_XS": 23}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _weights(ggml_type: int, n: int, k: int, copies: int) -> list[torch.Tensor]:
    size, nbytes = block_shape(ggml_type)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(copies):
        raw = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
        raw[:, :, 0:2] = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)  # finite scales
        if ggml_type in (12, 13):
            raw[:, :, 2:4] = raw[:, :, 0:2]
        if ggml_type == 14:
            raw[:, :, 208:210] = raw[:, :, 0:2]
        w = host_zeros(raw.size).view(n, -1)  # on huge pages, as the engine packs weights (weights.py)
        w.copy_(torch.from_numpy(raw.reshape(n, -1)))
        out.append(w)
    return out


def _time(fns: dict[str, Callable[[torch.Tensor], object]], ws: list[torch.Tensor], reps: int) -> dict[str, float]:
    """Median seconds per call of each of `fns`, called in turn (so a busy machine slows them alike),
    each call on the next weight copy (streamed from memory, not from the last-level cache)."""
    for fn in fns.values():
        for w in ws:
            fn(w)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps):
        for j, (k, fn) in enumerate(fns.items()):
            w = ws[(i * len(fns) + j) % len(ws)]  # a copy no call touched lately
            t0 = time.perf_counter()
            fn(w)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--types", default=",".join(TYPES))
    args = ap.parse_args()
    if native_ops.unavailable_reason() is not None:
        raise SystemExit(f"the native library is unavailable: {native_ops.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    x = torch.randn(args.rows, args.k)
    print(f"CPU: {_cpu()}; threads {args.threads}; W {args.n} x {args.k}; {args.rows} row(s); "
          f"quant_gemm paths: {quant.isa()}; gguf_dot paths: {','.join(gguf_dot.isas())}")
    print(f"{'type':7} {'MB':>6} {'fp32-act us':>12} " + " ".join(f"{'int8 ' + p + ' us':>16}" for p in gguf_dot.isas()
                                                                    if p != "scalar") + f" {'fp32/int8(best)':>16} {'GB/s':>8}")
    for name in args.types.split(","):
        t = TYPES[name]
        ws = _weights(t, args.n, args.k, copies=max(2, (256 << 20) // (args.n * args.k)))
        mb = ws[0].numel() / 1e6
        fns: dict[str, Callable[[torch.Tensor], object]] = {}
        if t in quant.GGUF_KERNELS:
            fns["fp32"] = lambda w, t=t: torch.ops.portside_cpu_native.quant_linear(x, w, None, None, None,
                                                                                   quant.FMT_GGUF + t, 0)
        paths = [p for p in gguf_dot.isas() if p != "scalar"]  # (scalar: the portable fallback, ~40x slower)
        for p in paths:
            fns[p] = lambda w, t=t, p=p: gguf_dot.linear(x, w, t, isa=p)
        per = _time(fns, ws, args.reps)
        best = min(per[p] for p in paths)
        ratio = f"{per['fp32'] / best:16.2f}" if "fp32" in per else f"{'-':>16}"
        fp32 = f"{per['fp32'] * 1e6:12.0f}" if "fp32" in per else f"{'-':>12}"
        print(f"{name:7} {mb:6.1f} {fp32} " + " ".join(f"{per[p] * 1e6:16.0f}" for p in paths) + f" {ratio}"
              f" {mb / 1e3 / best:8.1f}")


if __name__ == "__main__":
    main()
