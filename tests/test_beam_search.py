"""`LLM.beam_search(prompts, BeamSearchParams(...))`: the sequences, their order and their scores
equal transformers' `generate(num_beams=w, do_sample=False, length_penalty=...)` for widths 1, 2
and 4, with beams ending at EOS (early stopping) and at max_tokens, several prompts at once;
beams share KV blocks through the prefix cache; bad parameters are clear errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from portside import LLM, BeamSearchOutput, BeamSearchParams
from portside.sampling_params import MAX_BEAM_WIDTH
from portside.sampling_params import BeamSearchParams as BeamSearchParamsFromModule
from portside.testing.tiny import hf_greedy, hf_model, make_tiny_model

TEXT = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("beam_llama"), "llama")


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model=str(model), device="cpu", max_model_len=128, block_size=4)


@torch.no_grad()
def hf_beams(model: Path, ids: list[int], w: int, max_new: int, length_penalty: float, eos: list[int]):
    hf = hf_model(model)
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=w, num_return_sequences=w, do_sample=False,
                      max_new_tokens=max_new, length_penalty=length_penalty, eos_token_id=eos, pad_token_id=eos[0],
                      output_scores=True, return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(ids):]
        for i, t in enumerate(gen):  # finished beams are padded after their EOS
            if t in eos:
                gen = gen[: i + 1]
                break
        seqs.append(gen)
    scores = out.sequences_scores.tolist() if w > 1 else [None]
    return seqs, scores


def check(llm: LLM, model: Path, prompts: list[list[int]], w: int, max_new: int, lp: float, eos: list[int]) -> list:
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=w, max_tokens=max_new, length_penalty=lp))
    reasons = []
    for p, out in zip(prompts, outs):
        assert isinstance(out, BeamSearchOutput)
        want, scores = hf_beams(model, p, w, max_new, lp, eos)
        got = [s.tokens[len(p):] for s in out.sequences]
        assert got == want, f"width {w}, length_penalty {lp}, prompt of {len(p)} tokens"
        for s, score in zip(out.sequences, scores):
            assert s.tokens[: len(p)] == p
            gen_len = len(s.tokens) - len(p)
            assert s.score == pytest.approx(s.cum_logprob / gen_len**lp, abs=1e-5)
            if score is not None:
                assert s.score == pytest.approx(score, abs=1e-4)
            assert s.cum_logprob == pytest.approx(sum(next(iter(e.values())).logprob for e in s.logprobs), abs=1e-4)
            reasons.append(s.finish_reason)
        assert out.sequences[0].text == llm.get_tokenizer().decode(got[0], skip_special_tokens=True)
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()
    return reasons


@pytest.mark.parametrize("w", [1, 2, 4])
@pytest.mark.parametrize("lp", [1.0, 0.5, 2.0])
def test_equals_transformers(llm, model, w, lp):
    ids = llm.get_tokenizer().encode(TEXT)
    prompts = [ids[:6], ids[3:14]]
    reasons = check(llm, model, prompts, w, 9, lp, [llm.engine.eos_token_id])
    assert set(reasons) == {"length"}


@pytest.mark.slow  # end-to-end, over 5 s on 2 cores: CI's legs run it (issue 25: the quick suite under 5 min)
def test_beams_ending_at_eos_and_early_stopping(tmp_path):
    """A frequent continuation made an extra EOS (generation_config.json), so beams end at it
    and transformers' early-stopping heuristic decides when the search is over."""
    path = make_tiny_model(tmp_path / "m", "llama")
    probe = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4, generation_config="vllm")
    ids = probe.get_tokenizer().encode(TEXT)
    prompts = [ids[:5], ids[2:9], ids[4:8]]
    counts = Counter(t for p in prompts for t in hf_greedy(path, p, 12))
    frequent = counts.most_common(1)[0][0]
    probe.shutdown()
    primary = probe.engine.eos_token_id
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [primary, frequent]}))
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4)
    reasons = []
    for w in (2, 4):
        for lp in (1.0, 0.5):
            reasons += check(llm, path, prompts, w, 12, lp, [primary, frequent])
    assert "stop" in reasons and "length" in reasons


def test_beams_share_kv_blocks(llm):
    ids = llm.get_tokenizer().encode(TEXT)[:13]
    before = llm.engine.stats().prefix_cache_hits
    llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=4, max_tokens=8))
    assert llm.engine.stats().prefix_cache_hits - before >= 7 * 4 * 12  # every beam, every step: the prompt's 3 blocks


def test_text_prompts_and_import_paths(llm):
    assert BeamSearchParamsFromModule is BeamSearchParams
    (out,) = llm.beam_search(["the quick brown fox"], BeamSearchParams(beam_width=2, max_tokens=4))
    assert len(out.sequences) == 2 and out.sequences[0].score >= out.sequences[1].score
    assert out.sequences[0].tokens[:-4] == llm.get_tokenizer().encode("the quick brown fox")


def test_bad_parameters(llm, model):
    for kwargs, message in [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width must be an integer from 1"),
        ({"beam_width": MAX_BEAM_WIDTH + 1, "max_tokens": 4}, "beam_width must be an integer from 1"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": 0.7}, "temperature must be 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match="raise max_logprobs"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    assert llm.engine.stats().num_used_blocks == 0
