"""Speculative decoding (`speculative_config`): greedy tokens equal transformers' and the run
without speculation, batched, across block boundaries, chunked prefill, preemption and
prefix-cache hits; seeded sampling gives the very tokens of the run without it (penalties,
min_tokens, logprobs and stop strings included); unseeded sampling keeps the target distribution
(a chi-square test against transformers' exact probabilities); bad configs are clear errors;
requests under a grammar are speculated with a mask per verified position (`structured_run`).

Random tiny models rarely repeat themselves, so besides the real ngram proposer the verification
is driven by a proposer that knows transformers' continuation and corrupts some of it: every
acceptance depth, a rejection at each position, and the bonus token all occur."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from portside import LLM, SamplingParams
from portside.runner.sampling import accepted_tokens
from portside.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from portside.spec_decode.ngram import NgramProposer
from portside.testing.tiny import hf_greedy, hf_logits, make_tiny_model

TEXT = ("the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun "
        "and the river runs to the sea under a bright sky full of birds ") * 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec_llama"), "llama")


def make_llm(model: Path, **kwargs) -> LLM:
    kwargs = {"device": "cpu", "max_model_len": 256, "block_size": 4, "speculative_config": NGRAM} | kwargs
    return LLM(model=str(model), **kwargs)


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return make_llm(model)


@pytest.fixture(scope="module")
def plain(model) -> LLM:
    return make_llm(model, speculative_config=None)


def prompts(llm: LLM, lengths=(5, 9, 13, 3, 21)) -> list[list[int]]:
    ids = llm.get_tokenizer().encode(TEXT)
    return [ids[i : i + n] for i, n in enumerate(lengths)]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_used_blocks == 0, f"{stats.num_used_blocks} KV blocks still in use"
    llm.engine.scheduler.check_integrity()


def structured_run(llm: LLM, plain: LLM, ps: list[list[int]], regex: str, n: int = 48,
                   **sampling) -> tuple[int, int, int]:
    """Each prompt under `regex`, batched with the same prompt unconstrained (greedy unless
    `sampling` says otherwise): both requests' tokens equal the run without speculation, each
    constrained output matches the regex (or, cut by max_tokens, a prefix of a match), every block
    is freed. Returns the proposals verified, accepted and cut by the grammar before verification."""
    import re

    from portside import StructuredOutputsParams

    sampling = {"temperature": 0.0} | sampling
    under = SamplingParams(max_tokens=n, structured_outputs=StructuredOutputsParams(regex=regex), **sampling)
    free = SamplingParams(max_tokens=n, ignore_eos=True, **sampling)
    reqs = [{"prompt_token_ids": p} for p in ps for _ in (0, 1)]
    params = [under, free] * len(ps)
    before = llm.engine.stats().spec_decode
    counts = before.num_draft_tokens, before.num_accepted_tokens, before.num_draft_tokens_cut_by_grammar
    got = [o.outputs[0] for o in llm.generate(reqs, params, use_tqdm=False)]
    want = [o.outputs[0] for o in plain.generate(reqs, params, use_tqdm=False)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g in got[::2]:
        assert g.finish_reason == "stop" and re.fullmatch(regex, g.text), g
    assert_all_blocks_free(llm)
    after = llm.engine.stats().spec_decode
    return (after.num_draft_tokens - counts[0], after.num_accepted_tokens - counts[1],
            after.num_draft_tokens_cut_by_grammar - counts[2])


class ScriptedProposer:
    """Proposes `continuation(tokens)`'s next k tokens, with every `wrong_at`-th proposal
    position (1-based, cycling through the steps) replaced by a wrong token."""

    def __init__(self, continuation, k: int = 4) -> None:
        self.continuation, self.k, self.step = continuation, k, 0

    def propose(self, token_ids, k=None):
        self.step += 1
        good = self.continuation(list(token_ids))[: self.k]
        wrong_at = self.step % (self.k + 2)  # 0 or k+1: all correct, else one wrong position
        return [(t + 1) % 300 if i + 1 == wrong_at else t for i, t in enumerate(good)]


def use_proposer(llm: LLM, proposer) -> None:
    llm.engine.executor.runner.ngram = proposer


# ---- units -------------------------------------------------------------------------------


def test_config_parsing_and_errors():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert SpeculativeConfig.parse(None) is None
    bad = {
        "{not json": "not valid JSON",
        '["ngram"]': "must be an object",
        '{"method": "medusa2", "num_speculative_tokens": 2}': "unknown method 'medusa2'",
        '{"num_speculative_tokens": 2}': "needs 'method'",
        '{"method": "ngram", "num_speculative_tokens": 0}': "num_speculative_tokens must be an integer from 1",
        '{"method": "ngram", "num_speculative_tokens": -3}': "num_speculative_tokens",
        f'{{"method": "ngram", "num_speculative_tokens": {MAX_SPECULATIVE_TOKENS + 1}}}': "num_speculative_tokens",
        '{"method": "ngram", "num_speculative_tokens": true}': "num_speculative_tokens",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}': "prompt_lookup_min",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}': "prompt_lookup_min",
        '{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}': "unknown field(s) lookahead",
        '{"method": "medusa", "num_speculative_tokens": 2}': "'medusa' is not implemented",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            SpeculativeConfig.parse(text)


def test_ngram_proposer():
    p = NgramProposer(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_min": 1, "prompt_lookup_max": 3}))
    assert p.propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]  # the longest suffix that occurred before: [1, 2]
    assert p.propose([9, 1, 2, 3, 9, 1]) == [2, 3, 9]
    assert p.propose([5, 6, 7]) == []  # nothing repeats
    assert p.propose([7, 1, 2, 8, 5, 1, 2, 6, 1, 2]) == [6, 1, 2]  # the most recent occurrence
    assert p.propose([1, 2, 1, 2, 1, 2]) == [1, 2]  # the continuation runs into the suffix itself
    assert p.propose([4]) == [] and p.propose([4, 4], k=0) == []
    two = NgramProposer(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_min": 2, "prompt_lookup_max": 2}))
    assert two.propose([3, 1, 5, 2, 1]) == []  # a single repeated token is below prompt_lookup_min


def test_accepted_tokens():
    assert accepted_tokens([5], []) == [5]
    assert accepted_tokens([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted plus the bonus
    assert accepted_tokens([5, 6, 7], [5, 9]) == [5, 6]  # second rejected: the target's draw replaces it
    assert accepted_tokens([4, 6, 7], [5, 6]) == [4]  # a rejection ends the step


# ---- greedy parity --------------------------------------------------------------------------


@pytest.mark.slow  # end-to-end, over 5 s on 2 cores: CI's legs run it (issue 25: the quick suite under 5 min)
def test_greedy_equals_transformers_with_ngram(model, llm, plain):
    ps = prompts(llm)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    want = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for p, g, w in zip(ps, got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids == hf_greedy(model, p, 48)
        assert g.spec_decode_stats is not None and w.spec_decode_stats is None
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens > 0
    assert_all_blocks_free(llm)


@pytest.mark.slow  # end-to-end, over 5 s on 2 cores: CI's legs run it (issue 25: the quick suite under 5 min)
def test_every_acceptance_depth_across_chunks_preemption_and_prefix_hits(model):
    """A proposer that knows transformers' continuation (one wrong position in most steps), a
    small token budget (chunked prefill mixed with verification rows), a pool that forces
    preemption, then the same prompts again (prefix-cache hits)."""
    llm = make_llm(model, max_model_len=96, max_num_batched_tokens=16, num_kv_blocks=30, max_num_seqs=8)
    ps = prompts(llm, lengths=(23, 6, 17, 11, 30, 4))
    n = 40
    refs = {tuple(p): hf_greedy(model, p, n) for p in ps}

    def continuation(tokens):
        for p, ref in refs.items():
            if tuple(tokens[: len(p)]) == p:
                return ref[len(tokens) - len(p) :]
        raise AssertionError("unknown sequence")

    use_proposer(llm, ScriptedProposer(continuation))
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for round_ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        for p, o in zip(ps, outs):
            assert o.outputs[0].token_ids == refs[tuple(p)], f"round {round_}, prompt of {len(p)} tokens"
        assert_all_blocks_free(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the pool was meant to force a preemption"
    assert stats.prefix_cache_hits > 0
    per_pos = stats.spec_decode.num_accepted_tokens_per_pos
    assert len(per_pos) == 4 and all(c > 0 for c in per_pos), per_pos  # every depth accepted at some step
    assert stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens  # and rejections


# ---- sampling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [
    {},
    {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2},
    {"min_tokens": 6, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "logit_bias": {7: 3.0}},
])
def test_seeded_sampling_gives_the_tokens_of_the_run_without_speculation(model, llm, plain, extra):
    """Each verified position draws with the generator of its output position, so a seeded
    request's tokens (and their logprobs) equal those without speculation."""
    ps = prompts(llm)
    params = [SamplingParams(temperature=0.8, max_tokens=30, seed=100 + i, logprobs=2, ignore_eos=True, **extra)
              for i in range(len(ps))]

    def greedy_like(tokens):  # propose what the plain run sampled, so most proposals are accepted
        for p, ref in want_by_prompt.items():
            if tuple(tokens[: len(p)]) == p:
                return ref[len(tokens) - len(p) :]
        return []

    want = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    want_by_prompt = {tuple(p): w.outputs[0].token_ids for p, w in zip(ps, want)}
    spec_llm = make_llm(model)
    use_proposer(spec_llm, ScriptedProposer(greedy_like))
    got = spec_llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4)
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)
    assert spec_llm.engine.stats().spec_decode.num_accepted_tokens > 0
    assert_all_blocks_free(spec_llm)


