"""The sampler: one step's fp32 logits [N, V] -> one token per row (and logprobs on request).

Order of operations, per row:

0. structured output: tokens a row's grammar does not allow become -inf (`bitmask.py`), so
   everything after (logprobs included) sees the constrained distribution;
1. raw logprobs = log_softmax(logits), kept only when some row asked for logprobs;
2. logit_bias, then min_tokens (eos / stop ids -> -inf), then repetition, frequency and presence
   penalties (`portside.sample.penalties`);
3. greedy rows (temperature < 1e-5 or top_k == 1): argmax of those processed logits;
4. random rows: divide by temperature, min-p, top-k, top-p (`portside.sample.truncation`), then
   draw with the exponential race: argmax(probs / q), q ~ Exp(1) i.i.d. per token, which picks
   token t with probability probs[t]. Unseeded rows draw q from one shared generator in a single
   batched call; a seeded row draws its own q from a generator seeded with
   `row_seed(seed, number of output tokens so far)`, so its tokens never depend on the rest of
   the batch, its position in it, or a preemption.

Logprobs are those of the model's raw distribution (step 1: before penalties, temperature and
truncation), as vLLM v1 returns by default. The sampled token's rank is 1 + the number of tokens
with a strictly larger raw logprob (rank 1 = most likely; a tie with the top token is rank 1).
`logprobs_mode` (vLLM's values, `LOGPROBS_MODES`) picks other values: ``raw_logits`` (step 0's
logits), ``processed_logprobs`` / ``processed_logits`` (what the row was sampled from: after the
penalties, and for random rows after temperature, min-p, top-k and top-p, truncated tokens -inf;
a greedy row's after the penalties); ranks are counted in the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from portside.sample.bitmask import TokenBitmask, apply_token_bitmask
from portside.sample.metadata import SamplingMetadata
from portside.sample.penalties import apply_logit_bias, apply_min_tokens, apply_penalties
from portside.sample.truncation import apply_min_p, apply_top_k_top_p
from portside.sched.output import LogprobsLists

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

# q ~ Exp(1) can round to 0; 0/0 would be NaN, which argmax would pick
_MIN_EXP_NOISE = 1e-30


@dataclass
class LogprobsTensors:
    """Logprobs of one step for every row, K = the batch's largest `logprobs` value."""

    token_ids: torch.Tensor  # [N, 1 + K] int64: column 0 the sampled token, then the top-K by logprob
    logprobs: torch.Tensor  # [N, 1 + K] fp32: raw log_softmax values of those tokens
    sampled_ranks: torch.Tensor  # [N] int64: rank of the sampled token (1 = most likely)

    def tolists(self, num_logprobs: list[int | None]) -> list[LogprobsLists | None]:
        """Per row: its sampled token + top-`num_logprobs[i]` as a one-token `LogprobsLists`
        (None for rows that did not ask). One device-to-host copy for the whole batch."""
        ids = self.token_ids.tolist()
        lps = self.logprobs.tolist()
        ranks = self.sampled_ranks.tolist()
        out: list[LogprobsLists | None] = []
        for i, k in enumerate(num_logprobs):
            if k is None:
                out.append(None)
                continue
            out.append(
                LogprobsLists(token_ids=[ids[i][: 1 + k]], logprobs=[lps[i][: 1 + k]], sampled_ranks=[ranks[i]])
            )
        return out


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None = None  # None when no row asked for logprobs


def _argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    """Stateless apart from the generator shared by unseeded rows.

    `generator=None` uses torch's default generator of the logits' device (seeded by the
    platform's `seed(n)`). `argmax`: [N, V] -> [N] int64, the first index of each row's maximum
    (NaN counting as the largest), as `torch.argmax(x, dim=-1)`; `apply_token_bitmask`: as
    `portside.sample.bitmask.apply_token_bitmask`. A platform passes faster ones
    (`Platform.sampler`).
    """

    def __init__(self, generator: torch.Generator | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = _argmax,
                 apply_token_bitmask: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_token_bitmask) -> None:
        self.generator = generator
        self.argmax = argmax
        self.apply_token_bitmask = apply_token_bitmask
        self.logprobs_mode = "raw_logprobs"  # what logprobs hold (`LOGPROBS_MODES`; the runner sets the engine's)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, token_bitmask: TokenBitmask | None = None) -> SamplerOutput:
        """Samples one token per row of `logits` [N, V] (left unmodified); rows under a grammar
        (`token_bitmask`) only among the tokens it allows."""
        md = metadata
        if logits.shape[0] != md.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, metadata {md.num_rows}")
        logits = logits.float()
        if token_bitmask is not None:
            logits = self.apply_token_bitmask(logits, token_bitmask.bitmask, token_bitmask.rows)
        mode = self.logprobs_mode if md.max_num_logprobs is not None else None
        raw_logprobs = None  # [N, V]: the values logprobs are gathered from
        if mode == "raw_logprobs":
            raw_logprobs = logits.log_softmax(dim=-1)
        elif mode == "raw_logits":
            raw_logprobs = logits.clone()

        if md.needs_logits_processing:
            logits = apply_logit_bias(logits, md)
            logits = apply_min_tokens(logits, md)
            logits = apply_penalties(logits, md)

        processed = logits  # what each row samples from (`logprobs_mode` processed_*)
        if md.all_greedy:
            sampled = self.argmax(logits)  # [N]
        else:
            sampled, processed = self._sample_random(logits, md)
            if not md.all_random:
                sampled = torch.where(md.greedy_mask, self.argmax(logits), sampled)
                processed = torch.where(md.greedy_mask[:, None], logits, processed) if mode else processed
        if mode in ("processed_logprobs", "processed_logits"):
            raw_logprobs = processed.log_softmax(dim=-1) if mode == "processed_logprobs" else processed

        lp = None
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None
            lp = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp)

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, truncation and the exponential race for every row: ([N] int64, the
        processed logits [N, V] the rows were drawn from)."""
        logits = logits / md.temperature[:, None]  # [N, V]
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)  # [N, V], 0 on masked tokens
        q = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            q.exponential_(generator=self.generator)  # one batched draw for the unseeded rows
        for row, gen in md.generators.items():
            if gen.device == q.device:
                q[row].exponential_(generator=gen)
            else:  # a host generator for a device without its own
                q[row] = torch.empty(q.shape[1], device=gen.device).exponential_(generator=gen).to(q.device)
        return self.argmax(probs.div_(q.clamp_(min=_MIN_EXP_NOISE))), logits


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """Sampled token's logprob and rank plus the top-k of `raw_logprobs` [N, V], sorted descending."""
    sampled_lp = raw_logprobs.gather(1, sampled[:, None])  # [N, 1]
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1  # [N]
    top_lp, top_ids = raw_logprobs.topk(k, dim=-1)  # [N, k] each, sorted
    return LogprobsTensors(
        token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
        logprobs=torch.cat([sampled_lp, top_lp], dim=1),
        sampled_ranks=ranks,
    )
