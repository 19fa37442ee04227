"""TP=1 vs TP=2 throughput on this machine (cpu, gloo), on a random-weight Llama.

    /work/venv/bin/python ci/bench/tp.py [--hidden 512 --layers 4 --batch 8 --max-tokens 64]

For each size it prints the engine start time, prefill+decode throughput (output tokens/s over
the whole generate call) and the mean time of one decode step. Greedy, ignore_eos, fixed
prompts; the model is written once into a temporary folder.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from portside import LLM, SamplingParams
from portside.testing.tiny import make_tiny_model


def run(path: str, tp: int, batch: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    llm = LLM(model=path, device="cpu", tensor_parallel_size=tp, max_model_len=prompt_len + max_tokens + 8,
              num_kv_blocks=batch * (-(-(prompt_len + max_tokens + 8) // 16)) + 8)
    start_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 5 for j in range(prompt_len)]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total_s = time.perf_counter() - t0
    # decode steps alone: one request already past its prompt
    llm.engine.add_request("decode", prompts[0]["prompt_token_ids"], params)
    llm.engine.step()  # prefill
    t0, steps = time.perf_counter(), 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
    step_ms = 1000 * (time.perf_counter() - t0) / max(steps, 1)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.engine.shutdown()
    return {"start_s": start_s, "tok_per_s": tokens / total_s, "decode_step_ms": step_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        heads = max(4, args.hidden // 64)
        path = str(make_tiny_model(tmp, "llama", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=heads,
                                   num_key_value_heads=heads // 2, head_dim=args.hidden // heads))
        print(f"model: hidden {args.hidden}, {args.layers} layers, {heads} heads; batch {args.batch}, "
              f"prompt {args.prompt_len}, {args.max_tokens} new tokens each")
        for tp in args.tp:
            r = run(path, tp, args.batch, args.prompt_len, args.max_tokens)
            print(f"TP={tp}: start {r['start_s']:.1f} s, {r['tok_per_s']:.1f} output tok/s, "
                  f"decode step {r['decode_step_ms']:.2f} ms (batch 1)")


if __name__ == "__main__":
    main()
