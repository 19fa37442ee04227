"""Structured output's sampler step: keep only the tokens a grammar allows.

`apply_token_bitmask` is the reference every platform inherits (`Sampler`'s default); a platform
may pass a faster one with the same contract (`Platform.sampler`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBitmask:
    """The grammar masks of one step, on the logits' device."""

    rows: torch.Tensor  # [M] int64: rows of the logits under a grammar
    bitmask: torch.Tensor  # [M, ceil(V' / 32)] int32: bit t % 32 of word t // 32 = token t allowed


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """New fp32 logits [N, V] (the input is left unmodified): in each row `rows[i]`, every token
    whose bit is clear in `bitmask[i]`, and every token past the mask's 32 * W bits, is -inf.
    Rows not listed are unchanged."""
    n, vocab = logits.shape
    # bit tests with Python-int masks, bit 31 as the sign: XLA lowers shifts by a tensor of
    # amounts, and constants of 2^31, wrongly
    bits = [(bitmask & (1 << b)) != 0 for b in range(31)] + [bitmask < 0]
    allowed = torch.stack(bits, dim=-1).flatten(1)  # [M, 32 * W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    keep = torch.ones((n, vocab), dtype=torch.bool, device=logits.device)
    keep[rows] = allowed[:, :vocab].to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))
