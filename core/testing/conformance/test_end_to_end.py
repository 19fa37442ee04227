"""End-to-end contract: greedy decoding through `LLM(device=NAME)` equals transformers' on a tiny
random-weight model, with a small token budget (chunked prefill, mixed prefill + decode steps)
and sequences that cross block boundaries."""

from __future__ import annotations

from pathlib import Path

import torch

from portside.contract import Platform
from portside.testing.conformance.cases import contract_failure

PROMPTS = ([5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13, 14, 200, 201, 6, 7, 333, 42],
           [7, 8, 9], [100, 200, 300, 11, 22, 33, 44, 55, 66, 77, 88])  # fmt: skip
MAX_TOKENS = 20


def test_greedy_matches_transformers(conformance_platform: type[Platform], conformance_device: str,
                                     conformance_tiny_model: Path, conformance_dtype: torch.dtype) -> None:  # fmt: skip
    from portside import LLM, SamplingParams
    from portside.testing.tiny import hf_greedy

    llm = LLM(
        model=str(conformance_tiny_model),
        device=conformance_device,
        dtype=str(conformance_dtype).removeprefix("torch."),
        block_size=min(conformance_platform.block_sizes, key=lambda b: abs(b - 8)),  # small: many boundaries
        num_kv_blocks=128,
        max_num_batched_tokens=16,  # prompts are chunked and share steps with decodes
        max_model_len=128,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        got = list(out.outputs[0].token_ids)
        want = hf_greedy(conformance_tiny_model, list(prompt), MAX_TOKENS)
        if conformance_dtype != torch.float32:
            got, want = got[:1], want[:1]  # reduced precision: only the first token is stable
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            contract_failure("end-to-end", f"greedy tokens differ from transformers for a {len(prompt)}-token prompt "
                             f"from position {first}: portside {got}, transformers {want}")  # fmt: skip


def test_prompt_logprobs_match_transformers(conformance_platform: type[Platform], conformance_device: str,
                                            conformance_tiny_model: Path, conformance_dtype: torch.dtype) -> None:  # fmt: skip
    """`prompt_logprobs`: every prompt position's logits (not only the last one's) come out of the
    platform's graph runner, chunk by chunk, equal to transformers' log_softmax over the prompt."""
    from portside import LLM, SamplingParams
    from portside.testing.tiny import hf_logits

    llm = LLM(model=str(conformance_tiny_model), device=conformance_device, dtype=str(conformance_dtype).removeprefix("torch."),
              block_size=min(conformance_platform.block_sizes, key=lambda b: abs(b - 8)), num_kv_blocks=128,
              max_num_batched_tokens=16, max_model_len=128)  # fmt: skip
    k = 3
    params = [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k), SamplingParams(temperature=0.0, max_tokens=2)]
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS[:2]], params, use_tqdm=False)
    prompt, got = list(PROMPTS[0]), outputs[0].prompt_logprobs
    if outputs[1].prompt_logprobs is not None or got is None or len(got) != len(prompt) or got[0] is not None:
        contract_failure("end-to-end", f"prompt_logprobs of a {len(prompt)}-token prompt: expected None then one entry "
                         f"per token, got {None if got is None else len(got)} entries")  # fmt: skip
    assert got is not None
    ref = torch.log_softmax(hf_logits(conformance_tiny_model, prompt), dim=-1)
    tol = 1e-4 if conformance_dtype == torch.float32 else 0.1  # reduced precision: the whole model's rounding
    for j in range(1, len(prompt)):
        entry, row, tok = got[j], ref[j - 1], prompt[j]
        if entry is None or tok not in entry or abs(entry[tok].logprob - row[tok].item()) > tol:
            contract_failure("end-to-end", f"prompt logprob of token {j} differs from transformers': "
                             f"portside {entry and entry.get(tok)}, transformers {row[tok].item():.6f}")  # fmt: skip
        if conformance_dtype == torch.float32 and set(entry) != {tok, *torch.topk(row, k).indices.tolist()}:
            contract_failure("end-to-end", f"prompt position {j}: top-{k} ids {sorted(entry)} differ from transformers'")