@pytest.mark.slow  # end-to-end, over 5 s on 2 cores: CI's legs run it (issue 25: the quick suite under 5 min)
def test_stop_strings_stop_tokens_and_max_tokens_inside_accepted_proposals(model, llm, plain):
    ps = prompts(llm)
    base = plain.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=30,
                                                                              ignore_eos=True), use_tqdm=False)
    refs = {tuple(p): b.outputs[0].token_ids for p, b in zip(ps, base)}
    spec_llm = make_llm(model)
    use_proposer(spec_llm, ScriptedProposer(lambda t: next(
        (r[len(t) - len(p):] for p, r in refs.items() if tuple(t[: len(p)]) == p), [])))
    for i, (p, b) in enumerate(zip(ps, base)):
        text, ids = b.outputs[0].text, b.outputs[0].token_ids
        cases = [
            SamplingParams(temperature=0, max_tokens=7 + i, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[9 + i]], ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0, max_tokens=30, stop=[text[len(text) // 2 : len(text) // 2 + 3]],
                           ignore_eos=True, logprobs=1),
        ]
        for params in cases:
            (g,) = spec_llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            (w,) = plain.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            assert (g.outputs[0].token_ids, g.outputs[0].text) == (w.outputs[0].token_ids, w.outputs[0].text)
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
            assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
    assert_all_blocks_free(spec_llm)


@pytest.mark.slow  # end-to-end, over 5 s on 2 cores: CI's legs run it (issue 25: the quick suite under 5 min)
def test_unseeded_sampling_keeps_the_target_distribution(model):
    """(t1, t2, t3) under temperature 1 and top-k 3, with the most likely t2 proposed after t1
    (accepted, or rejected for a draw from the rest): the joint frequencies against transformers'
    exact probabilities, chi-square at p > 0.001."""
    llm = make_llm(model, max_num_seqs=256, num_kv_blocks=1200, seed=7)
    prompt = prompts(llm, lengths=(7,))[0]
    k, temp = 3, 1.0

    def top(ids):
        logits = hf_logits(model, ids)[-1] / temp
        vals, toks = logits.topk(k)
        return toks.tolist(), torch.softmax(vals, -1).tolist()

    t1s, p1 = top(prompt)
    exact, likely_t2 = {}, {}
    for a, pa in zip(t1s, p1):
        t2s, p2 = top(prompt + [a])
        likely_t2[a] = t2s[0]
        for b, pb in zip(t2s, p2):
            t3s, p3 = top(prompt + [a, b])
            for c, pc in zip(t3s, p3):
                exact[(a, b, c)] = pa * pb * pc
    use_proposer(llm, ScriptedProposer(lambda t: [likely_t2[t[-1]]] if len(t) == len(prompt) + 1 else [], k=1))
    params = SamplingParams(n=250, temperature=temp, top_k=k, max_tokens=3, ignore_eos=True)
    counts: Counter = Counter()
    for _ in range(8):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        counts.update(tuple(c.token_ids) for c in out.outputs)
    stats = llm.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both branches of the verification ran
    assert_chi_square_fits(counts, exact)


def assert_chi_square_fits(counts: Counter, exact: dict) -> None:
    """Observed outcome counts fit the exact probabilities (chi-square, p > 0.001; cells expecting
    fewer than 5 pooled into one)."""
    total = sum(counts.values())
    assert set(counts) <= set(exact)
    cells = [c for c in exact if exact[c] * total >= 5]  # the chi-square approximation's rule
    rest = 1.0 - sum(exact[c] for c in cells)
    observed = [counts[c] for c in cells] + [total - sum(counts[c] for c in cells)]
    expected = [exact[c] * total for c in cells] + [rest * total]
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64))
    assert p_value.item() > 1e-3, f"chi2 {chi2:.1f} on {dof} dof over {total} samples"


