"""`logprobs_mode` (issue 50), vLLM's four values, checked against transformers' logits of the
same tiny checkpoint: raw log-softmax (the default), raw logits, and the processed values a token
was sampled from (temperature and top-k applied, truncated tokens -inf; a greedy row's after the
penalties); a bad mode is refused naming the choices."""

from __future__ import annotations

import math

import pytest
import torch

from portside import LLM, SamplingParams
from portside.testing.tiny import hf_logits, make_tiny_model

PROMPT = [5, 9, 23, 41, 7, 8, 99, 3, 17]
ENGINE = dict(device="cpu", max_model_len=64, block_size=4, num_kv_blocks=32)
TOL = 2e-3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lpm") / "m")


def first_step(model, mode: str, params: SamplingParams):
    """(the sampled token's value, {top token: value}) of the first generated token, and the oracle's logits."""
    with LLM(str(model), logprobs_mode=mode, **ENGINE) as llm:
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    token = out.token_ids[0]
    step = out.logprobs[0]
    return token, {t: lp.logprob for t, lp in step.items()}, hf_logits(model, PROMPT)[-1]


def test_raw_logprobs_and_raw_logits(model):
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    token, values, logits = first_step(model, "raw_logprobs", params)
    want = logits.log_softmax(-1)
    assert token == int(logits.argmax())
    for t, v in values.items():
        assert v == pytest.approx(float(want[t]), abs=TOL)
    token, values, logits = first_step(model, "raw_logits", params)
    assert set(values) >= set(logits.topk(3).indices.tolist())
    for t, v in values.items():
        assert v == pytest.approx(float(logits[t]), abs=TOL)


def test_processed_values_are_what_a_token_was_sampled_from(model):
    params = SamplingParams(temperature=0.5, top_k=4, max_tokens=1, logprobs=6, seed=7)
    token, values, logits = first_step(model, "processed_logits", params)
    scaled = logits / 0.5
    kept = scaled.topk(4).indices.tolist()
    assert token in kept
    for t, v in values.items():
        assert (v == pytest.approx(float(scaled[t]), abs=TOL)) if t in kept else v == -math.inf
    token, values, logits = first_step(model, "processed_logprobs", params)
    masked = torch.full_like(logits, -math.inf)
    masked[kept] = (logits / 0.5)[kept]
    want = masked.log_softmax(-1)
    assert sum(math.exp(v) for t, v in values.items() if t in kept) == pytest.approx(1.0, abs=1e-3)
    for t in kept:
        assert values[t] == pytest.approx(float(want[t]), abs=TOL)


def test_processed_greedy_row_has_the_penalties(model):
    # a prompt token repeated: the repetition penalty divides its (positive) logit
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, repetition_penalty=2.0)
    token, values, logits = first_step(model, "processed_logits", params)
    penalized = logits.clone()
    for t in set(PROMPT):
        penalized[t] = penalized[t] / 2.0 if penalized[t] > 0 else penalized[t] * 2.0
    assert token == int(penalized.argmax())
    for t, v in values.items():
        assert v == pytest.approx(float(penalized[t]), abs=TOL)


def test_bad_mode_refused(model):
    with pytest.raises(ValueError, match="logprobs-mode must be one of raw_logprobs, raw_logits"):
        LLM(str(model), logprobs_mode="logits", **ENGINE)


def test_beam_search_needs_logprobs(model):
    from portside.sampling_params import BeamSearchParams

    with LLM(str(model), logprobs_mode="raw_logits", **ENGINE) as llm:
        with pytest.raises(ValueError, match="beam search ranks beams by logprobs"):
            llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=2))
