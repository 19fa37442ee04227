"""End-to-end: portside's greedy token ids equal transformers' greedy `generate`, on tiny
random-weight Llama, Mistral and Qwen2 models, alone and batched, across block boundaries,
with chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest

from portside import LLM, SamplingParams
from portside.testing.tiny import hf_greedy, make_tiny_model

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# Words the tiny tokenizer knows, so prompts of many lengths tokenize sensibly.
WORDS = ("the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun "
         "and the river runs to the sea under a bright sky full of birds").split()


def make_prompts(tokenizer, lengths: list[int], shared_prefix: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths; the first `shared_prefix` tokens are common."""
    base = tokenizer.encode(" ".join(WORDS * 4))
    prompts = []
    for i, n in enumerate(lengths):
        head = base[:shared_prefix]
        tail = base[shared_prefix + 3 * i :][: max(0, n - shared_prefix)]
        prompts.append((head + tail)[:n])
    return prompts


def assert_parity(model_path: Path, prompts: list[list[int]], outputs) -> None:
    for prompt, out in zip(prompts, outputs):
        expected = hf_greedy(model_path, prompt, MAX_TOKENS)
        got = out.outputs[0].token_ids
        assert got == expected, f"prompt of {len(prompt)} tokens: portside {got} != transformers {expected}"


# mistral and qwen2 under -m slow (CI): the quick suite keeps llama, and test_models /
# test_model_archs keep their logits and greedy parity quick
@pytest.fixture(scope="module", params=["llama", pytest.param("mistral", marks=pytest.mark.slow),
                                        pytest.param("qwen2", marks=pytest.mark.slow)])
def model_path(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def generate(model_path: Path, prompts, **engine_kwargs):
    llm = LLM(model=str(model_path), device="cpu", max_model_len=256, **engine_kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, outs


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_used_blocks == 0, f"{stats.num_used_blocks} KV blocks still in use"
    llm.engine.scheduler.check_integrity()


def test_single_prompt(model_path):
    llm = LLM(model=str(model_path), device="cpu", max_model_len=256, block_size=4)
    prompts = make_prompts(llm.get_tokenizer(), [13])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_parity(model_path, prompts, outs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("block_size", [4, 8])
def test_batched_ragged_prompts_cross_blocks(model_path, block_size):
    llm, _ = generate(model_path, [[1, 2, 3]], block_size=block_size)
    prompts = make_prompts(llm.get_tokenizer(), [1, 3, 4, 5, 8, 9, 17, 30, 41])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_parity(model_path, prompts, outs)
    assert_all_blocks_free(llm)


def test_chunked_prefill_small_budget(model_path):
    """A 10-token budget splits every prompt longer than that across steps, mixed with decodes."""
    llm = LLM(model=str(model_path), device="cpu", max_model_len=256, block_size=4, max_num_batched_tokens=10)
    prompts = make_prompts(llm.get_tokenizer(), [7, 23, 37, 12])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_parity(model_path, prompts, outs)
    assert_all_blocks_free(llm)


def test_preemption_with_tiny_pool(model_path):
    """A pool of 20 blocks of 4 tokens cannot hold 6 sequences of ~45 tokens: preemption by
    recompute must kick in and the tokens must not change."""
    llm = LLM(model=str(model_path), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=20)
    prompts = make_prompts(llm.get_tokenizer(), [15, 19, 22, 11, 17, 20])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    assert_parity(model_path, prompts, outs)
    assert_all_blocks_free(llm)


def test_prefix_cache_hits(model_path):
    llm = LLM(model=str(model_path), device="cpu", max_model_len=256, block_size=4)
    prompts = make_prompts(llm.get_tokenizer(), [20, 26, 31, 24], shared_prefix=16)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 16 * 3, stats
    assert all(o.num_cached_tokens >= 16 for o in rest)
    assert_parity(model_path, prompts, first + rest)
    assert_all_blocks_free(llm)


@pytest.mark.slow  # end-to-end, over 5 s on 2 cores: CI's legs run it (issue 25: the quick suite under 5 min)
def test_alone_equals_batched(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=256, block_size=8)
    prompts = make_prompts(llm.get_tokenizer(), [5, 9, 14, 21, 30, 6, 11, 3])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=12, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, b in zip(prompts, batched):
        alone = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == b.outputs[0].token_ids


def test_n_samples_share_prompt_blocks(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=256, block_size=4, enable_prefix_caching=False)
    prompt = make_prompts(llm.get_tokenizer(), [18])[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # distinct seeds per sample
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    expected = hf_greedy(tiny_llama, prompt, MAX_TOKENS)
    assert [o.token_ids for o in out.outputs] == [expected, expected]
    assert_all_blocks_free(llm)


def test_stop_strings_and_eos(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=256)
    tok = llm.get_tokenizer()
    prompt = make_prompts(tok, [10])[0]
    full = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0]
    # pick a stop string from the middle of the greedy text
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "greedy text too short to pick a stop string"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    # a stop token id ends generation with that id as the reason
    stop_id = full.token_ids[5]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id])
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    # detokenize=False (vLLM's): the same tokens, no text; stop strings then need the text
    ids_only = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": prompt}], ids_only, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids and out.text == ""
    with pytest.raises(ValueError, match="stop strings need the output text: not with detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)
    assert_all_blocks_free(llm)


def test_max_tokens_and_length(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=32)
    prompt = make_prompts(llm.get_tokenizer(), [20])[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 32 - 20 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": make_prompts(llm.get_tokenizer(), [40])[0]}], GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)


def test_logprobs(tiny_llama):
    import torch

    from portside.testing.tiny import hf_logits

    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=256)
    prompt = make_prompts(llm.get_tokenizer(), [9])[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=4)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    ref = torch.log_softmax(hf_logits(tiny_llama, prompt)[-1], dim=-1)
    first = out.logprobs[0]
    tok = out.token_ids[0]
    assert first[tok].rank == 1
    assert abs(first[tok].logprob - ref[tok].item()) < 1e-4
    assert len(first) == 4  # the sampled token is the top-1 here, so 4 distinct entries
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)))


