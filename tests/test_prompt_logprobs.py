"""`SamplingParams(prompt_logprobs=k)`: each prompt token's logprob, rank and top-k alternatives
equal transformers' log_softmax over the prompt (fp32, tiny random-weight models), batched with
requests that did not ask, with chunked prefill, with a prefix-cache hit attempt, across
preemption, on the cpu graph runners, and with tensor parallelism 2 (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portside import LLM, SamplingParams
from portside.sampling_params import RequestOutputKind
from portside.testing.tiny import hf_greedy, hf_logits, make_tiny_model

TOL = 1e-4
TEXT = ("the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun "
        "and the river runs to the sea under a bright sky full of birds ") * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("plp_llama"), "llama")


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model=str(model), device="cpu", max_model_len=256, block_size=4)


def prompt(llm: LLM, n: int, offset: int = 0) -> list[int]:
    return llm.get_tokenizer().encode(TEXT)[offset : offset + n]


def assert_prompt_logprobs(model: Path, ids: list[int], got, k: int) -> None:
    """`got` (RequestOutput.prompt_logprobs) against transformers: [None] + one entry per token
    holding the token (its logprob and rank) and exactly the top-k of torch.topk."""
    ref = torch.log_softmax(hf_logits(model, ids), dim=-1)  # row j predicts token j + 1
    assert got is not None and len(got) == len(ids), f"{None if got is None else len(got)} entries for {len(ids)} tokens"
    assert got[0] is None
    for j in range(1, len(ids)):
        row, tok, entry = ref[j - 1], ids[j], got[j]
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=TOL), f"position {j}"
        assert entry[tok].rank == 1 + int((row > row[tok]).sum()), f"position {j}"
        top_vals, top_ids = torch.topk(row, k)
        assert set(entry) == {tok, *top_ids.tolist()}, f"position {j}"
        for r, (tid, val) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(val, abs=TOL)
            assert entry[tid].rank == r
            assert entry[tid].decoded_token is not None


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_used_blocks == 0, f"{stats.num_used_blocks} KV blocks still in use"
    llm.engine.scheduler.check_integrity()


def test_batched_with_requests_without(model, llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    asked = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    prompts = [prompt(llm, 21), prompt(llm, 9, 3), prompt(llm, 14, 5), prompt(llm, 1, 7)]
    params = [asked, greedy, asked, asked]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, p, 6)  # sampling unchanged by the extra rows
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_prompt_logprobs(model, p, out.prompt_logprobs, 3)
    assert outs[3].prompt_logprobs == [None]  # a one-token prompt: nothing predicts its token
    assert_all_blocks_free(llm)


def test_k_zero_and_n_samples(model, llm):
    p = prompt(llm, 12)
    (out,) = llm.generate([{"prompt_token_ids": p}], SamplingParams(n=3, max_tokens=4, seed=1, prompt_logprobs=0),
                          use_tqdm=False)
    assert len(out.outputs) == 3
    assert_prompt_logprobs(model, p, out.prompt_logprobs, 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # only the prompt token itself
    assert_all_blocks_free(llm)


def test_chunked_prefill(model):
    llm = LLM(model=str(model), device="cpu", max_model_len=256, block_size=4, max_num_batched_tokens=7)
    prompts = [prompt(llm, 30), prompt(llm, 17, 2)]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert_prompt_logprobs(model, p, out.prompt_logprobs, 2)
        assert out.outputs[0].token_ids == hf_greedy(model, p, 3)
    assert_all_blocks_free(llm)


def test_prefix_cache_hit_is_not_taken(model):
    llm = LLM(model=str(model), device="cpu", max_model_len=256, block_size=4)
    p = prompt(llm, 26)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)  # caches the prompt's blocks
    (again,) = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)
    assert again.num_cached_tokens > 0  # the cache does hit for a request without prompt logprobs
    (out,) = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2, prompt_logprobs=4), use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs(model, p, out.prompt_logprobs, 4)
    assert_all_blocks_free(llm)


def test_across_preemption(model):
    # 16 blocks of 4 tokens for 3 requests of 20-24 prompt tokens + 16 outputs: some are preempted,
    # one of them mid-prompt (its recompute sends positions 0.. again, which must not repeat)
    llm = LLM(model=str(model), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=16,
              max_num_batched_tokens=16)
    prompts = [prompt(llm, 22), prompt(llm, 20, 4), prompt(llm, 24, 8)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for p, out in zip(prompts, outs):
        assert_prompt_logprobs(model, p, out.prompt_logprobs, 2)  # exactly one entry per token
        assert out.outputs[0].token_ids == hf_greedy(model, p, 16)
    assert_all_blocks_free(llm)


def test_delta_outputs_carry_them_once(model, llm):
    p = prompt(llm, 15)
    engine = llm.engine
    engine.add_request("d", p, SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=1,
                                              output_kind=RequestOutputKind.DELTA))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step() if o.request_id == "d"]
    assert sum(pl is not None for pl in seen) == 1 and seen[0] is not None
    assert_prompt_logprobs(model, p, seen[0], 1)


def test_limits_and_bad_values(model, llm):
    p = prompt(llm, 5)
    with pytest.raises(ValueError, match="prompt_logprobs: 21 requested, more than the 20 allowed"):
        llm.generate([{"prompt_token_ids": p}], SamplingParams(prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative"):
        SamplingParams(prompt_logprobs=-1)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["inductor", "openvino"])
@pytest.mark.slow
def test_cpu_graph_runners(model, mode):
    """The compiled runners return every row's hidden states, so prompt rows gather from them."""
    llm = LLM(model=str(model), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=8,
              platform_options={"cpu_graph": mode})
    prompts = [prompt(llm, 13), prompt(llm, 6, 3)]
    sp = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2),
          SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert_prompt_logprobs(model, prompts[0], outs[0].prompt_logprobs, 2)
    assert outs[1].prompt_logprobs is None
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, p, 3)


@pytest.mark.slow
def test_tensor_parallel_2(model):
    llm = LLM(model=str(model), device="cpu", tensor_parallel_size=2, max_model_len=128, block_size=4,
              num_kv_blocks=96, max_num_batched_tokens=16)
    try:
        prompts = [prompt(llm, 27), prompt(llm, 5, 2)]
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        for p, out in zip(prompts, outs):
            assert_prompt_logprobs(model, p, out.prompt_logprobs, 3)
        assert llm.engine.stats().num_used_blocks == 0
    finally:
        llm.engine.shutdown()
