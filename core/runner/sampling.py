"""The sampling handoff of the last pipeline stage: from a step's hidden states to the tokens each
request keeps. The LM head's logits of the sampled rows (with the prompt-logprob rows in the same
call), the step's sampling metadata and grammar masks, the platform's sampler, and the tokens a
request keeps when it verified speculative proposals (`accepted_tokens`).
"""

from __future__ import annotations

from typing import Any

import torch

from portside.contract import Communicator, GraphRunner
from portside.runner.inputs import BatchInputs, CachedRequestState
from portside.sample.bitmask import TokenBitmask
from portside.sample.metadata import SamplingMetadata
from portside.sample.prompt_logprobs import compute_prompt_logprobs
from portside.sched.output import LogprobsLists, SchedulerOutput

__all__ = ["SamplingHandoff", "accepted_tokens", "join_logprobs"]


def accepted_tokens(sampled: list[int], spec: list[int]) -> list[int]:
    """What a step yields for a request that verified `spec`: `sampled[j]` is the token drawn at
    the position after proposal j (j = 0: after its last token) as if proposals 0..j-1 were
    accepted. Proposal j is accepted when the draw before it equals it; the yield is the accepted
    proposals plus the first draw that disagrees, or the draw after the last proposal. With a
    deterministic proposer this is exact rejection sampling: proposal t is accepted with the
    target's probability p(t), and a rejection yields a draw from p conditioned on not t."""
    j = 0
    while j < len(spec) and sampled[j] == spec[j]:
        j += 1
    return sampled[: j + 1]


def join_logprobs(rows: list[LogprobsLists | None]) -> LogprobsLists:
    """Consecutive one-token rows of one request as one multi-token LogprobsLists."""
    return LogprobsLists(token_ids=[ids for r in rows if r is not None for ids in r.token_ids],
                         logprobs=[lp for r in rows if r is not None for lp in r.logprobs],
                         sampled_ranks=[k for r in rows if r is not None for k in r.sampled_ranks])


class SamplingHandoff:
    """Logits, metadata, masks and sampling for one step of the last pipeline stage.

    `sampler`: the platform's (`Platform.sampler`); `comm`: the tensor-parallel group, whose
    ranks all continue from its rank 0's tokens."""

    def __init__(self, sampler: Any, comm: Communicator, eos_token_id: int | None, vocab_size: int,
                 device: torch.device) -> None:
        self.sampler = sampler
        self.comm = comm
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.device = device
        self._last: tuple[list[tuple[str, int]], SamplingMetadata] | None = None  # see `metadata`

    def reset(self) -> None:
        """Forget the last step's metadata (a request id may come back as another request)."""
        self._last = None

    def logits(self, runner: GraphRunner, hidden: torch.Tensor,
               batch: BatchInputs) -> tuple[torch.Tensor, dict[str, tuple[int, LogprobsLists]]]:
        """The sampled rows' logits, and the prompt logprobs of the rows that asked: one LM head
        call for both (under tensor parallelism it gathers the vocabulary as the sampled path does)."""
        if batch.prompt_indices is None or batch.prompt_targets is None:
            return runner.logits(hidden, batch.logits_indices), {}
        logits = runner.logits(hidden, torch.cat([batch.logits_indices, batch.prompt_indices]))
        num_sampled = len(batch.logits_indices)
        return logits[:num_sampled], compute_prompt_logprobs(logits[num_sampled:], batch.prompt_targets, batch.prompt_rows)

    def token_bitmask(self, so: SchedulerOutput, batch: BatchInputs) -> TokenBitmask | None:
        """The step's grammar masks (waiting for them here, after the forward) on the device."""
        if so.grammar is None:
            return None
        index, row = {}, 0
        for rid, spec in zip(batch.sampled_req_ids, batch.spec):  # a row per verified position
            index[rid] = row
            row += 1 + len(spec)
        rows = torch.tensor([index[rid] + j for rid, n in zip(so.grammar.req_ids, so.grammar.num_rows) for j in range(n)],
                            dtype=torch.int64, device=self.device)
        return TokenBitmask(rows=rows, bitmask=so.grammar.get().to(self.device))

    def metadata(self, states: list[CachedRequestState], spec: list[list[int]]) -> SamplingMetadata:
        """The step's sampling metadata, a row per sampled position: a request verifying proposals
        has one for its last token and one for each proposal, each row sampling as if the
        proposals before it were accepted (its output so far includes them: penalties, min_tokens
        and a seeded row's generator are then exactly those of the run without speculation).
        Last step's when it samples the same rows in the same order and nothing in it depends on
        the tokens sampled since (`SamplingMetadata.reusable`), as in a steady run of decodes;
        else built anew (the build costs ~0.1 ms a step at batch 1, more than the greedy sampling
        it feeds)."""
        layout = [(s.req_id, len(p)) for s, p in zip(states, spec)]
        if self._last is not None and self._last[0] == layout:
            return self._last[1]
        rows = [(s, s.output_token_ids + p[:j] if j else s.output_token_ids) for s, p in zip(states, spec)
                for j in range(len(p) + 1)]
        meta = SamplingMetadata.build(
            [s.sampling_params for s, _ in rows],
            [s.prompt_token_ids for s, _ in rows],
            [out for _, out in rows],
            eos_token_id=self.eos_token_id,
            vocab_size=self.vocab_size,
            device=self.device,
        )
        self._last = (layout, meta) if meta.reusable else None
        return meta

    def sample(self, logits: torch.Tensor, states: list[CachedRequestState], batch: BatchInputs,
               so: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, LogprobsLists]]:
        """Sample the rows of `states` (batch.sampled_req_ids'); each request keeps its accepted
        tokens (appended to its output here) and their logprobs where it asked for them."""
        meta = self.metadata(states, batch.spec)
        out = self.sampler(logits, meta, self.token_bitmask(so, batch))
        token_ids = out.sampled_token_ids  # [num_rows]
        if self.comm.world_size > 1:
            # Every TP rank continues from the group's rank 0 tokens, whatever its own sampler drew.
            token_ids = self.comm.broadcast(token_ids.contiguous(), src=0)
        rows = token_ids.tolist()
        row_lps = out.logprobs.tolists(meta.num_logprobs) if out.logprobs is not None else None
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, LogprobsLists] = {}
        row = 0
        for state, spec in zip(states, batch.spec):
            new = accepted_tokens(rows[row : row + 1 + len(spec)], spec)
            state.output_token_ids.extend(new)
            sampled[state.req_id] = new
            if row_lps is not None and row_lps[row] is not None:
                logprobs[state.req_id] = join_logprobs(row_lps[row : row + len(new)])
            row += 1 + len(spec)
        return sampled, logprobs
