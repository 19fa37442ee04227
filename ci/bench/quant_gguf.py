"""GGUF formats side by side with llama.cpp (`ci/bench/quant.py`'s first table; issue 48's "Done when").

Per format (Q8_0, Q4_0, Q4_K_M) one GGUF file, read by every peer: portside (``gguf-<fmt>``, the
cpu backend's GGUF kernels as chosen for this CPU, fp32 activations: ``cpu_gguf_act=fp32`` set
where that option exists, whatever its default), portside with int8 activations
(``gguf-<fmt>-a8``, platform option ``cpu_gguf_act=int8``; skipped with a note where this build
has no such option) and llama.cpp (``llama.cpp-<fmt>``: ``llama-cpp-python`` compiled for this
machine, ``GGML_NATIVE=ON``, in the peer venv `cpu_peers.run_llama_cpp` uses, built on first use).
The files come from llama.cpp's own quantizer (``llama_model_quantize`` on an F16 file that
`make_tiny_gguf` writes): Q4_K_M is its mix (Q4_K, with Q6_K for some attn_v/ffn_down and the
output tensor); without llama.cpp they are written by `make_tiny_gguf` (Q4_K_M as Q4_K with every
attn_v/ffn_down Q6_K) and the table says so.

Per format, thread count (1 and all usable cores) and peer, one after another, in the same minutes:
- prefill tokens/s: one P-token prompt, and B prompts (portside: one batched step; llama.cpp's
  binding serves one sequence at a time, so its B prompts run in turn), prompt + one greedy token,
  best of `repeats`;
- batch-1 decode ms/token: greedy, D tokens after the P-token prompt (best time of 1 + D tokens
  less the best of 1 token, over D);
- the bandwidth bound: the file's packed bytes a token reads (every tensor, one embedding row) over
  the read bandwidth measured right before and after that decode with the same thread count;
- which portside kernels ran (``CpuQuantLayout.kernel`` per quantized linear, counted per GGUF type).
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from pathlib import Path
from typing import Any

from cpu import load_info
from peers.llama_cpp_run import gguf_decode_bytes, prefill_decode_figures
from peers.venvs import PeerUnavailable, ensure_venv, run_harness

from portside.testing.tiny import make_tiny_gguf

HERE = Path(__file__).resolve().parent
FORMATS = ("Q8_0", "Q4_0", "Q4_K_M")
PEERS = ("portside", "a8", "a8-op", "llama.cpp")
# what make_tiny_gguf writes for a format where llama.cpp's quantizer is not at hand
FALLBACK = {"Q8_0": ("Q8_0", None), "Q4_0": ("Q4_0", None), "Q4_K_M": ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"})}
A8_OPTION = ("cpu_gguf_act", "int8")
# the a8-op rows: int8 activations op by op (batch-1 decode outside the fused native step)
A8_OP = {"cpu_gguf_act": "int8", "cpu_fused_decode": "off"}
FP32_ACT = {"cpu_gguf_act": "fp32"}  # the gguf-<fmt> rows, where the option exists (set, whatever its default)
LLAMA_CPP_VERSION = "0.3.36"
# issue 48's targets: decode llama.cpp ms / portside ms, prefill portside tok/s / llama.cpp's, ms / bound
TARGETS = {"decode": 1.2, "prefill": 1.0, "bound": 1.3}


def llama_cpp_python(version: str = LLAMA_CPP_VERSION) -> Path:
    """The python of the llama-cpp-python venv (cpu_peers' venv, built here on first use with
    ``GGML_NATIVE=ON``: compiled for this CPU); PeerUnavailable if it cannot be."""
    import os

    return ensure_venv(f"llama-cpp-python-{version}", [f"llama-cpp-python=={version}"],
                       "import llama_cpp; print(llama_cpp.__version__)", system_site_packages=True,
                       env={"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2), "CMAKE_ARGS": "-DGGML_NATIVE=ON"})


def tensor_types(path: Path) -> dict[str, int]:
    """GGUF tensor type -> how many tensors of the file have it."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


