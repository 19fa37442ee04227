"""Batched multi-LoRA, written for clarity: the reference `ModelOps` inherits and every backend's
fast path is tested against (punica's idea: each token multiplied by its own adapter's A and B,
the tokens of one adapter together).

Adapters live in device *slots*. For one linear layer (in -> M outputs), with S slots and R the
largest rank (a smaller adapter's A rows and B columns past its rank are zero):

    a [S, R, in]   the A matrices
    b [S, N, R]    the B matrices, the adapter's scaling (alpha / r) already folded in

and the layer adds ``x[t] @ a[s].T @ b[s].T`` to its output, s the slot of token t. It is two
calls, so a fused layer (qkv, gate_up) shrinks once with its A matrices stacked ([S, 3R, in])
and expands once per output slice, from a column slice of y into its columns of the output:

    y = lora_shrink(x, a, mapping)                       # [T, R]
    lora_expand(y, b, mapping, out, out_offset)          # out[:, off:off + N] += y @ b[s].T

`LoRAMapping` says which slot each token uses (-1: none); it is built once per step and shared
by every layer, which is why the grouping it derives is cached on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

_V = TypeVar("_V")

__all__ = ["LoRAMapping", "LoRASegments", "lora_shrink", "lora_expand"]


@dataclass(frozen=True)
class LoRASegments:
    """The step's tokens grouped by slot, as device tensors (built without a host sync, so a
    captured graph can hold it): slot s's tokens are ``order[starts[s] : starts[s] + counts[s]]``,
    in token order; tokens without an adapter come last, after every slot's."""

    order: torch.Tensor  # [T] int64: token indices, sorted by slot (stable), the -1 tokens last
    starts: torch.Tensor  # [S] int32: where each slot's tokens begin in `order`
    counts: torch.Tensor  # [S] int32: how many tokens use each slot
    num_active: torch.Tensor  # [1] int32: tokens with an adapter (= counts.sum())


@dataclass(eq=False)
class LoRAMapping:
    """Which adapter slot each token of a step uses; one per forward, shared by every layer.

    Building it costs nothing: what backends derive from it (`segments`, `runs`) is computed on
    first use and cached here, so every layer of the step reuses it.
    """

    token_slots: torch.Tensor  # [T] int64 on the model's device: the token's slot, -1 = no adapter
    num_slots: int  # S: the slots of the layers' stacked A/B weights
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    def segments(self) -> LoRASegments:
        """The tokens grouped by slot, on the device (no host sync; scatter and sort only)."""
        if "segments" not in self._cache:
            slots = self.token_slots.long()
            key = torch.where(slots >= 0, slots, self.num_slots)  # no adapter: after every slot
            counts = torch.zeros(self.num_slots + 1, dtype=torch.int64, device=slots.device)
            counts.scatter_add_(0, key, torch.ones_like(key))
            ends = torch.cumsum(counts, 0)
            self._cache["segments"] = LoRASegments(
                order=torch.argsort(key, stable=True),
                starts=(ends - counts)[:-1].to(torch.int32),
                counts=counts[:-1].to(torch.int32),
                num_active=(ends[-1:] - counts[-1:]).to(torch.int32),
            )
        return self._cache["segments"]

    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """(slot, start, length) into ``segments().order`` for each slot some token uses, on the
        host (one device-to-host copy per step, then cached)."""
        if "runs" not in self._cache:
            seg = self.segments()
            starts, counts = seg.starts.tolist(), seg.counts.tolist()
            self._cache["runs"] = tuple((s, starts[s], n) for s, n in enumerate(counts) if n)
        return self._cache["runs"]

    @property
    def any_active(self) -> bool:
        """Whether any token uses an adapter (host: `runs`)."""
        return bool(self.runs())

    def cached(self, key: str, build: Callable[[], _V]) -> _V:
        """``build()`` once per mapping under `key`: for a backend's own per-step data."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def lora_shrink(x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """y[t] = x[t] @ a[slot[t]].T: x [T, in], a [S, R, in] -> y [T, R] in x's dtype, computed in
    fp32; rows of tokens without an adapter are 0. One matmul per slot in use, over its tokens."""
    y = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    order = mapping.segments().order
    for slot, start, n in mapping.runs():
        rows = order[start : start + n]
        y[rows] = (x[rows].float() @ a[slot].float().T).to(x.dtype)
    return y


def lora_expand(
    y: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor, out_offset: int = 0
) -> None:
    """In place: out[t, off:off + N] += y[t] @ b[slot[t]].T for each token with an adapter (others
    untouched). y [T, R] (may be a column slice of a wider tensor), b [S, N, R], out [T, M] with
    off + N <= M; summed in fp32, rounded once to out's dtype."""
    n_out = b.shape[1]
    cols = out[:, out_offset : out_offset + n_out]
    order = mapping.segments().order
    for slot, start, n in mapping.runs():
        rows = order[start : start + n]
        cols[rows] = (cols[rows].float() + y[rows].float() @ b[slot].float().T).to(out.dtype)
