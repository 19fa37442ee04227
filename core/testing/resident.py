"""Resident memory of loading a model and generating, each measurement in a fresh process (the
GGUF memory test and `ci/bench/quant.py`).

`measure` runs ``python -m portside.testing.resident`` on one model: it imports torch and
portside, reads its resident set (VmRSS, RssAnon, RssFile of /proc/self/status), builds an `LLM`
with an explicit KV pool (``num_kv_blocks``), greedily generates from one prompt, and reads it
again. The rise over the imports holds more than the model:

- the KV pool: prefaulted, so resident in full; it is set explicitly and reported on its own
  (the default pool is a budget, 4 GiB on cpu as vLLM's ``VLLM_CPU_KVCACHE_SPACE``, not model
  memory);
- the engine's fixed cost, the same for any model: modules imported on first use (transformers'
  config classes alone pull in sympy and torch.distributed: ~65 MiB), the native library's code,
  thread pools. `resident_ratio` takes it from a control model of the same architecture and KV
  shape whose weights are a few MiB, measured the same way (`make_control`).

What stays is what grows with the model: its weights as served, anything kept beside them
(a dequantized or repacked copy, loading's freed buffers still resident, the file's pages), and
the activations the allocator keeps after generating. `resident_ratio` divides it by the file's
tensor bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["measure", "gguf_tensor_bytes", "make_control", "resident_ratio"]

MiB = 2**20


def _status() -> dict[str, float]:
    """VmRSS, RssAnon, RssFile and VmHWM (the peak) of this process, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def gguf_tensor_bytes(path: str | os.PathLike) -> int:
    """Bytes of every tensor of a GGUF file (its blocks as stored, without metadata)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def measure(model: str | os.PathLike, *, prompt_len: int = 128, max_tokens: int = 32, num_kv_blocks: int | None = None,
            idle_s: float = 2.5, llm_kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None,
            timeout: float = 600) -> dict[str, Any]:
    """Resident memory (MiB) of `LLM(model)` + one greedy generation of `max_tokens` after a
    `prompt_len`-token prompt, in a fresh process: "base" (after imports), "loaded", "generated"
    (right after `generate` returned), "end" (`idle_s` later, the engine idle) (each a
    /proc/self/status reading), "kv_mib" (the pool's bytes), "weights_mib" (the model's
    parameters and buffers as served), "allocator_cached_mib" (freed blocks the cpu caching
    allocator keeps at the end), "end_trimmed" (after glibc's `malloc_trim`), "tokens". max_model_len is the prompt and the output; the KV pool
    `num_kv_blocks` (default: one such sequence). Raises RuntimeError with the child's stderr
    when it fails."""
    max_model_len = prompt_len + max_tokens
    if num_kv_blocks is None:
        num_kv_blocks = -(-max_model_len // 16) + 1  # the cpu platform's default block of 16 tokens
    args = {"model": str(model), "prompt_len": prompt_len, "max_tokens": max_tokens, "num_kv_blocks": num_kv_blocks,
            "max_model_len": max_model_len, "idle_s": idle_s, "llm_kwargs": llm_kwargs or {}}
    r = subprocess.run([sys.executable, "-m", "portside.testing.resident", json.dumps(args)], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"measuring {model} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def make_control(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, qtype: str) -> Path:
    """A GGUF file (`qtype`) of a random model with `hf_dir`'s architecture, layers and KV heads
    (so the same ``num_kv_blocks`` make the same KV pool), hidden and intermediate size 256 and
    one query head per KV head: a few MiB of weights, for the engine's fixed cost."""
    from portside.testing.tiny import make_tiny_gguf, make_tiny_model, read_config

    cfg = read_config(hf_dir)
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[cfg["architectures"][0]]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    out_dir = Path(out_dir)
    hf = make_tiny_model(out_dir / "hf", arch, hidden_size=256, intermediate_size=256,
                         num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=kv_heads,
                         num_key_value_heads=kv_heads, head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                         max_position_embeddings=cfg["max_position_embeddings"],
                         tie_word_embeddings=cfg.get("tie_word_embeddings", False))
    return make_tiny_gguf(hf, out_dir / f"control-{qtype}.gguf", qtype)


def resident_ratio(run: dict[str, Any], tensor_bytes: int, control: dict[str, Any], control_tensor_bytes: int) -> dict[str, float]:
    """What of `run`'s rise grows with the model (MiB), against its file's `tensor_bytes`: the
    rise once idle ("end") less its KV pool and less the engine's fixed cost (the `control`
    run's rise less its KV pool and its own weights), as "model_mib" and "ratio";
    "ratio_at_return" the same right after `generate` returned ("generated"); "raw_ratio" keeps
    the fixed cost in (the KV pool out)."""
    tensor_mib, control_mib = tensor_bytes / MiB, control_tensor_bytes / MiB

    def model_mib(at: str) -> tuple[float, float, float]:
        rise = run[at]["VmRSS"] - run["base"]["VmRSS"]
        fixed = control[at]["VmRSS"] - control["base"]["VmRSS"] - control["kv_mib"] - control_mib
        return rise, fixed, rise - run["kv_mib"] - fixed

    rise, fixed, model = model_mib("end")
    return {"tensor_mib": round(tensor_mib, 1), "rise_mib": round(rise, 1), "kv_mib": round(run["kv_mib"], 1),
            "engine_fixed_mib": round(fixed, 1), "model_mib": round(model, 1),
            "allocator_cached_mib": round(run["allocator_cached_mib"], 1), "ratio": round(model / tensor_mib, 3),
            "ratio_at_return": round(model_mib("generated")[2] / tensor_mib, 3),
            "raw_ratio": round((rise - run["kv_mib"]) / tensor_mib, 3)}


def _child(args: dict[str, Any]) -> dict[str, Any]:
    import gc
    import time

    import torch

    from portside import LLM, SamplingParams

    gc.collect()
    base = _status()
    llm = LLM(model=args["model"], device="cpu", num_kv_blocks=args["num_kv_blocks"],
              max_model_len=args["max_model_len"], enable_prefix_caching=False, **args["llm_kwargs"])
    loaded = _status()
    vocab = llm.engine.tokenizer.vocab_size
    prompt = [(7 * i + 3) % (vocab - 1) + 1 for i in range(args["prompt_len"])]
    sp = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    generated = _status()
    time.sleep(args["idle_s"])  # the caching allocator lets go of what nobody asked for in a second
    end = _status()
    runner = llm.engine.executor.runner
    cached = 0
    try:
        cached = int(torch.ops.portside_cpu_native.caching_allocator_stats()[1])
    except (AttributeError, RuntimeError):  # no native library: no caching allocator
        pass
    from portside.contract.memory import release_free_memory

    release_free_memory()  # what glibc keeps of freed memory: "end" less "end_trimmed"
    return {"base": base, "loaded": loaded, "generated": generated, "end": end, "end_trimmed": _status(),
            "kv_mib": sum(t.numel() * t.element_size() for t in runner.kv_caches) / MiB,
            "weights_mib": runner.weight_bytes / MiB, "allocator_cached_mib": cached / MiB,
            "tokens": list(out[0].outputs[0].token_ids)}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