def write_files(hf_dir: Path, work: Path, formats: list[str], python: Path | None, threads: int) -> dict[str, Any]:
    """Per format: the GGUF file every peer reads, who wrote it, its tensor types and packed bytes
    per token."""
    files: dict[str, Any] = {}
    src = make_tiny_gguf(hf_dir, work / "model-F16.gguf", "F16") if python is not None else None
    for fmt in formats:
        path = work / f"model-{fmt}.gguf"
        t = time.perf_counter()
        if python is not None:
            run_harness(python, HERE / "peers" / "llama_cpp_run.py",
                        {"mode": "quantize", "src": str(src), "dst": str(path), "ftype": fmt, "threads": threads},
                        work / f"quantize-{fmt}.json")
            writer = "llama.cpp's quantizer (llama_model_quantize) from an F16 file"
        else:
            qtype, mix = FALLBACK[fmt]
            make_tiny_gguf(hf_dir, path, qtype, tensor_types=mix)
            writer = f"make_tiny_gguf ({qtype}" + (f", {mix}" if mix else "") + ")"
        files[fmt] = {"path": str(path), "writer": writer, "types": tensor_types(path),
                      "bytes_per_token": gguf_decode_bytes(str(path)), "write_s": round(time.perf_counter() - t, 1)}
        print("wrote", fmt, files[fmt], flush=True)
    if src is not None:
        src.unlink()
    return files


def native_library() -> str:
    """Build (once per source hash, minutes) and load the cpu backend's native library before any
    timing: an engine started while it builds in the background times the torch paths."""
    from portside.backends.cpu import native_ops

    t = time.perf_counter()
    try:
        path = native_ops.load()
    except Exception as e:  # no compiler, a failed build: the bench still runs (the kernels column says which)
        why = f"unavailable: {type(e).__name__}: {e}"
    else:
        why = f"loaded {path.parent.name[:12]} ({time.perf_counter() - t:.0f} s)"
    print("native cpu library:", why, flush=True)
    return why


def gguf_act_option() -> Any:
    """The cpu platform option ``cpu_gguf_act`` (a `BackendOption`), None in a build without it."""
    from portside.backends.cpu.options import BACKEND_OPTIONS

    return next((o for o in BACKEND_OPTIONS if o.name == A8_OPTION[0]), None)


def transformers_tokens(path: Path, prompt: list[int], n: int = 16) -> list[int] | str:
    """The oracle's greedy tokens (issue 48: those of the dequantized model in transformers):
    transformers reading the same GGUF file (gguf-py dequantizes every tensor to fp32), `n` tokens
    after `prompt`, EOS not stopping it; a string saying why where transformers cannot read it."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # a format transformers does not dequantize: say so, keep the run
        return f"transformers cannot read it: {type(e).__name__}: {e}"
    out, ids, past = [], torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(n):
            r = model(input_ids=ids, past_key_values=past, use_cache=True)
            past, tok = r.past_key_values, int(r.logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    del model, past
    gc.collect()
    return out


def _same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def a8_unavailable() -> str | None:
    """Why the int8-activation GGUF peer cannot run with this build (None: it can)."""
    name, value = A8_OPTION
    option = gguf_act_option()
    if option is None:
        return f"this build has no cpu platform option {name} (the int8-activation GGUF kernels are not in yet)"
    if option.choices and value not in option.choices:
        return f"cpu platform option {name} takes {', '.join(option.choices)}, not {value}"
    return None


def chosen_kernels(model: Any) -> dict[str, int]:
    """"<GGUF type> -> <kernel>" -> how many quantized weights (the embedding table aside) run it:
    ``CpuQuantLayout.kernel`` as `CpuQuantOps.prepare_quantized` chose it, "reference" where the
    pure-torch path stayed."""
    import gguf

    from portside.quant.weight import QuantWeight

    out: Counter[str] = Counter()
    for name, m in model.named_modules():
        if not isinstance(m, QuantWeight) or "embed_tokens" in name:
            continue
        kind = gguf.GGMLQuantizationType(m.ggml_type).name if m.ggml_type is not None else m.kind
        layout = getattr(m, "layout", None)
        kernel = "reference" if layout is None else getattr(layout, "kernel", None) or type(layout).__name__
        out[f"{kind}->{kernel}"] += 1
    return dict(sorted(out.items()))


def bench_portside(path: str, prompt: list[int], batch: list[list[int]], decode_tokens: int, threads: int,
                   repeats: int, options: dict[str, str] | None = None) -> dict[str, Any]:
    """`prefill_decode_figures` for portside on the GGUF file `path` (fp32 activations unless
    `options` say otherwise), `threads` torch threads (``cpu_threads``)."""
    from portside import LLM, SamplingParams
    from portside.backends.cpu import quant
    from portside.backends.cpu.platform import install_caching_allocator

    t0 = time.perf_counter()
    llm = LLM(model=path, device="cpu", dtype="float32", max_model_len=len(prompt) + decode_tokens + 16,
              max_num_seqs=max(8, len(batch)), max_num_batched_tokens=max(2048, sum(map(len, batch))),
              enable_prefix_caching=False, platform_options={"cpu_threads": str(threads), **(options or {})})
    runner = llm.engine.executor.runner
    info: dict[str, Any] = {"threads": threads, "options": options or {}, "quant_isa": quant.isa(),
                            "graph": runner.graph_runner.name, "kernels": chosen_kernels(runner.model),
                            "startup_s": time.perf_counter() - t0}

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    info.update(prefill_decode_figures(generate, prompt, batch, decode_tokens, repeats, threads))
    info["tokens"] = generate([prompt], 16)[0]
    llm.shutdown()
    llm = runner = None
    gc.collect()
    install_caching_allocator(0)
    return info


def _best(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two rounds' figures of one peer merged: the faster decode (with the bandwidth measured
    around it, its tokens and load), the higher prefill rates; a round that failed gives way."""
    if "decode_ms_per_token" not in b or b["decode_ms_per_token"] <= 0:
        return a
    if "decode_ms_per_token" not in a or a["decode_ms_per_token"] <= 0:
        return b
    out = dict(b if b["decode_ms_per_token"] < a["decode_ms_per_token"] else a)
    for key in ("prefill_tok_s", "prefill_batch_tok_s"):
        out[key] = max(a.get(key, 0.0), b.get(key, 0.0))
    out["rounds"] = a.get("rounds", 1) + 1
    return out