def test_abort_frees_blocks(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=256, block_size=4)
    engine = llm.engine
    prompts = make_prompts(llm.get_tokenizer(), [30, 12, 25])
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().num_used_blocks > 0
    engine.abort_request(["r0", "r1", "r2"])
    engine.step()
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_chat_and_text_prompts(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=256)
    out = llm.chat([{"role": "user", "content": "the quick brown fox"}], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": "the quick brown fox"}], tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    text = llm.generate("the quick brown fox", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert text.prompt == "the quick brown fox" and len(text.outputs[0].token_ids) <= 5


def test_engine_add_request_takes_prompt_dicts(tiny_llama):
    """`LLMEngine.add_request` takes the same prompt forms as `LLM.generate` (vLLM's TokensPrompt
    dict included) and names a dict without a prompt."""
    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=64)
    eng = llm.engine
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.add_request("ids", [5, 6, 7], sp)
    eng.add_request("dict", {"prompt_token_ids": [5, 6, 7]}, sp)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("bad", {"text": "hi"}, sp)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["ids"] == done["dict"] and len(done["ids"]) == 3


@pytest.mark.slow  # end-to-end, over 5 s on 2 cores: CI's legs run it (issue 25: the quick suite under 5 min)
def test_repetition_penalty_parity_in_a_steady_batch(tiny_llama, monkeypatch):
    """A penalty depends on the tokens sampled so far, so the runner rebuilds that batch's sampling
    metadata every step (a plain greedy batch reuses it: one build for the whole run). Three
    prompts decoded together equal transformers' greedy `generate` with the same penalty."""
    from portside.sample.metadata import SamplingMetadata

    builds = []
    build = SamplingMetadata.build.__func__
    monkeypatch.setattr(SamplingMetadata, "build", classmethod(lambda cls, *a, **k: builds.append(1) or build(cls, *a, **k)))
    llm = LLM(model=str(tiny_llama), device="cpu", max_model_len=256, block_size=4)
    prompts = make_prompts(llm.get_tokenizer(), [7, 12, 5])
    llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert len(builds) == 1, f"a steady greedy batch built its sampling metadata {len(builds)} times"
    builds.clear()
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], penalized, use_tqdm=False)
    assert len(builds) == MAX_TOKENS
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(tiny_llama, prompt, MAX_TOKENS, repetition_penalty=1.8)
        assert expected != hf_greedy(tiny_llama, prompt, MAX_TOKENS), "the penalty changes nothing here"
        assert out.outputs[0].token_ids == expected
    assert_all_blocks_free(llm)
