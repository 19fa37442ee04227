"""Micro-benchmark of the recurrent layers' kernels on cpu: core's pure-torch references
(`portside.ops.recurrent`, what every platform inherits) against the cpu backend's native
operators (`backends/cpu/csrc/recurrent.cpp`, called through `CpuModelOps` as a model calls them),
measured side by side: each repeat runs the reference, then the native kernel, on the same inputs
(each with its own state), and the table keeps each one's fastest repeat and their ratio.

Shapes (fp32 unless --dtype): Mamba-2 (`ssd_scan`, H heads of P = 64, N = 128, one group) and its
causal conv over H*P + 2*N channels (K = 4); Gated DeltaNet (`gated_delta_rule`, Hv = Hk = 16,
K = V = 128) and its conv over 2*Hk*K + Hv*V channels; Mamba-1 (`selective_scan`, Dm = 1536,
N = 16). Each as a 2k-token prefill (one request from a zero state) and a batch-1 decode (one token
from a state). Threads: torch's (`--threads`).

    .venv/bin/python ci/bench/recurrent_kernels.py                       # the table, on stdout
    .venv/bin/python ci/bench/recurrent_kernels.py --out ci/bench/results/recurrent-kernels-zen4.md
    .venv/bin/python ci/bench/recurrent_kernels.py --threads 1 --out ... --append  # a second table

The native library is built first when it is not cached (minutes, on 2 cores).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import cpu_details

from portside.contract import RecurrentMetadata
from portside.ops import recurrent as ref

Step = Callable[[], object]


def _md(tokens: int, init: bool) -> RecurrentMetadata:
    return RecurrentMetadata(state_slots=torch.tensor([0]), has_initial_state=torch.tensor([init]),
                             query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
                             query_start_loc_cpu=[0, tokens], state_slots_cpu=[0], has_initial_state_cpu=[init],
                             num_decodes=int(tokens == 1))


def _pair(kernel: str, ops, args: tuple, state_index: int, kwargs: dict) -> tuple[Step, Step]:
    """(reference, native) calls of `kernel` on the same inputs, each updating its own state."""
    states = [args[state_index].clone() for _ in range(2)]

    def call(fn, state):
        a = list(args)
        a[state_index] = state
        return lambda: fn(*a, **kwargs)

    return call(getattr(ref, kernel), states[0]), call(getattr(ops, kernel), states[1])


def cases(ops, T: int, dtype: torch.dtype) -> list[tuple[str, str, Step, Step]]:
    """(kernel, shape, reference call, native call) for a T-token prefill and a batch-1 decode."""
    out = []
    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    for tokens, init, phase in ((T, False, f"prefill {T}"), (1, True, "decode b=1")):
        md = _md(tokens, init)
        for H in (8, 32):
            P, N = 64, 128
            x, dt, A = randn(tokens, H, P), randn(tokens, H, dt=torch.float32), -torch.rand(H, generator=g) - 0.5
            B, C = randn(tokens, 1, N, scale=N**-0.5), randn(tokens, 1, N, scale=N**-0.5)
            state = randn(1, H, P, N, dt=torch.float32)
            out.append(("ssd_scan", f"Mamba-2 H={H} P={P} N={N}, {phase}",
                        *_pair("ssd_scan", ops, (x, dt, A, B, C, state, md), 5, {"D": torch.ones(H)})))
            conv = H * P + 2 * N
            out.append(("causal_conv1d", f"Mamba-2 H={H} conv {conv} ch K=4, {phase}",
                        *_pair("causal_conv1d", ops, (randn(tokens, conv), randn(conv, 4, dt=torch.float32),
                                                      randn(conv, dt=torch.float32), randn(1, conv, 3, dt=torch.float32), md),
                               3, {})))
        Hk = Hv = 16
        K = V = 128
        q, k, v = randn(tokens, Hk, K), randn(tokens, Hk, K), randn(tokens, Hv, V)
        gate = F.logsigmoid(randn(tokens, Hv, dt=torch.float32) + 2)
        beta = torch.sigmoid(randn(tokens, Hv, dt=torch.float32))
        state = randn(1, Hv, K, V, scale=0.1, dt=torch.float32)
        out.append(("gated_delta_rule", f"GDN Hv=Hk={Hv} K=V={K}, {phase}",
                    *_pair("gated_delta_rule", ops, (q, k, v, gate, beta, state, md, K**-0.5), 5, {})))
        conv = 2 * Hk * K + Hv * V
        out.append(("causal_conv1d", f"GDN conv {conv} ch K=4, {phase}",
                    *_pair("causal_conv1d", ops, (randn(tokens, conv), randn(conv, 4, dt=torch.float32), None,
                                                  randn(1, conv, 3, dt=torch.float32), md), 3, {})))
        Dm, N = 1536, 16
        x, dt = randn(tokens, Dm), randn(tokens, Dm, dt=torch.float32)
        A = -torch.rand(Dm, N, generator=g) - 0.5
        B, C, z = randn(tokens, N, scale=N**-0.5), randn(tokens, N, scale=N**-0.5), randn(tokens, Dm)
        state = randn(1, Dm, N, dt=torch.float32)
        out.append(("selective_scan", f"Mamba-1 Dm={Dm} N={N}, {phase}",
                    *_pair("selective_scan", ops, (x, dt, A, B, C, state, md), 5, {"D": torch.ones(Dm), "z": z})))
    return out


def timed(fn: Step) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(T: int, dtype: torch.dtype, budget_s: float, max_repeats: int) -> list[tuple[str, str, float, float]]:
    """(kernel, shape, reference ms, native ms) per case: fastest of up to `max_repeats` side-by-side
    repeats (fewer when the reference's first call says they would take over `budget_s`)."""
    from portside.backends.cpu.moe import CpuModelOps

    rows = []
    for kernel, shape, ref_call, native_call in cases(CpuModelOps(), T, dtype):
        native_call()  # warm: first-touch pages, OpenMP threads
        first = timed(ref_call)
        repeats = max(1, min(max_repeats, int(budget_s / max(first, 1e-6))))
        best_ref, best_native = first, math.inf
        for _ in range(repeats):
            best_native = min(best_native, timed(native_call))
            best_ref = min(best_ref, timed(ref_call))
            best_native = min(best_native, timed(native_call))
        rows.append((kernel, shape, best_ref * 1e3, best_native * 1e3))
        print(f"  {shape}: reference {best_ref * 1e3:.3f} ms, native {best_native * 1e3:.3f} ms "
              f"({best_ref / best_native:.1f}x)", file=sys.stderr, flush=True)
    return rows


def table(rows, T: int, dtype: torch.dtype, cache_mb: int) -> str:
    from portside.backends.cpu.platform import CpuPlatform

    cpu = cpu_details()
    lines = [
        f"# Recurrent kernels on cpu: core's reference against the native operators ({dtype})",
        "",
        f"- CPU: {cpu.get('model_name')} (family {cpu.get('family')}, model {cpu.get('model')}); "
        f"{CpuPlatform.device_info().name}",
        f"- ISA flags: {' '.join(cpu.get('flags', []))}",
        f"- native vector width: {torch.ops.portside_cpu_native.recurrent_vector_width()} fp32 lanes; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus, "
        f"python {platform.python_version()}",
        f"- caching allocator: {cache_mb} MiB; load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}",
        f"- command: `python ci/bench/recurrent_kernels.py --tokens {T} --dtype {str(dtype).split('.')[-1]} "
        f"--threads {torch.get_num_threads()} --allocator-cache-mb {cache_mb}`",
        "",
        "| kernel | shape | reference ms | native ms | reference / native |",
        "|---|---|---:|---:|---:|",
    ]
    for kernel, shape, r, n in rows:
        lines.append(f"| `{kernel}` | {shape} | {r:.3f} | {n:.3f} | {r / n:.1f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="prefill length")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="activations' dtype")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--budget-s", type=float, default=6.0, help="about how long the reference may run per case")
    ap.add_argument("--repeats", type=int, default=5, help="side-by-side repeats per case, at most")
    ap.add_argument("--allocator-cache-mb", type=int, default=None,
                    help="the native caching allocator's cache (default: the engine's; 0: glibc's malloc)")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    ap.add_argument("--append", action="store_true", help="add the table to --out instead of replacing it")
    args = ap.parse_args(argv)
    from portside.backends.cpu import native_ops
    from portside.backends.cpu.options import DEFAULT_ALLOCATOR_CACHE_MB
    from portside.backends.cpu.platform import install_caching_allocator

    reason = native_ops.unavailable_reason()  # builds the library when it is not cached
    if reason is not None:
        sys.exit(f"the native cpu operators are unavailable: {reason}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cache_mb = DEFAULT_ALLOCATOR_CACHE_MB if args.allocator_cache_mb is None else args.allocator_cache_mb
    install_caching_allocator(cache_mb)
    dtype = getattr(torch, args.dtype)
    text = table(run(args.tokens, dtype, args.budget_s, args.repeats), args.tokens, dtype, cache_mb)
    print(text)
    if args.out is not None:
        with args.out.open("a" if args.append else "w") as f:
            f.write(("\n" if args.append else "") + text)


if __name__ == "__main__":
    main()
