"""Batch-invariant mode (`Platform.supports_batch_invariant`, docs/batch_invariant.md): a platform
that declares it gives each of 4 seeded prompts bitwise the same token ids and logprobs alone as
beside 12 others, with chunked prefill and a KV pool too small for them all (preemption); a
platform that does not declare it refuses `batch_invariant=True` with a ValueError naming itself."""

from __future__ import annotations

from pathlib import Path

import torch

from portside.contract import Platform
from portside.testing.conformance.cases import contract_failure

MAX_TOKENS = 8


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 300 + 3 for j in range(3 + (11 * i) % 29)] for i in range(16)]


def _params(i: int):  # noqa: ANN202
    from portside import SamplingParams

    if i % 4 == 0:  # the targets
        return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    return SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=4 + i % 7, ignore_eos=True)


def _outputs(out) -> tuple[list[int], list[list[tuple[int, float]]]]:  # noqa: ANN001
    o = out.outputs[0]
    return list(o.token_ids), [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.logprobs]


def test_batch_invariant_or_refused(conformance_platform: type[Platform], conformance_device: str,
                                    conformance_tiny_model: Path, conformance_dtype: torch.dtype) -> None:  # fmt: skip
    from portside import LLM

    block = min(conformance_platform.block_sizes, key=lambda b: abs(b - 4))
    common = dict(model=str(conformance_tiny_model), device=conformance_device, batch_invariant=True,
                  dtype=str(conformance_dtype).removeprefix("torch."), block_size=block, max_model_len=64)
    if not conformance_platform.supports_batch_invariant:
        try:
            LLM(**common)
        except ValueError as e:
            if conformance_platform.name not in str(e):
                contract_failure("batch-invariant", f"the refusal does not name the platform: {e}")
            return
        contract_failure("batch-invariant", "supports_batch_invariant is False, yet batch_invariant=True was accepted")
    prompts = _prompts()
    alone_llm = LLM(num_kv_blocks=256, max_num_batched_tokens=256, **common)
    targets = range(0, 16, 4)
    alone = {i: _outputs(alone_llm.generate([{"prompt_token_ids": prompts[i]}], _params(i), use_tqdm=False)[0])
             for i in targets}
    del alone_llm
    pool = max(8, 3 * 40 // block)  # room for ~3 sequences of 40 tokens: the 16 preempt each other
    llm = LLM(num_kv_blocks=pool, max_num_batched_tokens=16, **common)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(i) for i in range(16)], use_tqdm=False)
    for i in targets:
        if _outputs(outs[i]) != alone[i]:
            contract_failure("batch-invariant", f"prompt {i} ({len(prompts[i])} tokens): token ids or logprobs differ "
                             f"alone and among 16 requests (chunked prefill, {llm.engine.stats().num_preemptions} "
                             f"preemptions): alone {alone[i]}, batched {_outputs(outs[i])}")  # fmt: skip