def test_embed_task_refuses_speculation(model):
    with pytest.raises(ValueError, match="task embed never decodes"):
        make_llm(model, task="embed")


@pytest.mark.parametrize("backend", ["llguidance", pytest.param("xgrammar", marks=pytest.mark.xgrammar)])
def test_structured_output_requests_are_speculated_under_the_grammar(model, plain, backend):
    """ngram proposals (k = 3) of a request under a regex: the grammar's mask after each proposal
    masks its verify row, proposals the grammar refuses are cut before verification, and the
    tokens equal the run without speculation, batched with an unconstrained request; seeded
    sampling too. Both grammar engines (xgrammar: the triton leg has it)."""
    if backend == "xgrammar":
        pytest.importorskip("xgrammar", reason="the xgrammar extra is not installed (the triton leg has it)")
        plain = make_llm(model, speculative_config=None, structured_outputs_backend=backend)
    spec = NGRAM | {"num_speculative_tokens": 3}
    llm = make_llm(model, speculative_config=spec, structured_outputs_backend=backend)
    ps = prompts(llm, lengths=(5, 13))
    proposed, accepted, cut = structured_run(llm, plain, ps, "[ab ]{20,40}")
    assert proposed > 0 and accepted > 0 and cut > 0, (proposed, accepted, cut)
    proposed, accepted, cut = structured_run(llm, plain, ps, "(the |a |dog ){4,10}", temperature=0.9, seed=7)
    assert proposed > 0 and accepted > 0, (proposed, accepted, cut)