def run(hf_dir: Path, work: Path, prompts: list[list[int]], *, formats: list[str], thread_counts: list[int],
        peers: list[str], decode_tokens: int, batch: int, repeats: int, llama_cpp: bool = True,
        rounds: int = 1) -> dict[str, Any]:
    """The side-by-side section of quant.json: files, then runs[fmt][threads][peer] and the summary.
    `rounds` > 1: the peers measured in turn that many times (interleaved, so a change of the
    machine's memory bandwidth state between peers falls on all of them), each keeping its best."""
    import os

    os.environ.setdefault("PORTSIDE_CACHE", str(work / "portside-cache"))  # converted files: in the run's folder
    python, why_no_llama = None, "--no-llama-cpp"
    if llama_cpp:
        try:
            python = llama_cpp_python()
        except PeerUnavailable as e:
            why_no_llama = str(e)
    print("llama.cpp:", f"llama-cpp-python {LLAMA_CPP_VERSION} in {python}" if python else
          f"unavailable ({why_no_llama}): portside only, files written by make_tiny_gguf", flush=True)
    section: dict[str, Any] = {"formats": formats, "thread_counts": thread_counts, "decode_tokens": decode_tokens,
                               "prompt_len": len(prompts[0]), "batch": batch, "repeats": repeats, "rounds": rounds,
                               "llama_cpp": None if python is None else {"python": str(python), "version": LLAMA_CPP_VERSION},
                               "files": write_files(hf_dir, work, formats, python, max(thread_counts)), "runs": {}}
    section["native"] = native_library()
    a8_skip, act = a8_unavailable(), gguf_act_option()
    fp32_act = FP32_ACT if act is not None and "fp32" in (act.choices or ()) else None
    section["gguf_act_default"] = None if act is None else act.default
    prompt, many = prompts[0], prompts[:batch]
    for fmt in formats:
        path = section["files"][fmt]["path"]
        section["files"][fmt]["transformers_tokens"] = transformers_tokens(Path(path), prompt)
        print(fmt, "transformers (dequantized):", section["files"][fmt]["transformers_tokens"], flush=True)
        for threads in thread_counts:
            row: dict[str, Any] = {}
            for _, peer in ((r, p) for r in range(rounds) for p in peers):
                name = {"portside": f"gguf-{fmt.lower()}", "a8": f"gguf-{fmt.lower()}-a8",
                        "a8-op": f"gguf-{fmt.lower()}-a8-op", "llama.cpp": f"llama.cpp-{fmt.lower()}"}[peer]
                load = load_info()
                try:
                    if peer == "portside":
                        info = bench_portside(path, prompt, many, decode_tokens, threads, repeats, fp32_act)
                    elif peer in ("a8", "a8-op"):
                        info = {"skipped": a8_skip} if a8_skip else bench_portside(
                            path, prompt, many, decode_tokens, threads, repeats, dict([A8_OPTION]) if peer == "a8" else A8_OP)
                    elif python is None:
                        info = {"skipped": f"llama.cpp unavailable: {why_no_llama}"}
                    else:
                        info = run_harness(python, HERE / "peers" / "llama_cpp_run.py",
                                           {"mode": "prefill-decode", "gguf": path, "prompt": prompt, "batch": many,
                                            "decode_tokens": decode_tokens, "threads": threads, "repeats": repeats},
                                           work / f"{name}-{threads}t.json")
                except Exception as e:  # one peer failing must not lose the others' figures
                    info = {"error": f"{type(e).__name__}: {e}"}
                info["load_before"], info["load_after"] = load, load_info()
                row[name] = _best(row[name], info) if name in row else info
                print(fmt, f"{threads}t", name, {k: v for k, v in info.items() if k != "tokens"}, flush=True)
            section["runs"].setdefault(fmt, {})[str(threads)] = row
    summarize(section)
    return section


