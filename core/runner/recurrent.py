"""The runner's recurrent-layer states (a hybrid model's linear-attention, state-space and short
convolution layers): one tensor per layer and state part, `[num_slots + 1, *shape]` (the last
slot is scratch), the slot copies a `SchedulerOutput` asks for around a step, and the step's
`RecurrentMetadata`. Slots are handed out by the KV cache manager (`portside.kv_cache.state`).

Speculative decoding: a request verifying k proposals runs 1 + k tokens, and its state must end
as after the accepted ones only. `num_spare` slots after the scratch slot hold, for the step's
verify rows, the state after each of their tokens but the last (`RecurrentMetadata.
token_state_slots_cpu`); once the step has sampled, `commit` copies the state of each request's
accepted length into its slot (nothing to copy when every proposal was accepted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portside.contract import RecurrentMetadata, StateSpec

__all__ = ["RecurrentStates", "state_spec_of"]


def state_spec_of(model: object) -> StateSpec | None:
    """The model's `StateSpec`, or None for a model without recurrent layers (on this stage)."""
    spec_fn = getattr(model, "state_spec", None)
    spec = spec_fn() if spec_fn is not None else None
    return spec if spec is not None and spec.num_layers > 0 else None


class RecurrentStates:
    """Every recurrent layer's state tensors on this rank, and what a step does with them."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device, num_spare: int = 0) -> None:
        self.spec = spec
        self.num_slots = num_slots
        self.num_spare = num_spare  # per-token states of verify rows: slots num_slots + 1 on
        self.tensors: list[tuple[torch.Tensor, ...]] = [
            tuple(torch.zeros((num_slots + 1 + num_spare, *shape), dtype=dtype, device=device)
                  for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))
            for _ in range(spec.num_layers)
        ]
        self.device = device

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy slot src into slot dst in every layer and part, for each (src, dst)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for parts in self.tensors:
            for t in parts:
                t.index_copy_(0, dst, t.index_select(0, src))

    def metadata(self, slots: list[int], has_initial_state: list[bool], query_start_loc: torch.Tensor,
                 query_start_loc_cpu: list[int], num_decodes: int, num_verified: list[int] | None = None
                 ) -> RecurrentMetadata:
        """The step's metadata (requests in batch order, the one-token ones first). `num_verified`:
        per request, the proposals it verifies (0: none); each such request's states after its
        tokens but the last go to spare slots (`token_state_slots_cpu`)."""
        kept: list[list[int]] = []
        if num_verified is not None and any(num_verified):
            if sum(num_verified) > self.num_spare:
                raise RuntimeError(f"recurrent states: {sum(num_verified)} verified proposals in one step, "
                                   f"{self.num_spare} spare state slots")
            nxt = self.num_slots + 1
            for k in num_verified:
                kept.append(list(range(nxt, nxt + k)))
                nxt += k
        return RecurrentMetadata(
            state_slots=torch.tensor(slots, dtype=torch.int64, device=self.device),
            has_initial_state=torch.tensor(has_initial_state, dtype=torch.bool, device=self.device),
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc_cpu,
            state_slots_cpu=slots,
            has_initial_state_cpu=has_initial_state,
            num_decodes=num_decodes,
            token_state_slots_cpu=kept,
        )

    def commit(self, md: RecurrentMetadata, num_accepted: list[int]) -> None:
        """After sampling: each verify row's slot gets the state after its last token and its
        `num_accepted[i]` accepted proposals (the rejected ones' updates dropped)."""
        pairs = [(kept[n], md.state_slots_cpu[i]) for i, (kept, n) in enumerate(zip(md.token_state_slots_cpu,
                                                                                   num_accepted, strict=True))
                 if kept and n < len(kept)]
        self.copy(pairs)