def test_a_matcher_without_rollback_is_not_speculated(model, plain):
    """A grammar backend whose matchers cannot roll back (a plugin's): its requests are never
    speculated, and still give the tokens of the run without speculation."""
    from portside import StructuredOutputsParams

    llm = make_llm(model, speculative_config=NGRAM | {"num_speculative_tokens": 3})
    backend = llm.engine.structured.backend
    compile_ = backend.compile

    class NoRollback:  # delegates to the real matcher, without `rollback`
        def __init__(self, m):
            self.m = m
            self.accept_token, self.fill_bitmask = m.accept_token, m.fill_bitmask
            self.is_terminated, self.error = m.is_terminated, m.error

    class Grammar:
        def __init__(self, g):
            self.g = g

        def matcher(self):
            return NoRollback(self.g.matcher())

    backend.compile = lambda params: Grammar(compile_(params))
    proposed, accepted, cut = structured_run(llm, plain, prompts(llm, lengths=(5,)), "[ab ]{20,40}")
    assert proposed > 0 and cut > 0  # the unconstrained request's proposals; every constrained one cut
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(regex="[ab ]{20,40}"))
    (alone,) = llm.generate([{"prompt_token_ids": prompts(llm)[0]}], params, use_tqdm=False)
    assert alone.spec_decode_stats is None or alone.spec_decode_stats.num_draft_tokens == 0
    assert llm.engine.stats().spec_decode.num_draft_tokens_cut_by_grammar > cut


