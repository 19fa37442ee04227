"""llama.cpp through llama-cpp-python (`llama_cpp`): greedy generation one sequence at a time, as
`ci/bench/quant.py` (in-process, where the project's environment has `llama_cpp`) and
`ci/bench/cpu.py --peers` (this file as a harness, in the venv `peers.venvs` builds) time it.

    <venv>/bin/python ci/bench/peers/llama_cpp_run.py ARGS.json OUT.json

ARGS: {"gguf", "prompts", "gen", "decode_tokens", "threads", "keep_tokens"}; OUT: the figures.
With ``"mode": "prefill-decode"`` (`ci/bench/quant_gguf.py`): {"gguf", "prompt", "batch", "decode_tokens",
"threads", "repeats"} -> `prefill_decode`'s figures; with ``"mode": "quantize"``: {"src", "dst",
"ftype", "threads"} -> llama.cpp's own quantizer (`quantize`) writes `dst` from `src`.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ci/bench, for cpu._decode

from cpu import _decode  # noqa: E402


def gguf_decode_bytes(path: str) -> int:
    """Bytes of every tensor of a GGUF file but the token embedding (one row of it)."""
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(path).tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            n //= int(t.shape[-1])
        total += n
    return total


def bench_llama_cpp(path: str, prompts, gen: int, decode_tokens: int, threads: int,
                    keep_tokens: int = 0) -> dict[str, Any]:
    """Batch-1 decode ms/token (cpu.py's `_decode`: best of 2, the first token's time taken off),
    then every prompt generated in turn (llama-cpp-python serves one sequence at a time); the
    tokens of the first `keep_tokens` prompts come back in `tokens`."""
    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompts[0]) + gen + 8, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    info: dict[str, Any] = {"llama_cpp": llama_cpp.__version__,
                            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                            "startup_s": time.perf_counter() - t0, "decode_bytes_per_token": gguf_decode_bytes(path)}

    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        # The last position's logits from the context: without logits_all, `Llama.scores` is no
        # longer filled (0.3.x samples inside llama.cpp), so argmax over it was always token 0.
        return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))

    def generate(prompt: list[int], n: int) -> list[int]:
        llm.reset()
        llm.eval(prompt)
        out = []
        for _ in range(n):
            tok = int(np.argmax(last_logits()))
            out.append(tok)
            llm.eval([tok])
        return out

    generate(prompts[0], 4)
    info.update(_decode(lambda n: generate(prompts[0], n), decode_tokens))
    t = time.perf_counter()
    outs = [generate(p, gen) for p in prompts]
    elapsed = time.perf_counter() - t
    info.update(throughput_s=elapsed, output_tok_s=len(prompts) * gen / elapsed, sequential=True)
    if keep_tokens:
        info["tokens"] = outs[:keep_tokens]
    llm.close()
    gc.collect()
    return info


def best_s(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `fn` (the machine is shared: best of N)."""
    times = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def prefill_decode_figures(generate, prompt: list[int], batch: list[list[int]], decode_tokens: int, repeats: int,
                           threads: int) -> dict[str, Any]:
    """The figures `ci/bench/quant_gguf.py` sets side by side, for one engine's `generate(prompts, n)`
    (greedy, `n` tokens each): prefill tokens/s of one prompt and of `batch` (the prompt and one
    sampled token, best of `repeats`), batch-1 decode ms/token (best time of 1 + n tokens less the
    best of 1 token, over n) and the read bandwidth just before and after that decode, read with
    `threads` torch threads (the decode's own thread count)."""
    import torch
    from cpu import read_bandwidth_huge_pages

    torch.set_num_threads(threads)
    generate([prompt], 2)  # warm
    one = best_s(lambda: generate([prompt], 1), repeats)
    many = best_s(lambda: generate(batch, 1), repeats)
    before = read_bandwidth_huge_pages(512)
    t1 = best_s(lambda: generate([prompt], 1), repeats)
    tn = best_s(lambda: generate([prompt], 1 + decode_tokens), repeats)
    after = read_bandwidth_huge_pages(512)
    return {"prefill_tok_s": len(prompt) / one, "prefill_batch_tok_s": sum(map(len, batch)) / many,
            "decode_ms_per_token": 1000 * (tn - t1) / decode_tokens, "decode_read_bandwidth_gbs": max(before, after),
            "read_bandwidth_before_gbs": before, "read_bandwidth_after_gbs": after, "first_token_ms": 1000 * t1}


def prefill_decode(path: str, prompt: list[int], batch: list[list[int]], decode_tokens: int, threads: int,
                   repeats: int) -> dict[str, Any]:
    """`prefill_decode_figures` for llama.cpp on `path` with `threads` threads (prompt and batch
    processing alike). The binding serves one sequence at a time, so the batch's prompts are
    processed one after another (each in one 512-token batch)."""
    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + decode_tokens + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    info: dict[str, Any] = {"llama_cpp": llama_cpp.__version__, "threads": threads,
                            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                            "startup_s": time.perf_counter() - t0}
    n_vocab = llm.n_vocab()

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        outs = []
        for p in prompts:
            llm.reset()
            llm.eval(p)
            out = []
            for i in range(n):
                out.append(int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,)))))
                if i + 1 < n:
                    llm.eval([out[-1]])
            outs.append(out)
        return outs

    info.update(prefill_decode_figures(generate, prompt, batch, decode_tokens, repeats, threads))
    info["tokens"] = generate([prompt], 16)[0]
    llm.close()
    return info


def quantize(src: str, dst: str, ftype: str, threads: int) -> dict[str, Any]:
    """llama.cpp's quantizer (``llama_model_quantize``, what its ``llama-quantize`` tool runs) on
    `src` (an F16/F32 GGUF file) into `dst` as `ftype` ("Q8_0", "Q4_0", "Q4_K_M", ...: its own
    per-tensor mix, e.g. Q6_K for some attn_v/ffn_down and the output tensor in Q4_K_M)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    t = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) returned {rc}")
    return {"seconds": time.perf_counter() - t, "llama_cpp": llama_cpp.__version__, "ftype": ftype}


def main(spec: str, out: str) -> None:
    a = json.loads(Path(spec).read_text())
    mode = a.get("mode", "generate")
    if mode == "quantize":
        info = quantize(a["src"], a["dst"], a["ftype"], a.get("threads", 2))
    elif mode == "prefill-decode":
        info = prefill_decode(a["gguf"], a["prompt"], a["batch"], a["decode_tokens"], a["threads"], a.get("repeats", 2))
    else:
        info = bench_llama_cpp(a["gguf"], a["prompts"], a["gen"], a["decode_tokens"], a["threads"], a.get("keep_tokens", 0))
    Path(out).write_text(json.dumps(info))


if __name__ == "__main__":
    main(*sys.argv[1:3])
