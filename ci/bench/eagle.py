"""EAGLE speculative decoding on the cpu backend: batch-1 greedy decode time per token with and
without a head, side by side in one run (engines interleaved in every repeat, best repeat kept),
the greedy tokens checked equal, and the acceptance length (1 + accepted proposals per draft).

    python ci/bench/eagle.py [--tokens 128] [--repeats 3] [--threads 2] [--k 4] [--hidden 1024] [--layers 12]
                             [--leak 0.05] [--workdir /tmp/portside-eagle-bench]

The target and its head are built here (no download):

- the target: a random-weight Llama from a transformers config (--hidden, --layers, the tiny
  test tokenizer's vocabulary), whose every layer but the last writes only a small term into
  the residual stream (its o_proj and down_proj scaled by --leak; 0: nothing), whose embedding
  rows have unit RMS and whose final norm is flat. Every layer still costs its full matmuls.
- the head: self-speculation from the target's last layer, in EAGLE-1's published layout
  (``pytorch_model.bin``: ``fc`` = [identity | 0] passes the token's embedding on, ``layers.0``
  is the target's last layer with its input norm folded into q/k/v since EAGLE-1's first layer
  has none), sharing the target's embedding and LM head. On such a target the last layer does
  nearly all the work, so the head predicts it well: how well is --leak's doing, and reported.

Writes ci/bench/results/eagle.json and eagle.md (newest run first) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
from machine import cpu_name  # ci/bench/machine.py, beside this script

from portside import LLMEngine, SamplingParams

RESULTS = Path(__file__).parent / "results"


def build(workdir: Path, hidden: int, layers: int, leak: float) -> tuple[Path, Path]:
    """The target and its self-speculation head (built once per shape; see the module doc)."""
    from safetensors.torch import load_file, save_file

    from portside.testing.eagle import make_eagle_head
    from portside.testing.tiny import make_tiny_model

    target = workdir / f"target-h{hidden}-l{layers}-leak{leak}"
    head = workdir / f"head-h{hidden}-l{layers}-leak{leak}"
    if (head / "pytorch_model.bin").exists():
        return target, head
    make_tiny_model(target, "llama", hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                    num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), init_std=hidden**-0.5)
    f = target / "model.safetensors"
    w = load_file(str(f))
    emb = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    for i in range(layers - 1):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            w[f"model.layers.{i}.{name}.weight"] *= leak
    save_file(w, str(f), metadata={"format": "pt"})
    make_eagle_head(target, head, "eagle")
    last = f"model.layers.{layers - 1}."
    norm = w[last + "input_layernorm.weight"]
    tensors = {"fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1),
               "fc.bias": torch.zeros(hidden)}
    for name in ("q_proj", "k_proj", "v_proj"):
        tensors[f"layers.0.self_attn.{name}.weight"] = w[f"{last}self_attn.{name}.weight"] * norm[None, :]
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
        tensors[f"layers.0.{name}.weight"] = w[f"{last}{name}.weight"]
    torch.save({k: v.contiguous() for k, v in tensors.items()}, head / "pytorch_model.bin")
    return target, head


def run(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[float, list[int], Any]:
    """(ms per output token after the first, the tokens, the request's speculative stats)."""
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    out, start = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        if start is None:  # the prefill step produced the first token
            start = time.perf_counter()
    assert out is not None and start is not None
    ids = list(out.outputs[0].token_ids)
    return 1e3 * (time.perf_counter() - start) / (len(ids) - 1), ids, out.spec_decode_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--leak", type=float, default=0.05)
    ap.add_argument("--workdir", default="/tmp/portside-eagle-bench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, head = build(Path(args.workdir), args.hidden, args.layers, args.leak)
    common = {"model": str(target), "device": "cpu", "max_model_len": 512}
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": args.k}
    engines = {"plain": LLMEngine.from_args(**common), "eagle": LLMEngine.from_args(**common, speculative_config=spec)}
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(16)] for _ in range(2)]
    for engine in engines.values():  # warm-up: graph capture, first-call costs
        run(engine, prompts[0], 8)
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name, engine in engines.items():
                ms, ids, stats = run(engine, prompt, args.tokens)
                if (i, name) not in best or ms < best[(i, name)]["ms"]:
                    best[(i, name)] = {"ms": ms, "ids": ids, "stats": stats}
    rows = []
    for i in range(len(prompts)):
        plain, eagle = best[(i, "plain")], best[(i, "eagle")]
        assert plain["ids"] == eagle["ids"], f"prompt {i}: speculation changed the greedy tokens"
        s = eagle["stats"]
        rows.append({"prompt": i, "plain_ms_per_token": round(plain["ms"], 2), "eagle_ms_per_token": round(eagle["ms"], 2),
                     "speedup": round(plain["ms"] / eagle["ms"], 3), "drafts": s.num_drafts,
                     "accepted_tokens": s.num_accepted_tokens, "acceptance_length": round(s.acceptance_length, 2),
                     "accepted_per_pos": s.num_accepted_tokens_per_pos})
    load = os.getloadavg()[0]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(), "load_1min": round(load, 1),
              "threads": args.threads, "tokens": args.tokens, "k": args.k, "hidden": args.hidden, "layers": args.layers,
              "leak": args.leak, "torch": torch.__version__, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "eagle.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"Run of {result['date']}, `ci/bench/eagle.py --tokens {args.tokens} --repeats {args.repeats} --threads "
             f"{args.threads} --k {args.k} --hidden {args.hidden} --layers {args.layers} --leak {args.leak}`; "
             f"{result['cpu']}; load average {load:.1f} (1 min, at the end); torch {torch.__version__}. fp32, cpu "
             "backend, batch 1, greedy; best of the repeats; tokens with and without the head checked equal.", "",
             "| prompt | plain ms/token | EAGLE ms/token | speed-up | drafts | accepted | acceptance length | accepted per position |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['plain_ms_per_token']} | {r['eagle_ms_per_token']} | {r['speedup']}x | "
                     f"{r['drafts']} | {r['accepted_tokens']} | {r['acceptance_length']} | {r['accepted_per_pos']} |")
    table = "\n".join(lines)
    print(table)
    md = RESULTS / "eagle.md"
    title = "# EAGLE speculative decoding benchmark (`ci/bench/eagle.py`)\n\n"
    old = md.read_text().removeprefix(title) if md.exists() else ""
    md.write_text(title + table + "\n\n" + old)


if __name__ == "__main__":
    main()
