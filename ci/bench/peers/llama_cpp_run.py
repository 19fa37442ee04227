"""llama.cpp through llama-cpp-python (`llama_cpp`): greedy generation one sequence at a time, as
`ci/bench/quant.py` (in-process, where the project's environment has `llama_cpp`) and
`ci/bench/cpu.py --peers` (this file as a harness, in the venv `peers.venvs` builds) time it.

    <venv>/bin/python ci/bench/peers/llama_cpp_run.py ARGS.json OUT.json

ARGS: {"gguf", "prompts", "gen", "decode_tokens", "threads", "keep_tokens"}; OUT: the figures.
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


def main(spec: str, out: str) -> None:
    a = json.loads(Path(spec).read_text())
    info = bench_llama_cpp(a["gguf"], a["prompts"], a["gen"], a["decode_tokens"], a["threads"], a.get("keep_tokens", 0))
    Path(out).write_text(json.dumps(info))


if __name__ == "__main__":
    main(*sys.argv[1:3])
