"""Sampler contract: the platform's `Sampler` (`Platform.sampler`) masks logits for structured
output exactly as core's reference (`portside.sample.bitmask.apply_token_bitmask`): listed rows
keep only the tokens whose bit is set (bit 31 of a word included), tokens past the mask's width
are -inf, other rows and the input are untouched; and its sampled tokens are allowed ones. A
platform that passes no kernel runs the reference itself and passes."""

from __future__ import annotations

import pytest
import torch

from portside.contract import Platform, TokenBitmask, apply_token_bitmask
from portside.sample.metadata import SamplingMetadata
from portside.sampling_params import SamplingParams
from portside.testing.conformance.cases import contract_failure, engine_config

# (rows N, vocab V, mask words W, listed rows): V not a multiple of 32, a mask narrower than V,
# a mask wider than V, every row listed, none listed
SHAPES = ((1, 96, 3, (0,)), (5, 1000, 32, (4, 0, 2)), (3, 77, 2, (1,)), (4, 65, 4, (0, 1, 2, 3)), (2, 64, 2, ()))


def _bitmask(m: int, words: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(0, 2, (m, words, 32), generator=gen, dtype=torch.int64)
    bits[:, 0, 31] = 1  # the sign bit of an int32 word
    if m and words > 1:
        bits[0, 1] = 1  # an all-ones word (-1)
    packed = (bits << torch.arange(32)).sum(-1)  # [m, words] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.fixture(scope="module")
def sampler(conformance_platform: type[Platform]):  # type: ignore[no-untyped-def]
    p = conformance_platform
    return p.sampler(engine_config(p, p.supported_dtypes[0], p.default_block_size))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-V{s[1]}-W{s[2]}-rows{len(s[3])}")
def test_token_bitmask_matches_reference(conformance_platform: type[Platform], sampler, shape) -> None:  # type: ignore[no-untyped-def]
    n, vocab, words, rows = shape
    gen = torch.Generator().manual_seed(n * 1000 + vocab)
    logits = torch.randn(n, vocab, generator=gen)
    bitmask = _bitmask(len(rows), words, gen)
    row_ids = torch.tensor(rows, dtype=torch.int64)
    want = apply_token_bitmask(logits, bitmask, row_ids)
    device = conformance_platform.device(0)
    dev_logits = logits.to(device)
    got = sampler.apply_token_bitmask(dev_logits, bitmask.to(device), row_ids.to(device))
    if got.shape != want.shape or got.dtype != torch.float32:
        contract_failure("sampler", f"apply_token_bitmask returned {tuple(got.shape)} {got.dtype}; expected {tuple(want.shape)} fp32")
    if not torch.equal(got.cpu(), want):
        bad = (got.cpu() != want).nonzero()[:5].tolist()
        contract_failure("sampler", f"apply_token_bitmask differs from core's reference at (row, token) {bad}")
    if not torch.equal(dev_logits.cpu(), logits):
        contract_failure("sampler", "apply_token_bitmask modified its input logits")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_tokens_are_allowed(conformance_platform: type[Platform], sampler, temperature: float) -> None:  # type: ignore[no-untyped-def]
    n, vocab = 6, 300
    gen = torch.Generator().manual_seed(7)
    device = conformance_platform.device(0)
    logits = torch.randn(n, vocab, generator=gen)
    rows = torch.tensor([0, 2, 3, 5])
    allowed = torch.zeros(len(rows), 320, dtype=torch.int64)
    for i in range(len(rows)):  # a few allowed tokens, none of them the unconstrained argmax
        top = int(logits[rows[i]].argmax())
        choices = [t for t in torch.randperm(vocab, generator=gen)[:5].tolist() if t != top]
        allowed[i, choices] = 1
    packed = (allowed.view(len(rows), 10, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    params = [SamplingParams(temperature=temperature, max_tokens=4) for _ in range(n)]
    md = SamplingMetadata.build(params, [[1]] * n, [[]] * n, eos_token_id=None, vocab_size=vocab, device=device)
    out = sampler(logits.to(device), md, TokenBitmask(rows=rows.to(device), bitmask=bitmask.to(device)))
    tokens = out.sampled_token_ids.cpu()
    for i, r in enumerate(rows.tolist()):
        if not allowed[i, int(tokens[r])]:
            contract_failure("sampler", f"row {r} sampled token {int(tokens[r])}, which its grammar mask does not allow")
