"""Speculative decoding (ngram prompt lookup, and a draft model given with --draft) at batch 1,
side by side in one run: decode time per output token with and without it, on the default model (SmolLM2-135M-Instruct) on the cpu
backend, greedy, on a workload where proposals hit (the model is asked to repeat a passage it
was given) and one where they rarely do (free writing); plus acceptance rates. The greedy tokens
with and without speculation are checked equal.

    python ci/bench/spec_decode.py [--tokens 128] [--repeats 3] [--threads 2] [--k 4] [--lookup 2 5]
                                   [--draft PATH | --draft self]

--draft: a draft model with the default model's tokenizer (`self`: the default model as its own
draft, which every proposal passes: the acceptance ceiling, and what the draft's k forwards cost
when the draft is as large as the target).

Writes ci/bench/results/spec_decode.json and spec_decode.md. Each repeat runs every engine on
each workload in turn; the best (lowest) repeat of each is kept (a shared machine's noise only
ever adds time).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from machine import cpu_name  # ci/bench/machine.py, beside this script

from portside import LLMEngine, SamplingParams

RESULTS = Path(__file__).parent / "results"
PASSAGE = ("The harbour town wakes slowly in winter. Fishing boats rock against the stone quay, their ropes "
           "stiff with frost, and the gulls circle above the market square where the first stalls open. "
           "An old lighthouse keeper walks along the sea wall every morning, counting the ships that left "
           "overnight and writing their names in a small notebook he keeps in his coat.")
WORKLOADS = {
    "repeat": [{"role": "user", "content": f"Repeat this passage exactly, word for word:\n\n{PASSAGE}"}],
    "free": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
}


def run(engine: LLMEngine, prompt: dict[str, Any], tokens: int) -> tuple[float, list[int], Any]:
    """(ms per output token after the first, the tokens, the request's speculative stats)."""
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    out, start = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        if start is None:  # the prefill step produced the first token
            start = time.perf_counter()
    assert out is not None and start is not None
    ids = out.outputs[0].token_ids
    return 1e3 * (time.perf_counter() - start) / (len(ids) - 1), ids, out.spec_decode_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", type=int, nargs=2, default=(2, 5), metavar=("MIN", "MAX"))
    ap.add_argument("--draft", default=None, help="a draft model folder, or 'self'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup[0],
            "prompt_lookup_max": args.lookup[1]}
    engines = {"plain": LLMEngine.from_args(device="cpu", max_model_len=1024),
               "ngram": LLMEngine.from_args(device="cpu", max_model_len=1024, speculative_config=spec)}
    if args.draft is not None:
        from portside.default_model import default_model_path

        draft = str(default_model_path()) if args.draft == "self" else args.draft
        engines["draft"] = LLMEngine.from_args(device="cpu", max_model_len=1024, speculative_config={
            "model": draft, "num_speculative_tokens": args.k})
    prompts = {name: engines["plain"].apply_chat_template(msgs) for name, msgs in WORKLOADS.items()}
    for engine in engines.values():  # warm-up: graph capture, first-call costs
        run(engine, prompts["free"], 8)
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for _ in range(args.repeats):
        for wl, prompt in prompts.items():
            for name, engine in engines.items():
                ms, ids, stats = run(engine, prompt, args.tokens)
                key = (wl, name)
                if key not in best or ms < best[key]["ms_per_token"]:
                    best[key] = {"ms_per_token": ms, "ids": ids, "stats": stats}
    rows = []
    for wl in prompts:
        plain = best[(wl, "plain")]
        for name in engines:
            if name == "plain":
                continue
            spec_run = best[(wl, name)]
            assert plain["ids"] == spec_run["ids"], f"{wl}: {name} speculation changed the greedy tokens"
            s = spec_run["stats"]
            rows.append({
                "workload": wl,
                "method": name,
                "plain_ms_per_token": round(plain["ms_per_token"], 2),
                "spec_ms_per_token": round(spec_run["ms_per_token"], 2),
                "speedup": round(plain["ms_per_token"] / spec_run["ms_per_token"], 3),
                "drafts": s.num_drafts if s else 0,
                "draft_tokens": s.num_draft_tokens if s else 0,
                "accepted_tokens": s.num_accepted_tokens if s else 0,
                "acceptance_rate": round(s.acceptance_rate, 3) if s else 0.0,
                "acceptance_length": round(s.acceptance_length, 2) if s else 0.0,
                "accepted_per_pos": s.num_accepted_tokens_per_pos if s else [],
            })
    machine = cpu_name()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": machine, "threads": args.threads,
              "tokens": args.tokens, "speculative_config": spec, "draft": args.draft, "torch": torch.__version__, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "spec_decode.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"Run of {result['date']}, `ci/bench/spec_decode.py --tokens {args.tokens} --repeats {args.repeats} "
             f"--threads {args.threads} --k {args.k} --lookup {args.lookup[0]} {args.lookup[1]}"
             f"{' --draft ' + args.draft if args.draft else ''}`; {machine}; "
             f"torch {torch.__version__}. Default model, fp32, cpu backend, batch 1, greedy, {args.tokens} tokens; "
             "best of the repeats. Tokens with and without speculation checked equal.", "",
             "| workload | method | plain ms/token | speculative ms/token | speed-up | drafts | proposed | accepted | acceptance | acceptance length | accepted per position |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['method']} | {r['plain_ms_per_token']} | {r['spec_ms_per_token']} | {r['speedup']}x | "
                     f"{r['drafts']} | {r['draft_tokens']} | {r['accepted_tokens']} | {r['acceptance_rate']:.0%} | "
                     f"{r['acceptance_length']} | {r['accepted_per_pos']} |")
    table = "\n".join(lines)
    print(table)
    md = RESULTS / "spec_decode.md"
    head = "# Speculative decoding benchmark (`ci/bench/spec_decode.py`)\n\n"
    old = md.read_text().removeprefix(head) if md.exists() else ""
    md.write_text(head + table + "\n\n" + old)


if __name__ == "__main__":
    main()
