"""On a GPU: CUDA-graph replay equals eager, end to end, and both equal transformers' greedy.

Runs a tiny random-weight Llama (head_dim 64, GQA) through `LLM(device="cuda")` twice, with
graphs (default) and with `enforce_eager=1`, and checks the greedy tokens are identical, equal
transformers', and that graphs were actually replayed. Exit code 1 on a mismatch.
"""

from __future__ import annotations

import sys
import tempfile

from portside import LLM, SamplingParams
from portside.testing.tiny import hf_greedy, make_tiny_model


def main() -> int:
    path = make_tiny_model(tempfile.mkdtemp(), "llama", head_dim=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for mode, options in (("graph", {}), ("eager", {"enforce_eager": "1"})):
        llm = LLM(model=str(path), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                  platform_options=options)
        tok = llm.get_tokenizer()
        base = tok.encode("the quick brown fox jumps over the lazy dog " * 8)
        prompts = [base[:n] for n in (3, 16, 17, 40, 61)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[mode] = [o.outputs[0].token_ids for o in outs]
        runner = llm.engine.executor.runner.graph_runner
        replays = getattr(runner, "num_replays", 0)
        print(f"{mode}: graph runner {runner.name}, captured {getattr(runner, 'captured_sizes', ())}, replays {replays}")
        if mode == "graph" and replays == 0:
            print("FAIL: no step was replayed from a graph")
            return 1
    expected = [hf_greedy(path, p, 24) for p in prompts]
    ok = results["graph"] == results["eager"] == expected
    print("graph == eager == transformers:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
