"""KV tiers with a sliding-window model (docs/kv_tiers.md): a tiny random-weight Mistral whose
every layer has an 8-token window, 44-token prompts (5 windows), 4-token blocks. The prefix
cache enters the blocks that fall out of the window before it frees them (null placeholders in
the table), so they are ordinary cached blocks: evicted ones go to the host tier, and a replay
loads its chain back from the first block. Greedy tokens with the tier (and with swap
preemption) equal those without it and transformers'; no block leaks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from portside import LLM, SamplingParams
from portside.testing.engine_parity import random_prompts
from portside.testing.hf_oracle import hf_greedy
from portside.testing.kv_replay import check_books, replay
from portside.testing.tiny import make_tiny_model

WINDOW = 8
MAX_TOKENS = 6
PROMPTS = random_prompts(11, [44] * 6)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mistral_window"), "mistral", sliding_window=WINDOW)


def _llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 24)
    llm = LLM(model=str(path), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=16, **kwargs)
    assert llm.engine.scheduler.kv.sliding_window == WINDOW
    return llm


def _replay(llm: LLM) -> tuple[list[list[int]], list[int]]:
    return replay(llm, PROMPTS, GREEDY)


_check_books = check_books


def test_window_model_host_tier_loads_evicted_prefixes_with_identical_tokens(mistral):
    baseline, cached = _replay(_llm(mistral))
    assert cached[len(PROMPTS):] == [0] * len(PROMPTS)  # the device cache alone keeps none of them
    for prompt, toks in zip(PROMPTS, baseline[: len(PROMPTS)], strict=True):
        assert toks == hf_greedy(mistral, prompt, MAX_TOKENS)
    llm = _llm(mistral, kv_offload_cpu_bytes=1 << 20)
    tokens, cached = _replay(llm)
    assert tokens == baseline
    assert cached[len(PROMPTS):] == [40] * len(PROMPTS)  # the chain from block 0, out-of-window blocks included
    stats = _check_books(llm)
    assert stats["host_hit_blocks"] == 10 * len(PROMPTS)


@pytest.mark.slow  # two engines decoding through preemptions, over 20 s on 2 cores: CI's legs run it
def test_window_model_swap_preemption_resumes_with_identical_tokens(mistral):
    """Five ~37-token prompts decoding 24 tokens over 10 blocks: some are preempted, and their
    tables hold nulls (freed out-of-window blocks) when they are; swap saves the blocks they hold."""
    prompts = random_prompts(7, [38, 35, 40, 33, 37])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for mode in ("recompute", "swap"):
        llm = _llm(mistral, num_kv_blocks=10, preemption_mode=mode, swap_space=0.001)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0
        stats = _check_books(llm) if mode == "swap" else llm.engine.stats().kv_transfer
        runs[mode] = ([list(o.outputs[0].token_ids) for o in outs], stats)
    assert runs["swap"][0] == runs["recompute"][0]
    for prompt, toks in zip(prompts, runs["swap"][0], strict=True):
        assert toks == hf_greedy(mistral, prompt, 24)
    assert runs["swap"][1]["swapped_out_blocks"] > 0
    assert runs["swap"][1]["preemption_recomputed_tokens"] < runs["recompute"][1]["preemption_recomputed_tokens"]