def test_cli_refuses_a_bad_config(model, capsys):
    from portside.cli import main

    for value in ('{"method": "foo", "num_speculative_tokens": 2}', '{"method": "ngram", "num_speculative_tokens": 0}'):
        assert main(["generate", "hi", "--model", str(model), "--device", "cpu", "--speculative-config", value]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'foo'" in err and "num_speculative_tokens must be an integer" in err


def test_proposals_count_in_the_token_budget(model):
    """Proposals count in the token budget: with a budget of 3 tokens a step, requests verifying
    4 proposals are cut, never starved, and the output is unchanged."""
    llm = make_llm(model, max_num_batched_tokens=3, max_num_seqs=3, max_model_len=64)
    ps = prompts(llm, lengths=(3, 2, 3))
    refs = {tuple(p): hf_greedy(model, p, 20) for p in ps}
    use_proposer(llm, ScriptedProposer(lambda t: next(
        (r[len(t) - len(p):] for p, r in refs.items() if tuple(t[: len(p)]) == p), [])))
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=20,
                                                                           ignore_eos=True), use_tqdm=False)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == refs[tuple(p)]
    assert_all_blocks_free(llm)



@pytest.mark.slow
def test_tensor_parallel_2(model):
    """Under -tp 2 every rank verifies rank 0's draws; prompts that quote a stretch of
    transformers' own continuation give the ngram proposer something to find."""
    llm = make_llm(model, tensor_parallel_size=2, max_num_batched_tokens=16, num_kv_blocks=120)
    try:
        base = prompts(llm, lengths=(6, 9, 4))
        ps = [p + hf_greedy(model, p, 12) + p for p in base]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        for p, o in zip(ps, outs):
            assert o.outputs[0].token_ids == hf_greedy(model, p, 24)
        stats = llm.engine.stats()
        assert stats.spec_decode.num_drafts > 0 and stats.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_backoff_after_rejected_drafts():
    from portside.spec_decode.backoff import MAX_SKIP, ProposalBackoff

    b = ProposalBackoff()
    assert b.allows("a")
    b.record("a", 4, 0)  # a whole draft rejected: skip 1 step
    assert [b.allows("a") for _ in range(2)] == [False, True]
    b.record("a", 4, 0)  # again: 2 steps, then 4, ... up to MAX_SKIP
    assert [b.allows("a") for _ in range(3)] == [False, False, True]
    for _ in range(8):
        b.record("a", 3, 0)
    assert sum(not b.allows("a") for _ in range(MAX_SKIP + 4)) == MAX_SKIP
    b.record("a", 3, 1)  # an accepted proposal resets it
    b.record("a", 3, 0)
    assert [b.allows("a") for _ in range(2)] == [False, True]
    b.record("b", 0, 0)  # nothing proposed: nothing learned
    assert b.allows("b")
    b.record("b", 2, 0)
    b.forget("b")
    assert b.allows("b")
