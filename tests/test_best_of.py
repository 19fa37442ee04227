"""`SamplingParams(n, best_of)`: best_of sequences are sampled and the n with the highest
cumulative logprob come back, best first; the ranking is checked against the same seeded
request with n=best_of and logprobs returned. Bad values are clear errors; no block leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from portside import LLM, SamplingParams
from portside.sampling_params import MAX_BEST_OF, RequestOutputKind
from portside.testing.tiny import make_tiny_model

TEXT = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun"


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path: Path = make_tiny_model(tmp_path_factory.mktemp("best_of_llama"), "llama")
    return LLM(model=str(path), device="cpu", max_model_len=128, block_size=4)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_used_blocks == 0, f"{stats.num_used_blocks} KV blocks still in use"
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("n,best_of", [(2, 5), (1, 3)])
def test_returns_the_n_best_by_cumulative_logprob(llm, n, best_of):
    ids = llm.get_tokenizer().encode(TEXT)[:11]
    common = dict(temperature=1.0, max_tokens=8, seed=1234)
    (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=n, best_of=best_of, **common), use_tqdm=False)
    (ref,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=best_of, logprobs=0, **common), use_tqdm=False)
    assert len(ref.outputs) == best_of
    for c in ref.outputs:  # the reference's cumulative logprob is the sum of its sampled tokens' logprobs
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)))
    ranked = sorted(ref.outputs, key=lambda c: -c.cumulative_logprob)
    assert len({tuple(c.token_ids) for c in ref.outputs}) > n  # the samples differ: the choice matters
    assert [c.index for c in ranked[:n]] != list(range(n))  # and the best are not simply the first n
    assert [c.index for c in out.outputs] == list(range(n))
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:n]]
    for got, want in zip(out.outputs, ranked):
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-5)
        assert got.logprobs is None  # tracked for the ranking, not returned unasked
        assert got.text == want.text
    assert out.num_dropped_tokens == sum(len(c.token_ids) for c in ranked[n:])
    assert_all_blocks_free(llm)


def test_with_logprobs_and_only_final_outputs(llm):
    ids = llm.get_tokenizer().encode(TEXT)[:7]
    engine = llm.engine
    engine.add_request("b", ids, SamplingParams(n=2, best_of=4, max_tokens=6, seed=3, logprobs=2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 1 and outputs[0].finished  # the best are known only at the end
    for c in outputs[0].outputs:
        assert len(c.logprobs) == len(c.token_ids)
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)))
    assert outputs[0].outputs[0].cumulative_logprob >= outputs[0].outputs[1].cumulative_logprob
    assert_all_blocks_free(llm)


def test_abort_frees_every_sample(llm):
    ids = llm.get_tokenizer().encode(TEXT)[:9]
    engine = llm.engine
    engine.add_request("a", ids, SamplingParams(n=1, best_of=4, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_used_blocks > 0
    engine.abort_request("a")
    engine.step()
    assert_all_blocks_free(llm)


def test_bad_values():
    with pytest.raises(ValueError, match=r"best_of must be at least n \(3\), got 2"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match=f"best_of must be at most {MAX_BEST_OF}"):
        SamplingParams(best_of=MAX_BEST_OF + 1)
    with pytest.raises(ValueError, match="best_of greater than n cannot be streamed"):
        SamplingParams(n=1, best_of=2, output_kind=RequestOutputKind.DELTA)
    assert SamplingParams(n=30, best_of=30).num_samples == 30  # best_of == n is plain n
    assert SamplingParams(n=2).num_samples == 2
