"""Engine-level greedy parity with transformers, shared by the architecture tests: a tiny
model's folder run through `LLM` batched and alone, with chunked prefill and preemption, and
with prefix-cache hits; every continuation equal to transformers' greedy one
(`portside.testing.hf_oracle`), and every KV block free afterwards."""

from __future__ import annotations

import os
from typing import Any

import torch

from portside import LLM, SamplingParams
from portside.testing.hf_oracle import hf_greedy

__all__ = [
    "assert_all_blocks_free",
    "assert_greedy_parity",
    "check_batched_and_alone",
    "check_chunked_prefill_and_preemption",
    "check_prefix_cache_hits",
    "random_prompts",
]

MAX_TOKENS = 16


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_prompts(seed: int, lengths: list[int], high: int = 400) -> list[list[int]]:
    """Prompts of these lengths, token ids drawn from [3, high) with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (length,), generator=gen).tolist() for length in lengths]


def assert_greedy_parity(path: str | os.PathLike, prompts: list[list[int]], outs: list[Any],
                         max_tokens: int = MAX_TOKENS) -> None:  # fmt: skip
    """Each `RequestOutput` in `outs` holds transformers' greedy continuation of its prompt."""
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, max_tokens), f"prompt of {len(prompt)} tokens"


def assert_all_blocks_free(llm: LLM) -> None:
    """No KV block held once every request finished, and the scheduler's books balance."""
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens), use_tqdm=False)


def check_batched_and_alone(path: str | os.PathLike, max_tokens: int = MAX_TOKENS) -> None:
    """Six prompts of 1 to 41 tokens batched, then the longest alone: transformers' tokens each time."""
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4)
    prompts = random_prompts(0, [1, 4, 9, 17, 30, 41])
    outs = _run(llm, prompts, max_tokens)
    assert_greedy_parity(path, prompts, outs, max_tokens)
    alone = _run(llm, prompts[-1:], max_tokens)
    assert alone[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids
    assert_all_blocks_free(llm)


def check_chunked_prefill_and_preemption(path: str | os.PathLike, num_kv_blocks: int = 20,
                                         max_tokens: int = MAX_TOKENS) -> None:  # fmt: skip
    """A 10-token budget splits prompts across steps, mixed with decodes; `num_kv_blocks` blocks
    of 4 tokens cannot hold 5 sequences of ~40 tokens, so some are preempted and recomputed."""
    llm = LLM(model=str(path), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=num_kv_blocks,
              max_num_batched_tokens=10)  # fmt: skip
    prompts = random_prompts(1, [23, 11, 19, 25, 14])
    outs = _run(llm, prompts, max_tokens)
    assert llm.engine.stats().num_preemptions > 0
    assert_greedy_parity(path, prompts, outs, max_tokens)
    assert_all_blocks_free(llm)


def check_prefix_cache_hits(path: str | os.PathLike, max_tokens: int = MAX_TOKENS) -> None:
    """Prompts sharing 16 tokens: the later ones reuse the first one's cached blocks."""
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4)
    shared = random_prompts(2, [16])[0]
    prompts = [shared + tail for tail in random_prompts(3, [4, 10, 15, 8])]
    first = _run(llm, prompts[:1], max_tokens)
    rest = _run(llm, prompts[1:], max_tokens)
    assert llm.engine.stats().prefix_cache_hits >= 16 * 3
    assert all(o.num_cached_tokens >= 16 for o in rest)
    assert_greedy_parity(path, prompts, first + rest, max_tokens)
    assert_all_blocks_free(llm)