def summarize(section: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per format, thread count and peer: the figures, the bound, the ratios to llama.cpp
    (decode: llama.cpp ms / peer ms, the target >= 1.2; prefill: peer tok/s / llama.cpp's, >= 1.0)."""
    rows = []
    for fmt, by_threads in section["runs"].items():
        nbytes = section["files"][fmt]["bytes_per_token"]
        for threads, peers in by_threads.items():
            ref = next((v for k, v in peers.items() if k.startswith("llama.cpp") and v.get("decode_ms_per_token", 0) > 0), None)
            for name, r in peers.items():
                row: dict[str, Any] = {"format": fmt, "threads": int(threads), "peer": name}
                if "decode_ms_per_token" not in r or r["decode_ms_per_token"] <= 0:
                    row["note"] = r.get("skipped") or r.get("error") or (
                        f"no valid decode time ({r['decode_ms_per_token']:.1f} ms: the 1-token run was slower than the "
                        "1 + D one, the machine was busy); rerun" if "decode_ms_per_token" in r else "not measured")
                    rows.append(row)
                    continue
                bound = 1000 * nbytes / (r["decode_read_bandwidth_gbs"] * 1e9)
                row.update(decode_ms=round(r["decode_ms_per_token"], 2), bound_ms=round(bound, 2),
                           vs_bound=round(r["decode_ms_per_token"] / bound, 2), bandwidth_gbs=round(r["decode_read_bandwidth_gbs"], 1),
                           prefill_tok_s=round(r["prefill_tok_s"], 1), prefill_batch_tok_s=round(r["prefill_batch_tok_s"], 1),
                           load=" ".join(r["load_before"].split()[:1] + r["load_after"].split()[:1]))
                oracle = section["files"][fmt].get("transformers_tokens")
                if isinstance(oracle, list) and r.get("tokens"):
                    row["greedy_equal_to_transformers"] = _same_prefix(r["tokens"], oracle)
                    row["greedy_compared"] = min(len(r["tokens"]), len(oracle))
                if ref is not None and ref is not r:
                    row["decode_speedup_vs_llama_cpp"] = round(ref["decode_ms_per_token"] / r["decode_ms_per_token"], 2)
                    row["prefill_vs_llama_cpp"] = round(r["prefill_tok_s"] / ref["prefill_tok_s"], 2)
                    row["prefill_batch_vs_llama_cpp"] = round(r["prefill_batch_tok_s"] / ref["prefill_batch_tok_s"], 2)
                    row["greedy_prefix_equal_to_llama_cpp"] = _same_prefix(r.get("tokens", []), ref.get("tokens", []))
                    row["greedy_compared"] = min(len(r.get("tokens", [])), len(ref.get("tokens", [])))
                    row["targets_met"] = {"decode": row["decode_speedup_vs_llama_cpp"] >= TARGETS["decode"],
                                          "prefill": row["prefill_vs_llama_cpp"] >= TARGETS["prefill"],
                                          "bound": row["vs_bound"] <= TARGETS["bound"]}
                if "kernels" in r:
                    row["kernels"] = r["kernels"]
                rows.append(row)
    section["summary"] = rows
    return rows


def markdown(section: dict[str, Any]) -> list[str]:
    """The side-by-side table and its legend."""
    s = section
    act = s.get("gguf_act_default")
    lines = [("portside: `gguf-<fmt>` rows with fp32 activations, `-a8` rows with activations quantized to 8 bits "
              f"per block (`cpu_gguf_act=int8`; batch-1 decode in the fused native step), `-a8-op` the same op by op "
              f"(`cpu_fused_decode=off`); portside's default is `cpu_gguf_act={act}`." if act else
              "portside: fp32 activations (this build has no `cpu_gguf_act` option)."), "",
             f"Same GGUF file per format, greedy: decode = {s['decode_tokens']} tokens after a {s['prompt_len']}-token "
             f"prompt (ms/token); prefill = one {s['prompt_len']}-token prompt, and {s['batch']} of them (tokens/s; "
             "llama-cpp-python runs a batch's prompts one after another); best of "
             f"{s['repeats']}" + (f", and of {s['rounds']} rounds with the peers measured in turn" if s.get("rounds", 1) > 1
                                  else "") + ". Bound: the file's packed bytes per token over the read bandwidth measured around "
             "that decode, same threads. \"vs llama.cpp\": decode llama.cpp ms / peer ms (issue target >= 1.2), "
             "prefill peer tok/s / llama.cpp's (target >= 1.0); vs bound: ms / bound ms (target <= 1.3). Greedy: how "
             "many of the first 16 greedy tokens after the prompt equal those of transformers on the same file "
             "dequantized to fp32 (the oracle) / llama.cpp's (random weights give near-tied logits: 8-bit "
             "activations and llama.cpp's f16 KV cache can flip one, and the rest follow). Load: the 1-minute "
             "load average before / after the peer.", ""]
    if "native" in s:
        lines.append(f"- native cpu library: {s['native']}")
    for fmt, f in s["files"].items():
        lines.append(f"- {fmt}: {f['bytes_per_token'] / 1e6:.1f} MB/token, written by {f['writer']}; tensors "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(f["types"].items()))
                     + ("" if isinstance(f.get("transformers_tokens", []), list) else f"; {f['transformers_tokens']}"))
    lines += ["", "| format | threads | peer | decode ms/tok | bound ms (GB/s) | vs bound | prefill tok/s 1 / batch "
              "| vs llama.cpp decode | vs llama.cpp prefill 1 / batch | greedy = transformers / llama.cpp | load | portside kernels |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["summary"]:
        if "decode_ms" not in r:
            lines.append(f"| {r['format']} | {r['threads']} | {r['peer']} | {r['note']} | | | | | | | | |")
            continue
        kernels = ", ".join(f"{k} x{v}" for k, v in r.get("kernels", {}).items()) or "-"
        vs = (f"{r['decode_speedup_vs_llama_cpp']}x", f"{r['prefill_vs_llama_cpp']}x / {r['prefill_batch_vs_llama_cpp']}x") \
            if "decode_speedup_vs_llama_cpp" in r else ("-", "-")
        greedy = (f"{r.get('greedy_equal_to_transformers', '-')} / {r.get('greedy_prefix_equal_to_llama_cpp', '-')} "
                  f"of {r['greedy_compared']}" if "greedy_compared" in r else "-")
        lines.append(f"| {r['format']} | {r['threads']} | {r['peer']} | {r['decode_ms']} | {r['bound_ms']} ({r['bandwidth_gbs']}) | "
                     f"{r['vs_bound']}x | {r['prefill_tok_s']} / {r['prefill_batch_tok_s']} | {vs[0]} | {vs[1]} | {greedy} | "
                     f"{r['load']} | {kernels} |")
    return lines + ["", *targets_markdown(s["summary"])]


def targets_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 48's three targets per portside row: met or not, with the figure."""
    checked = [r for r in rows if "targets_met" in r]
    if not checked:
        return ["Targets: not checked (no llama.cpp figures in this run)."]
    out = [f"Targets (issue 48: decode >= {TARGETS['decode']}x llama.cpp, prefill >= {TARGETS['prefill']}x, "
           f"decode <= {TARGETS['bound']}x its bound):", ""]
    for r in checked:
        met = r["targets_met"]
        out.append(f"- {r['format']}, {r['threads']} thread(s), {r['peer']}: decode {r['decode_speedup_vs_llama_cpp']}x "
                   f"({'met' if met['decode'] else 'not met'}), prefill {r['prefill_vs_llama_cpp']}x "
                   f"({'met' if met['prefill'] else 'not met'}), {r['vs_bound']}x bound "
                   f"({'met' if met['bound'] else 'not met'})")
    return out
