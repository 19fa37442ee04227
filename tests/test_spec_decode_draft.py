"""Draft-model speculative decoding (`speculative_config={"model": DRAFT, ...}`): greedy tokens equal
transformers' and the run without speculation, batched, across chunked prefill, preemption and
prefix-cache hits, near max_model_len, and under tensor parallelism 2; seeded sampling gives the
plain run's tokens; unseeded sampling keeps the target's distribution; bad drafts are clear errors.

The drafts are the target itself (every proposal accepted: the lookahead slots and the proposals'
own KV are exercised at full depth) and the target with its weights perturbed
(`make_draft_model`, noise 0.01: every acceptance depth and rejections at each position occur),
both with the target's tokenizer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from test_spec_decode import TEXT, assert_all_blocks_free, assert_chi_square_fits, structured_run

from portside import LLM, SamplingParams
from portside.spec_decode.config import SpeculativeConfig
from portside.testing.tiny import hf_greedy, hf_logits, make_draft_model, make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("draft_target"), "llama")


@pytest.fixture(scope="module")
def draft(model, tmp_path_factory) -> Path:
    return make_draft_model(model, tmp_path_factory.mktemp("draft_noisy"), noise_std=0.01)


def make_llm(model: Path, draft: Path, k: int = 4, **kwargs) -> LLM:
    kwargs = {"device": "cpu", "max_model_len": 256, "block_size": 4} | kwargs
    return LLM(model=str(model), speculative_config={"model": str(draft), "num_speculative_tokens": k}, **kwargs)


def prompts(llm: LLM, lengths=(5, 9, 13, 3, 21)) -> list[list[int]]:
    ids = llm.get_tokenizer().encode(TEXT)
    return [ids[i : i + n] for i, n in enumerate(lengths)]


def greedy(llm: LLM, ps: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]


def test_config_parsing():
    c = SpeculativeConfig.parse({"model": "/m/draft", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens, c.num_lookahead_tokens) == ("draft_model", "/m/draft", 3, 3)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).num_lookahead_tokens == 0
    bad = {
        '{"method": "draft_model", "num_speculative_tokens": 2}': "needs 'model'",
        '{"method": "ngram", "model": "/m/d", "num_speculative_tokens": 2}': "takes no 'model'",
        '{"model": "/m/d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}': "apply to method 'ngram' only",
        '{"method": "medusa", "num_speculative_tokens": 2}': "'medusa' is not implemented",
        '{"model": "/m/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0}': "positive integer",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(text)


def test_greedy_equals_transformers_with_self_and_noisy_drafts(model, draft):
    ps = None
    for d, all_accepted in ((model, True), (draft, False)):
        llm = make_llm(model, d)
        ps = ps or prompts(llm)
        for p, got in zip(ps, greedy(llm, ps, 32)):
            assert got == hf_greedy(model, p, 32), f"draft {d.name}, prompt of {len(p)} tokens"
        s = llm.engine.stats().spec_decode
        assert s.num_drafts > 0
        if all_accepted:  # the target as its own draft: every proposal is the target's greedy token
            assert s.num_accepted_tokens == s.num_draft_tokens, s
        else:
            assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s
        assert_all_blocks_free(llm)
        llm.shutdown()


@pytest.mark.slow  # end-to-end, over 5 s on 2 cores: CI's legs run it
@pytest.mark.parametrize("noisy", [True, False], ids=["noisy-draft", "self-draft"])
def test_chunked_prefill_preemption_prefix_hits_and_the_end_of_the_context(model, draft, noisy):
    """A 16-token budget (prompts prefilled in chunks, the draft catching up in chunks too), a pool
    that forces preemption (the draft's cache of a preempted request starts over), the same prompts
    again (prefix-cache hits: the draft computes what the target took from the cache), and
    requests that end at max_model_len (proposals and lookahead slots cut there). With the target
    as its own draft every proposal is accepted: the draft's KV bookkeeping never goes stale."""
    llm = make_llm(model, draft if noisy else model, max_model_len=64, max_num_batched_tokens=16, num_kv_blocks=36,
                   max_num_seqs=8)
    ps = prompts(llm, lengths=(23, 6, 17, 11, 30, 4))
    want = {tuple(p): hf_greedy(model, p, 64 - len(p)) for p in ps}
    params = [SamplingParams(temperature=0, max_tokens=64 - len(p), ignore_eos=True) for p in ps]
    for round_ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        for p, o in zip(ps, outs):
            assert o.outputs[0].token_ids == want[tuple(p)], f"round {round_}, prompt of {len(p)} tokens"
        assert_all_blocks_free(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the pool was meant to force a preemption"
    assert stats.prefix_cache_hits > 0
    s = stats.spec_decode
    assert len(s.num_accepted_tokens_per_pos) == 4 and all(c > 0 for c in s.num_accepted_tokens_per_pos), s
    if noisy:
        assert s.num_accepted_tokens < s.num_draft_tokens, s
    else:
        assert s.num_accepted_tokens == s.num_draft_tokens, s


def test_seeded_sampling_gives_the_tokens_of_the_run_without_speculation(model):
    """The target as its own draft proposes its greedy tokens; at temperature 0.7 some are drawn
    and some not, and each verified position draws with its output position's generator."""
    plain = LLM(model=str(model), device="cpu", max_model_len=256, block_size=4)
    spec = make_llm(model, model, k=3)
    ps = prompts(plain)
    params = [SamplingParams(temperature=0.7, max_tokens=24, seed=50 + i, logprobs=1, ignore_eos=True,
                             repetition_penalty=1.2) for i in range(len(ps))]
    want = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)
    s = spec.engine.stats().spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s
    assert_all_blocks_free(spec)


@pytest.mark.slow  # end-to-end, over 5 s on 2 cores: CI's legs run it
def test_unseeded_sampling_keeps_the_target_distribution(model):
    """(t1, t2, t3) under temperature 1 and top-k 3 with the target as its own draft (after t1 it
    proposes the most likely t2, accepted or rejected for a draw from the rest): joint
    frequencies against transformers' exact probabilities, chi-square at p > 0.001."""
    llm = make_llm(model, model, k=2, max_num_seqs=256, num_kv_blocks=1500, seed=11)
    prompt = prompts(llm, lengths=(7,))[0]
    k = 3

    def top(ids):
        vals, toks = hf_logits(model, ids)[-1].topk(k)
        return toks.tolist(), torch.softmax(vals, -1).tolist()

    exact = {}
    t1s, p1 = top(prompt)
    for a, pa in zip(t1s, p1):
        for b, pb in zip(*top(prompt + [a])):
            for c, pc in zip(*top(prompt + [a, b])):
                exact[(a, b, c)] = pa * pb * pc
    params = SamplingParams(n=250, temperature=1.0, top_k=k, max_tokens=3, ignore_eos=True)
    counts: Counter = Counter()
    for _ in range(6):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        counts.update(tuple(c.token_ids) for c in out.outputs)
    s = llm.engine.stats().spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s
    assert_chi_square_fits(counts, exact)


def test_structured_requests_are_speculated_under_the_grammar(model, draft):
    """A draft model's proposals under a regex (batched with an unconstrained request): cut where
    the grammar refuses them, verified under each position's mask, tokens equal the run without
    speculation."""
    llm = make_llm(model, draft, k=3)
    plain = LLM(model=str(model), device="cpu", max_model_len=256, block_size=4)
    proposed, accepted, cut = structured_run(llm, plain, prompts(llm, lengths=(5, 13)), "[ab ]{20,40}")
    assert proposed > 0 and accepted > 0 and cut > 0, (proposed, accepted, cut)


def test_a_draft_with_another_vocabulary_is_refused(model, tmp_path, capsys):
    from portside.cli import main

    other = make_tiny_model(tmp_path / "other", "llama", added_tokens=("<extra_a>", "<extra_b>"))
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(\d+ tokens\) is not the target's"):
        make_llm(model, other)
    missing = tmp_path / "nowhere"
    for spec, message in ((f'{{"model": "{other}", "num_speculative_tokens": 2}}', "is not the target's"),
                          (f'{{"model": "{missing}", "num_speculative_tokens": 2}}', "does not exist"),
                          (f'{{"model": "{model}", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}}',
                           "differs from tensor_parallel_size 1")):
        assert main(["generate", "hi", "--model", str(model), "--device", "cpu", "--speculative-config", spec]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_tensor_parallel_2(model, draft):
    """Under -tp 2 the draft is sharded as the target is and every rank proposes alike."""
    llm = make_llm(model, draft, tensor_parallel_size=2, max_num_batched_tokens=16, num_kv_blocks=120)
    try:
        ps = prompts(llm, lengths=(6, 9, 4))
        for p, got in zip(ps, greedy(llm, ps, 24)):
            assert got == hf_greedy(model, p, 24)
        stats = llm.engine.stats()
        assert stats.spec_decode.num_accepted_tokens > 0 and stats.num_used_blocks == 0
    finally:
        llm.shutdown()
