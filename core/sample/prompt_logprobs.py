"""Prompt logprobs (`SamplingParams.prompt_logprobs`): for each prompt position a chunk computes,
the model's raw logprob of the next prompt token, its rank, and the top-k alternatives.

The model runner gathers the hidden states of those positions beside the sampled rows (one LM
head call per step), and only for requests that asked: others pay nothing. Position p predicts
prompt token p + 1, so a chunk covering positions [s, e) yields entries for tokens s + 1 .. e
(never past the prompt's last token: the last prompt position predicts the first output).
Values are those of the raw distribution (log_softmax of the logits, before any sampling
parameter), ranked as the sample logprobs are (1 + tokens with a strictly larger logprob).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portside.sample.sampler import gather_logprobs
from portside.sched.output import LogprobsLists


@dataclass
class PromptLogprobsRows:
    """One request's rows of a step's prompt-logprob logits."""

    req_id: str
    start: int  # the first position of the chunk's rows (it predicts prompt token start + 1)
    count: int  # consecutive positions
    k: int  # top alternatives to keep


def compute_prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                            rows: list[PromptLogprobsRows]) -> dict[str, tuple[int, LogprobsLists]]:
    """`logits` [M, V] of the rows of `rows` in order (M = their counts summed), `targets` [M] the
    prompt tokens they predict. Returns req_id -> (start, lists) as `ModelRunnerOutput` carries them."""
    if not rows:
        return {}
    raw = logits.float().log_softmax(dim=-1)
    k = min(max(r.k for r in rows), raw.shape[-1])
    lp = gather_logprobs(raw, targets, k)
    ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.sampled_ranks.tolist()  # one copy each
    out: dict[str, tuple[int, LogprobsLists]] = {}
    i = 0
    for r in rows:
        j = i + r.count
        out[r.req_id] = (r.start, LogprobsLists(token_ids=[t[: 1 + r.k] for t in ids[i:j]],
                                                logprobs=[v[: 1 + r.k] for v in vals[i:j]], sampled_ranks=ranks[i:j]))
        i = j
    return out
