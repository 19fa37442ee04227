"""What the proposers that run a model of their own (a draft model, an EAGLE head, an MTP layer)
share: how many tokens a request may be proposed, and one forward's rows packed into input ids,
positions and attention metadata over the target's blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from portside.contract import ForwardContext
from portside.runner.inputs import CachedRequestState, attention_metadata, slot_mapping


def proposal_room(state: CachedRequestState, k: int, max_model_len: int, block_size: int) -> int:
    """Proposals `state` may get this step: at most k, within the model length, the blocks it
    holds (a proposal's KV slot included) and its max_tokens (the step's own token counts)."""
    n, params = state.num_tokens, state.sampling_params
    room = min(k, max_model_len - n, len(state.block_ids) * block_size - n + 1)
    if params.max_tokens is not None:
        room = min(room, params.max_tokens - len(state.output_token_ids) - 1)
    return max(room, 0)


@dataclass
class PackedRows:
    order: list[int]  # the rows in forward order (one-token queries first, as decode rows)
    ids: torch.Tensor
    positions: torch.Tensor
    query_start: list[int]  # per forward-order row, where its tokens start (and a final end)
    ctx: ForwardContext

    def last_index(self, j: int) -> int:
        """The flat index of forward-order row j's last token."""
        return self.query_start[j + 1] - 1


def pack_rows(rows: Sequence[tuple[Any, ...]], block_size: int, device: torch.device, attn_backend: Any,
              kv_caches: Any) -> PackedRows:
    """One forward over `rows`, each (request state, start position, tokens, ...): their tokens
    written from `start` into the request's blocks."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][2]) != 1)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    for i in order:
        state, start, tokens = rows[i][0], rows[i][1], rows[i][2]
        end = start + len(tokens)
        ids.extend(tokens)
        positions.extend(range(start, end))
        slots.extend(slot_mapping(state.block_ids, start, end, block_size))
        seq_lens.append(end)
        qsl.append(qsl[-1] + len(tokens))
    md = attention_metadata([rows[i][0].block_ids for i in order], slots, qsl, seq_lens,
                            sum(1 for r in rows if len(r[2]) == 1), block_size, device)
    ctx = ForwardContext(attn_backend, kv_caches, attn_backend.prepare(md))
    return PackedRows(order, torch.tensor(ids, dtype=torch.int64, device=device),
                      torch.tensor(positions, dtype=torch.int64, device=device), qsl, ctx)
