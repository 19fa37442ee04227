"""Truncation of the sampling distribution: min-p, top-k and top-p, batched over rows.

Each mask is a per-row threshold on the logit value, so tokens tied with the last kept token are
always kept together (top_k=2 over logits [3, 1, 1] keeps three tokens), the most likely token is
never masked, and no scatter back from sorted order is needed. Masked logits become -inf.
Inputs are fp32 logits [N, V] after temperature; the input tensor is left untouched.
"""

from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p [N] times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [N, V]
    top = probs.amax(dim=-1, keepdim=True)  # [N, 1]
    return logits.masked_fill(probs < min_p[:, None] * top, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keeps the k most likely tokens (top_k [N]; k = V disables), then the smallest set of most
    likely tokens whose probability (renormalised after top-k) reaches top_p [N] (1.0 disables).
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1).values  # [N, V] ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [N, V] ascending, inclusive
        drop = cum <= (1.0 - top_p)[:, None]  # a prefix of each row: cum is non-decreasing
        drop[:, -1] = False  # the most likely token always stays
        cutoff = sorted_logits.gather(1, drop.sum(dim=-1, keepdim=True))  # [N, 1] smallest kept
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return logits
