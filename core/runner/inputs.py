"""Input preparation: the runner's copy of each running request (`CachedRequestState`), kept up
to date from the scheduler's diffs, and a step's tensors (`BatchInputs`) built from it: token ids,
positions (3-D under mrope), the slot of each new token's KV, block tables and the attention
metadata, the rows to sample, the prompt-logprob rows and the image rows.

Public for every model the runner drives: `portside.spec_decode.draft_model` builds its draft
steps over the target's block tables with `slot_mapping` and `attention_metadata`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from portside.contract import AttentionMetadata
from portside.multimodal.inputs import MultiModalFeature
from portside.sample.prompt_logprobs import PromptLogprobsRows
from portside.sampling_params import SamplingParams
from portside.sched.output import SchedulerOutput

__all__ = [
    "BatchInputs",
    "CachedRequestState",
    "attention_metadata",
    "mrope_positions",
    "prepare_inputs",
    "slot_mapping",
    "update_request_states",
]


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: Any = None  # a portside.lora.request.LoRARequest
    mm_features: list[MultiModalFeature] = dataclasses.field(default_factory=list)
    mrope: tuple[torch.Tensor, int] | None = None  # (prompt positions [3, P], delta): `SupportsMultiModal`
    state_slot: int = -1  # its recurrent layers' state slot (a hybrid model's)
    token_type_ids: list[int] | None = None  # encoder-only models: the prompt's segment ids (None: all 0)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]


@dataclass
class BatchInputs:
    req_ids: list[str]  # batch order: decodes first
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_rows]: rows of hidden states to sample from
    sampled_req_ids: list[str]  # requests whose chunk reaches their last known token
    # speculative decoding: per sampled request, the proposals it verifies (its rows in
    # logits_indices are 1 + len of them: its last token's, then each proposal's)
    spec: list[list[int]] = dataclasses.field(default_factory=list)
    # prompt_logprobs: the rows of requests that asked, their targets (the next prompt tokens)
    prompt_rows: list[PromptLogprobsRows] = dataclasses.field(default_factory=list)
    prompt_indices: torch.Tensor | None = None  # [M] rows of hidden states, after logits_indices
    prompt_targets: torch.Tensor | None = None  # [M] int64
    # image rows: (first batch row, feature, first and end embedding row) per image slice in the step
    mm_rows: list[tuple[int, MultiModalFeature, int, int]] = dataclasses.field(default_factory=list)
    # encoder-only models: [T] segment ids of the step's tokens, None when no request has any
    token_type_ids: torch.Tensor | None = None


def update_request_states(requests: dict[str, CachedRequestState], so: SchedulerOutput, append_tokens: bool) -> None:
    """Apply a step's diff: finished requests dropped, new ones added, running ones given their
    new blocks and computed count; with `append_tokens` (a runner that does not sample: an
    earlier pipeline stage) also the tokens sampled since they last ran."""
    for rid in so.finished_req_ids:
        requests.pop(rid, None)
    for new in so.scheduled_new_reqs:
        requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            lora_request=new.lora_request,
            mm_features=list(new.mm_features),
            state_slot=new.state_slot,
            token_type_ids=new.token_type_ids,
        )
    for cached in so.scheduled_cached_reqs:
        state = requests[cached.req_id]
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens
        if append_tokens:
            state.output_token_ids.extend(cached.new_token_ids)


def slot_mapping(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV slot of each position in [start, end) of a sequence with these blocks."""
    if end - start == 1:  # plain Python for a single token: a numpy call costs more than its work
        return [block_ids[start // block_size] * block_size + start % block_size]
    pos = np.arange(start, end, dtype=np.int64)
    return (np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size).tolist()


def mrope_positions(model: Any, state: CachedRequestState, start: int, end: int) -> torch.Tensor:
    """[3, end - start] positions of a request's tokens [start, end) under 3-D rotary
    (`SupportsMultiModal.mrope_positions`, computed once per request and kept in its state)."""
    if state.mrope is None:
        state.mrope = model.mrope_positions(state.prompt_token_ids, state.mm_features)
    prompt_pos, delta = state.mrope
    n = prompt_pos.shape[1]
    parts = []
    if start < n:
        parts.append(prompt_pos[:, start : min(end, n)])
    if end > n:
        later = torch.arange(max(start, n), end, dtype=torch.int64) + delta
        parts.append(later.expand(3, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def attention_metadata(tables: list[list[int]], slots: list[int], qsl: list[int], seq_lens: list[int],
                       num_decode_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """A batch's metadata from per-sequence block tables (padded here), slots, query starts and
    lengths; the one-token queries first, `num_decode_tokens` of them."""
    table = np.zeros((len(tables), max(len(b) for b in tables)), dtype=np.int32)
    for i, b in enumerate(tables):
        table[i, : len(b)] = b
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(table).to(device),
        max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decode_tokens=num_decode_tokens,
    )


@dataclass
class _StepRows:
    """A step's host-side lists, built request by request in batch order."""

    block_size: int
    mrope_model: Any  # the model, where it uses 3-D rotary positions; else None
    ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    mrope: list[torch.Tensor] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)
    seq_lens: list[int] = dataclasses.field(default_factory=list)
    qsl: list[int] = dataclasses.field(default_factory=lambda: [0])
    tables: list[list[int]] = dataclasses.field(default_factory=list)
    num_decodes: int = 0
    logits_rows: list[int] = dataclasses.field(default_factory=list)
    sampled: list[str] = dataclasses.field(default_factory=list)
    spec: list[list[int]] = dataclasses.field(default_factory=list)
    prompt_rows: list[PromptLogprobsRows] = dataclasses.field(default_factory=list)
    prompt_indices: list[int] = dataclasses.field(default_factory=list)
    prompt_targets: list[int] = dataclasses.field(default_factory=list)
    mm_rows: list[tuple[int, MultiModalFeature, int, int]] = dataclasses.field(default_factory=list)
    token_types: list[int] = dataclasses.field(default_factory=list)
    any_token_types: bool = False

    def add(self, state: CachedRequestState, n: int, spec: list[int]) -> None:
        """A request's `n` tokens from its computed count, the last `len(spec)` of them proposals."""
        start, first = state.num_computed_tokens, len(self.ids)  # its first position and batch row
        end = start + n
        self.ids.extend(state.token_slice(start, end - len(spec)))
        self.ids.extend(spec)
        self.positions.extend(range(start, end))
        types = state.token_type_ids
        self.token_types.extend(types[start:end] if types is not None else [0] * n)  # (prompt tokens only)
        self.any_token_types |= types is not None
        if self.mrope_model is not None:
            self.mrope.append(mrope_positions(self.mrope_model, state, start, end))
        for f in state.mm_features:  # images whose placeholder rows this chunk holds
            a, b = max(start, f.placeholder.offset), min(end, f.placeholder.end)
            if a < b:
                self.mm_rows.append((first + a - start, f, a - f.placeholder.offset, b - f.placeholder.offset))
        if n == 1:  # (inline: the common decode row)
            bs = self.block_size
            self.slots.append(state.block_ids[start // bs] * bs + start % bs)
            self.num_decodes += 1
        else:
            self.slots.extend(slot_mapping(state.block_ids, start, end, self.block_size))
        self.seq_lens.append(end)
        self.qsl.append(first + n)
        self.tables.append(state.block_ids)
        if end - len(spec) >= state.num_tokens:  # the chunk reaches the last known token: sample
            self.logits_rows.extend(range(first + n - 1 - len(spec), first + n))
            self.sampled.append(state.req_id)
            self.spec.append(spec)
        if state.sampling_params.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, start, end, first)

    def _add_prompt_logprobs(self, state: CachedRequestState, start: int, end: int, first: int) -> None:
        k = state.sampling_params.prompt_logprobs
        # positions predicting a prompt token; none in a recompute after outputs (sent already)
        last = min(end, len(state.prompt_token_ids) - 1)
        if k is not None and start < last and not state.output_token_ids:
            self.prompt_rows.append(PromptLogprobsRows(state.req_id, start, last - start, k))
            self.prompt_indices.extend(range(first, first + last - start))
            self.prompt_targets.extend(state.prompt_token_ids[start + 1 : last + 1])

    def batch(self, req_ids: list[str], device: torch.device) -> BatchInputs:
        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        md = attention_metadata(self.tables, self.slots, self.qsl, self.seq_lens, self.num_decodes, self.block_size,
                                device)
        return BatchInputs(
            req_ids=req_ids,
            input_ids=tensor(self.ids),
            positions=tensor(self.positions) if self.mrope_model is None else torch.cat(self.mrope, dim=1).to(device),
            metadata=md,
            logits_indices=tensor(self.logits_rows),
            sampled_req_ids=self.sampled,
            spec=self.spec,
            prompt_rows=self.prompt_rows,
            prompt_indices=tensor(self.prompt_indices) if self.prompt_rows else None,
            prompt_targets=tensor(self.prompt_targets) if self.prompt_rows else None,
            mm_rows=self.mm_rows,
            token_type_ids=tensor(self.token_types) if self.any_token_types else None,
        )


def prepare_inputs(requests: dict[str, CachedRequestState], so: SchedulerOutput, block_size: int,
                   device: torch.device, mrope_model: Any = None) -> BatchInputs:
    """The step's tensors for the scheduled requests (their states already updated from `so`),
    decodes (one query token) first so attention backends can batch them. `mrope_model`: the
    model, where it takes 3-D rotary positions (`SupportsMultiModal.uses_mrope`)."""
    counts = so.num_scheduled_tokens
    req_ids = sorted(counts, key=lambda r: counts[r] != 1)
    rows = _StepRows(block_size, mrope_model)
    for rid in req_ids:
        rows.add(requests[rid], counts[rid], so.scheduled_spec_decode_tokens.get(rid, []))
    return rows.batch(req_ids, device)
