"""Sampler tests: every SamplingParams field against a readable per-row torch reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from portside.sample.metadata import SamplingMetadata, row_seed
from portside.sample.penalties import apply_logit_bias, apply_min_tokens, apply_penalties
from portside.sample.sampler import Sampler
from portside.sample.truncation import apply_min_p, apply_top_k_top_p
from portside.sampling_params import SamplingParams as SP

V = 32
EOS = 3


# ---------------------------------------------------------------- reference (one row at a time)


def ref_process(logits: torch.Tensor, p: SP, prompt: list[int], output: list[int], eos: int | None) -> torch.Tensor:
    """logit_bias, min_tokens, repetition / frequency / presence penalties on one row [V]."""
    x = logits.clone().double()
    for tok, bias in (p.logit_bias or {}).items():
        x[tok] += bias
    if len(output) < p.min_tokens:
        banned = list(p.stop_token_ids or []) + ([eos] if eos is not None and not p.ignore_eos else [])
        for tok in banned:
            x[tok] = -math.inf
    for tok in set(prompt) | set(output):
        if x[tok] > 0:
            x[tok] /= p.repetition_penalty
        else:
            x[tok] *= p.repetition_penalty
    for tok in set(output):
        x[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return x.float()


def ref_keep(logits: torch.Tensor, temperature: float, min_p: float, top_k: int, top_p: float) -> list[bool]:
    """Which tokens of one row [V] survive temperature, min-p, top-k and top-p (ties kept together)."""
    x = logits.double() / temperature
    keep = [True] * len(x)
    probs = torch.softmax(x, dim=0)
    for t in range(len(x)):
        if probs[t] < min_p * probs.max():
            keep[t] = False
    if top_k != -1:
        kth = sorted((x[t].item() for t in range(len(x)) if keep[t]), reverse=True)[min(top_k, sum(keep)) - 1]
        keep = [k and x[t].item() >= kth for t, k in enumerate(keep)]
    if top_p < 1.0:
        kept = [t for t in range(len(x)) if keep[t]]
        probs = torch.softmax(x[kept], dim=0)
        order = sorted(range(len(kept)), key=lambda j: -probs[j].item())
        total, cutoff = 0.0, None
        for j in order:  # most likely first, until the mass reaches top_p
            total += probs[j].item()
            cutoff = x[kept[j]].item()
            if total >= top_p:
                break
        keep = [k and x[t].item() >= cutoff for t, k in enumerate(keep)]
    return keep


def ref_distribution(logits: torch.Tensor, temperature: float, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    keep = torch.tensor(ref_keep(logits, temperature, min_p, top_k, top_p))
    x = (logits.double() / temperature).masked_fill(~keep, -math.inf)
    return torch.softmax(x, dim=0)


def build(params, prompts=None, outputs=None, eos=EOS, vocab=V):
    n = len(params)
    prompts = prompts if prompts is not None else [[1, 2]] * n
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return SamplingMetadata.build(params, prompts, outputs, eos, vocab, "cpu")


# ---------------------------------------------------------------- greedy and fast path


def test_greedy_is_argmax_and_takes_the_fast_path():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    params = [
        SP(temperature=0.0),
        SP(temperature=1e-6),
        SP(top_k=1),
        SP(temperature=0.0, top_p=0.5),
        SP(top_k=1, temperature=2.0),
    ]
    md = build(params)
    assert md.all_greedy and md.no_penalties and not md.needs_logits_processing
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.max_num_logprobs is None
    assert md.generators == {}
    before = logits.clone()
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    params = [SP(temperature=0.0), SP(temperature=1.0), SP(temperature=0.0), SP(top_p=0.5, seed=1), SP(top_k=1), SP()]
    md = build(params)
    assert not md.all_greedy and not md.all_random
    for _ in range(5):
        out = Sampler()(logits, md).sampled_token_ids
        for i in (0, 2, 4):
            assert out[i] == logits[i].argmax()


# ---------------------------------------------------------------- truncation masks


def _masks_vs_reference(logits, params):
    md = build(params)
    x = logits / md.temperature[:, None]
    if md.min_p is not None:
        x = apply_min_p(x, md.min_p)
    x = apply_top_k_top_p(x, md.top_k, md.top_p)
    for i, p in enumerate(params):
        expected = ref_keep(logits[i], p.temperature, p.min_p, p.top_k, p.top_p)
        assert torch.isfinite(x[i]).tolist() == expected, f"row {i}: {p}"


@pytest.mark.parametrize("seed", range(4))
def test_truncation_matches_reference_random_rows(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, V, generator=g) * 2
    params = [
        SP(top_k=5),
        SP(top_p=0.7, temperature=0.8),
        SP(min_p=0.1, temperature=1.5),
        SP(top_k=10, top_p=0.5, min_p=0.05),
        SP(top_k=V + 10),  # larger than the vocabulary: no-op
        SP(min_p=0.0, top_p=1.0),  # nothing
        SP(top_k=2, temperature=0.3),
        SP(top_p=0.95, top_k=20, temperature=1.2),
    ]
    _masks_vs_reference(logits, params)


def test_truncation_edge_cases():
    logits = torch.randn(1, V).repeat(6, 1)
    logits[:, 7] = 10.0  # a clear maximum
    tied = torch.zeros(V)
    tied[[4, 9, 20]] = 3.0  # three tokens tied at the top
    tied[[5, 6]] = 2.0  # two tied just below
    logits[3] = tied
    logits[4] = tied
    logits[5] = tied
    params = [
        SP(top_p=1e-9),  # tiny top_p (1 - top_p rounds to 1.0 in fp32) keeps only the max
        SP(min_p=0.0),
        SP(min_p=1.0),  # only tokens as likely as the max
        SP(top_k=2),  # k-th value is tied: all three top tokens stay
        SP(top_k=4),  # boundary inside the tied pair below: both stay
        SP(top_p=1e-9, temperature=0.5),  # tiny top_p with ties at the top keeps all ties
    ]
    _masks_vs_reference(logits, params)
    md = build(params)
    x = apply_top_k_top_p(logits / md.temperature[:, None], md.top_k, md.top_p)
    assert torch.isfinite(x[0]).nonzero().flatten().tolist() == [7]
    assert torch.isfinite(x[3]).nonzero().flatten().tolist() == [4, 9, 20]
    assert torch.isfinite(x[4]).nonzero().flatten().tolist() == [4, 5, 6, 9, 20]
    assert torch.isfinite(x[5]).nonzero().flatten().tolist() == [4, 9, 20]


def test_top_k_one_mask_keeps_only_the_max():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]])
    x = apply_top_k_top_p(logits, torch.tensor([1]), None)
    assert torch.isfinite(x).tolist() == [[False, True, False, False]]


def test_sampled_tokens_stay_inside_the_kept_set():
    torch.manual_seed(2)
    base = torch.randn(V) * 2
    params = [SP(top_k=4), SP(top_p=0.6), SP(min_p=0.2), SP(top_k=6, top_p=0.8, temperature=0.5)]
    for p in params:
        keep = ref_keep(base, p.temperature, p.min_p, p.top_k, p.top_p)
        rows = [p] * 200
        out = Sampler()(base.repeat(200, 1), build(rows)).sampled_token_ids
        assert all(keep[t] for t in out.tolist()), p


# ---------------------------------------------------------------- penalties, bias, min_tokens


def test_penalties_bias_min_tokens_match_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g) * 3
    params = [
        SP(repetition_penalty=1.5),
        SP(repetition_penalty=0.7, frequency_penalty=0.5),
        SP(presence_penalty=1.0, frequency_penalty=-0.3),
        SP(logit_bias={0: 5.0, 31: -100.0, 4: 0.25}),
        SP(min_tokens=3, stop_token_ids=[5, 6], repetition_penalty=1.2, presence_penalty=-1.5),
        SP(),  # no penalties on this row, in a batch that has them
    ]
    prompts = [[1, 2, 2, 9], [4, 4], [7], [0], [5, 8, 8], [1, 2, 3]]
    outputs = [[9, 10, 10], [4, 11, 11, 11], [7, 7, 12], [], [13, 5], [1, 1]]
    md = build(params, prompts, outputs)
    assert not md.no_penalties and md.prompt_mask is not None
    got = apply_penalties(apply_min_tokens(apply_logit_bias(logits, md), md), md)
    for i, p in enumerate(params):
        want = ref_process(logits[i], p, prompts[i], outputs[i], EOS)
        torch.testing.assert_close(got[i], want, msg=f"row {i}: {p}")
    # greedy rows use the processed logits
    greedy = [dataclasses.replace(p, temperature=0.0) for p in params]
    out = Sampler()(logits, build(greedy, prompts, outputs)).sampled_token_ids
    assert out.tolist() == got.argmax(dim=-1).tolist()


def test_repetition_penalty_signs():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    md = build([SP(repetition_penalty=2.0)], prompts=[[0]], outputs=[[1]], vocab=4)
    assert apply_penalties(logits, md).tolist() == [[1.0, -4.0, 2.0, -2.0]]
    p = SP(frequency_penalty=0.5, presence_penalty=1.0)
    md = build([p], prompts=[[0]], outputs=[[1, 1, 2]], vocab=4)
    # prompt tokens are not penalized by presence/frequency; output ones are, per occurrence
    assert apply_penalties(logits, md).tolist() == [[2.0, -4.0, 0.5, -2.0]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 6] = 8.0
    p = SP(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    assert Sampler()(logits, build([p], outputs=[[]])).sampled_token_ids.item() == 6
    assert Sampler()(logits, build([p], outputs=[[1]])).sampled_token_ids.item() == 6
    assert Sampler()(logits, build([p], outputs=[[1, 1]])).sampled_token_ids.item() == EOS
    # ignore_eos: eos does not stop the request, so it is not banned (only the stop ids are)
    p = SP(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert Sampler()(logits, build([p])).sampled_token_ids.item() == EOS
    # without an eos id only the stop ids are banned; random rows never pick a banned token
    p = SP(min_tokens=5, stop_token_ids=[EOS, 5])
    out = Sampler()(logits.repeat(100, 1), build([p] * 100, eos=None)).sampled_token_ids
    assert not set(out.tolist()) & {EOS, 5}


def test_logit_bias_shifts_the_choice():
    logits = torch.zeros(2, V)
    logits[:, 1] = 3.0
    params = [SP(temperature=0.0, logit_bias={17: 4.0}), SP(temperature=0.0, logit_bias={1: -100.0, 2: 0.5})]
    assert Sampler()(logits, build(params)).sampled_token_ids.tolist() == [17, 2]
    # a large bias dominates random sampling too
    out = Sampler()(torch.randn(50, V), build([SP(logit_bias={11: 100.0})] * 50)).sampled_token_ids
    assert out.tolist() == [11] * 50
    with pytest.raises(ValueError, match="logit_bias"):
        build([SP(logit_bias={V: 1.0})])


# ---------------------------------------------------------------- seeds


def request_logits(step: int) -> torch.Tensor:
    """The logits row [V] a fixed request sees at output position `step`."""
    return torch.randn(V, generator=torch.Generator().manual_seed(1000 + step))


def run_request(target: SP, steps: int, others: list[SP], position: int, start: list[int] | None = None) -> list[int]:
    """Generates `steps` tokens for `target` at batch row `position`, among `others` (each with
    its own logits), rebuilding the metadata every step as the model runner does."""
    out = list(start or [])
    other_out: list[list[int]] = [[] for _ in others]
    for _ in range(steps):
        params = list(others)
        params.insert(position, target)
        outputs = [list(o) for o in other_out]
        outputs.insert(position, out)
        rows = [torch.randn(V) * 3 for _ in others]
        rows.insert(position, request_logits(len(out)))
        md = build(params, [[1, 2, 3]] * len(params), outputs)
        sampled = Sampler()(torch.stack(rows), md).sampled_token_ids.tolist()
        out.append(sampled.pop(position))
        for o, t in zip(other_out, sampled):
            o.append(t)
    return out


MIXED = [
    SP(temperature=0.0),
    SP(temperature=0.9, top_p=0.8),
    SP(seed=7, top_k=5),
    SP(seed=8, presence_penalty=0.5, logprobs=3),
    SP(min_p=0.1, repetition_penalty=1.3),
    SP(logit_bias={2: 1.0}, min_tokens=3),
    SP(seed=9, temperature=1.7),
]


def test_seeded_request_is_batch_invariant():
    target = SP(seed=1234, temperature=1.1, top_p=0.95)
    alone = run_request(target, 12, [], 0)
    assert alone == run_request(target, 12, [], 0)
    assert run_request(target, 12, MIXED, 0) == alone  # batch of 8
    assert run_request(target, 12, MIXED, 5) == alone  # different position
    assert run_request(target, 12, MIXED[::-1], 7) == alone  # reordered, last row
    assert run_request(target, 12, [SP(seed=s) for s in range(3)], 2) == alone  # other seeds


def test_seeded_request_survives_preemption_recompute():
    target = SP(seed=99, top_k=20)
    full = run_request(target, 10, [], 0)
    # resumed after a preemption: output so far comes back in NewRequestData, in another batch
    assert run_request(target, 4, MIXED, 3, start=full[:6]) == full


def test_different_seeds_give_different_tokens():
    flat = torch.zeros(1, 1000)
    seqs = []
    for seed in range(6):
        seq = []
        for _step in range(20):
            md = SamplingMetadata.build([SP(seed=seed)], [[1]], [seq], None, 1000, "cpu")
            seq.append(Sampler()(flat, md).sampled_token_ids.item())
        seqs.append(tuple(seq))
    assert len(set(seqs)) == 6
    assert all(len(set(s)) > 15 for s in seqs)  # and positions within a sequence differ too
    assert row_seed(0, 1) != row_seed(1, 0) and row_seed(5, 3) == row_seed(5, 3)


def test_unseeded_rows_use_the_shared_generator():
    logits = torch.zeros(8, 1000)
    md = build([SP()] * 8, vocab=1000)
    a = Sampler(torch.Generator().manual_seed(5))(logits, md).sampled_token_ids
    b = Sampler(torch.Generator().manual_seed(5))(logits, md).sampled_token_ids
    c = Sampler(torch.Generator().manual_seed(6))(logits, md).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(set(a.tolist())) > 4  # rows of one batched draw differ from each other


# ---------------------------------------------------------------- empirical distribution

# chi-square 99.99% quantiles by degrees of freedom: a correct sampler fails 1 run in 10,000
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize(
    "p",
    [SP(temperature=0.7, top_p=0.8), SP(temperature=1.3, top_k=4, min_p=0.1), SP(temperature=1.0, top_p=0.97)],
)
def test_empirical_distribution(p, seeded):
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -1.5, 0.25])
    n = 4000
    params = [dataclasses.replace(p, seed=s) for s in range(n)] if seeded else [p] * n
    md = build(params, vocab=len(base))
    out = Sampler(torch.Generator().manual_seed(0))(base.repeat(n, 1), md).sampled_token_ids
    counts = torch.bincount(out, minlength=len(base)).double()
    expected = ref_distribution(base, p.temperature, p.min_p, p.top_k, p.top_p) * n
    kept = expected > 0
    assert counts[~kept].sum() == 0  # truncated tokens are never drawn
    chi2 = (((counts - expected) ** 2)[kept] / expected[kept]).sum().item()
    assert chi2 < CHI2_9999[int(kept.sum()) - 1], (counts.tolist(), expected.tolist())


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_sorted_top_k_and_rank():
    torch.manual_seed(4)
    logits = torch.randn(5, V) * 2
    params = [
        SP(logprobs=5, temperature=0.5, repetition_penalty=1.8),
        SP(logprobs=0, seed=3),
        SP(),  # no logprobs in a batch that has them
        SP(logprobs=2, temperature=0.0, logit_bias={9: 50.0}),  # greedy pick of a low raw token
        SP(logprobs=5, top_k=3, presence_penalty=2.0),
    ]
    md = build(params, outputs=[[1, 2], [], [], [], [0, 0]])
    assert md.max_num_logprobs == 5
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (5, 6)
    sampled = out.sampled_token_ids
    assert sampled[3].item() == 9
    for i in range(5):
        assert lp.token_ids[i, 0] == sampled[i]
        torch.testing.assert_close(lp.logprobs[i], raw[i, lp.token_ids[i]])
        top = lp.logprobs[i, 1:]
        assert torch.all(top[:-1] >= top[1:])  # sorted, most likely first
        torch.testing.assert_close(top, raw[i].sort(descending=True).values[:5])
        assert lp.sampled_ranks[i] == 1 + (raw[i] > raw[i, sampled[i]]).sum()
    lists = lp.tolists(md.num_logprobs)
    assert lists[2] is None
    assert len(lists[0].token_ids[0]) == 6 and len(lists[1].token_ids[0]) == 1 and len(lists[3].token_ids[0]) == 3
    assert lists[1].token_ids[0] == [sampled[1].item()]
    assert lists[3].sampled_ranks == [lp.sampled_ranks[3].item()] and lists[3].sampled_ranks[0] > 1


def test_logprob_rank_is_one_for_greedy():
    logits = torch.randn(3, V)
    out = Sampler()(logits, build([SP(temperature=0.0, logprobs=1)] * 3))
    assert out.logprobs.sampled_ranks.tolist() == [1, 1, 1]
    assert torch.equal(out.logprobs.token_ids[:, 0], out.logprobs.token_ids[:, 1])
