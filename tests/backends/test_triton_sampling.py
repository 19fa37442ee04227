"""The Triton grammar-mask kernel (cuda / rocm sampler) against core's reference, under the
interpreter on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from portside.sample.bitmask import apply_token_bitmask

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("n,vocab,words,rows", [(3, 1000, 32, [2, 0]), (2, 77, 2, [1]), (4, 2100, 40, [0, 1, 2, 3]), (2, 64, 2, [])])
def test_triton_token_bitmask_matches_reference(n: int, vocab: int, words: int, rows: list[int]) -> None:
    pytest.importorskip("triton")
    from portside.backends.triton.sampling import apply_token_bitmask as triton_mask

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(n, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
    row_ids = torch.tensor(rows, dtype=torch.int64)
    before = logits.clone()
    assert torch.equal(triton_mask(logits, bitmask, row_ids), apply_token_bitmask(logits, bitmask, row_ids))
    assert torch.equal(logits, before)
