"""Sleep and wake-up on cpu: the process's resident memory (RSS) before `LLM.sleep`, asleep,
and after `wake_up`, against the weights' bytes, and the time each takes. Level 1 (weights saved
to a temporary file, their pages discarded) and level 2 (discarded; woken weights then updated
from the checkpoint). Greedy outputs after waking are checked against those before.

    python ci/bench/sleep_rss.py [--hidden 1024 --layers 8 --level 1 --json out.json]

The model is a random-weight Llama written to a temporary folder (no network). The issue's bar:
RSS asleep falls by at least 80% of the weight bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--level", type=int, choices=(1, 2), default=1)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args(argv)

    from portside import LLM, SamplingParams
    from portside.testing.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(os.path.join(tmp, "m"), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                               num_key_value_heads=args.hidden // 128, head_dim=64)
        llm = LLM(str(path), device="cpu", max_model_len=256, block_size=16, num_kv_blocks=64)
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompt = [{"prompt_token_ids": list(range(10, 42))}]
        before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        weight_bytes = llm.engine.weight_bytes
        rss_awake = rss_bytes()
        t0 = time.perf_counter()
        llm.sleep(args.level)
        t_sleep = time.perf_counter() - t0
        rss_asleep = rss_bytes()
        t0 = time.perf_counter()
        llm.wake_up()
        if args.level == 2:
            llm.update_weights_from_path(str(path))
        t_wake = time.perf_counter() - t0
        after = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        rss_woken = rss_bytes()
        llm.shutdown()
    drop = rss_awake - rss_asleep
    result = {
        "cpu": cpu_name(), "level": args.level, "weight_mib": round(weight_bytes / 2**20, 1),
        "rss_awake_mib": round(rss_awake / 2**20, 1), "rss_asleep_mib": round(rss_asleep / 2**20, 1),
        "rss_woken_mib": round(rss_woken / 2**20, 1), "drop_mib": round(drop / 2**20, 1),
        "drop_of_weights": round(drop / weight_bytes, 3), "sleep_s": round(t_sleep, 3), "wake_s": round(t_wake, 3),
        "same_outputs": before == after,
    }  # fmt: skip
    print(f"cpu: {result['cpu']}")
    print(f"weights {result['weight_mib']} MiB; RSS awake {result['rss_awake_mib']} MiB, asleep (level {args.level}) "
          f"{result['rss_asleep_mib']} MiB, woken {result['rss_woken_mib']} MiB")
    print(f"RSS fell by {result['drop_mib']} MiB = {100 * result['drop_of_weights']:.0f}% of the weights; "
          f"sleep {result['sleep_s']} s, wake {result['wake_s']} s; outputs after waking identical: {result['same_outputs']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
