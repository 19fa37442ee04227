"""Logit adjustments applied before sampling: logit_bias, min_tokens and the three penalties.

All functions take fp32 logits [N, V] and return a new tensor (the input is left untouched).
"""

from __future__ import annotations

import torch

from portside.sample.metadata import SamplingMetadata


def apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logits[row, token] += bias for every (row, token, bias) of the requests' logit_bias."""
    if md.bias_rows is None:
        return logits
    assert md.bias_values is not None  # bias_rows, bias_cols and bias_values are set together
    return logits.index_put((md.bias_rows, md.bias_cols), md.bias_values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Bans eos and stop_token_ids (-inf) on rows that have fewer than min_tokens outputs."""
    if md.min_tokens_rows is None:
        return logits
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((md.min_tokens_rows, md.min_tokens_cols), neg_inf)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties.

    - repetition_penalty (vLLM / Hugging Face): for each token seen in the prompt or the output,
      a positive logit is divided by the penalty and a negative one multiplied by it;
    - frequency_penalty (OpenAI): subtract penalty * (occurrences in the output);
    - presence_penalty (OpenAI): subtract penalty once if the token occurs in the output.
    """
    if md.no_penalties:
        return logits
    assert md.output_counts is not None and md.repetition_penalties is not None
    assert md.frequency_penalties is not None and md.presence_penalties is not None
    counts = md.output_counts  # [N, V]
    if md.prompt_mask is not None:
        seen = md.prompt_mask | (counts > 0)  # [N, V]
        rep = md.repetition_penalties[:, None]  # [N, 1]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalties[:, None] * counts
    logits = logits - md.presence_penalties[:, None] * (counts > 0).to(logits.dtype)
    return logits
