"""Recurrent layers: what a linear-attention or state-space layer keeps per sequence
(`StateSpec`), the per-step data its kernels read (`RecurrentMetadata`), and the kernels
(`RecurrentKernels`, mixed into `ModelOps`), each defaulting to core's pure-torch reference in
`portside.ops.recurrent`.

A recurrent layer's state does not grow with the sequence: per sequence it is a fixed set of
tensors (a causal convolution's last inputs, an SSM or delta-rule state). The runner allocates,
per recurrent layer and per state tensor, one tensor ``[num_state_slots + 1, *shape]`` (the
last slot is scratch, for padded graph entries); the KV cache manager hands each running
request one slot (`RecurrentMetadata.state_slots`), and copies slots to save and restore the
state at block-aligned positions for prefix caching (`RecurrentMetadata` is rebuilt per step).

Kernel conventions (every kernel): a step's tokens are a flat batch grouped by request in
`query_start_loc` order, the one-token requests first (`num_decodes` of them); request i starts
from the state in slot ``state_slots[i]`` when ``has_initial_state[i]`` (a later chunk, a decode,
a restored prefix), else from zeros (the slot is then not read: it may hold a finished
sequence's state), and leaves its state after its last token in that slot; no other slot is
touched. Math is fp32 inside; outputs are in the input's dtype; states keep their tensors' dtype.

Speculative decoding: a request that verifies proposals runs 1 + k tokens, of which only the
accepted prefix belongs to the sequence, known after sampling. Such a request also leaves the
state after each of its tokens but the last in the slots ``token_state_slots_cpu[i]`` (the state
after its last token goes to its own slot, as always), and the runner copies the one of the
accepted length into its slot (`portside.runner.recurrent`). A kernel override honours this
only where its class lists it in `RecurrentKernels.token_state_kernels`; `kernels_for` gives
every other override's steps with such requests to the reference, so a backend written before
this field still serves speculative decoding correctly.
The per-token inputs may be strided views of a fused projection (each token's row contiguous) and
are left unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from portside.ops import recurrent as ref

__all__ = ["RECURRENT_KERNELS", "RecurrentKernels", "RecurrentMetadata", "StateSpec", "kernels_for"]

RECURRENT_KERNELS = ("causal_conv1d", "ssd_scan", "selective_scan", "gated_delta_rule")


@dataclass(frozen=True)
class StateSpec:
    """The state each recurrent layer of a model keeps per sequence (this rank's share)."""

    num_layers: int
    """Recurrent layers on this rank (its pipeline stage's)."""
    shapes: tuple[tuple[int, ...], ...]
    """Each state tensor's shape for one sequence, e.g. ``((conv_dim, kernel - 1), (heads, head_dim, state))``."""
    dtypes: tuple[torch.dtype, ...]
    """Each state tensor's dtype."""
    kind: str = "recurrent"
    """The layer kind, for logs and errors ("mamba2", "gated_delta_net", "short_conv", "mamba")."""

    @property
    def bytes_per_layer(self) -> int:
        """One sequence's state in one layer."""
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(self.shapes, self.dtypes, strict=True))

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state in every recurrent layer: the size of one state slot."""
        return self.num_layers * self.bytes_per_layer


@dataclass
class RecurrentMetadata:
    """Per-step inputs of the recurrent kernels, built by the model runner (tensors on the
    model's device, `*_cpu` host copies)."""

    state_slots: torch.Tensor
    """[num_reqs] int64: each request's state slot."""
    has_initial_state: torch.Tensor
    """[num_reqs] bool: start from the slot's state (else from zeros)."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: request i's tokens are ``query_start_loc[i]:query_start_loc[i+1]``."""
    query_start_loc_cpu: list[int] = field(default_factory=list)
    """`query_start_loc` on the host."""
    state_slots_cpu: list[int] = field(default_factory=list)
    """`state_slots` on the host."""
    has_initial_state_cpu: list[bool] = field(default_factory=list)
    """`has_initial_state` on the host."""
    num_decodes: int = 0
    """Requests [0, num_decodes) have one token each."""
    token_state_slots_cpu: list[list[int]] = field(default_factory=list)
    """Speculative decoding (empty: none this step): per request, the slots that receive its state
    after each of its tokens but the last (``len`` = its tokens - 1), or ``[]`` for a request
    whose intermediate states are not kept. Only requests after the decodes have any."""

    @property
    def keeps_token_states(self) -> bool:
        """Whether some request of the step keeps its per-token states (`token_state_slots_cpu`)."""
        return any(self.token_state_slots_cpu)

    @property
    def num_reqs(self) -> int:
        """Requests in the step."""
        return len(self.query_start_loc_cpu) - 1


class RecurrentKernels:
    """The kernels of recurrent layers (a mixin of `ModelOps`); shapes and semantics in
    `portside.ops.recurrent`, whose pure-torch functions are the defaults. A backend overrides
    those it has a faster kernel for; the conformance kit (`portside.testing.conformance`) tests
    each override against the reference."""

    token_state_kernels: ClassVar[frozenset[str]] = frozenset()
    """The kernels (names in `RECURRENT_KERNELS`) this class overrides that honour
    `RecurrentMetadata.token_state_slots_cpu`; `kernels_for` runs the others' steps that keep
    per-token states on the reference."""

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        md: RecurrentMetadata,
        activation: str | None = "silu",
    ) -> torch.Tensor:
        """Depthwise causal convolution per request: x [T, C], weight [C, K], bias [C],
        conv_state [slots, C, K - 1] (the K - 1 inputs before each request's first token;
        updated to its last K - 1) -> [T, C], then `activation` ("silu" or None)."""
        return ref.causal_conv1d(x, weight, bias, conv_state, md, activation)

    def ssd_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        ssm_state: torch.Tensor,
        md: RecurrentMetadata,
        D: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        dt_softplus: bool = True,
        dt_limit: tuple[float, float] = (0.0, math.inf),
    ) -> torch.Tensor:
        """The Mamba-2 selective state-space scan: x [T, H, P], dt [T, H], A [H], B and C
        [T, G, N] (head h reads group h // (H // G)), ssm_state [slots, H, P, N] -> y [T, H, P]."""
        return ref.ssd_scan(x, dt, A, B, C, ssm_state, md, D, dt_bias, dt_softplus, dt_limit)

    def selective_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        ssm_state: torch.Tensor,
        md: RecurrentMetadata,
        D: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        dt_softplus: bool = True,
    ) -> torch.Tensor:
        """The Mamba-1 selective scan: x and dt [T, Dm], A [Dm, N], B and C [T, N], ssm_state
        [slots, Dm, N], z [T, Dm] (output gate silu(z)) -> y [T, Dm]."""
        return ref.selective_scan(x, dt, A, B, C, ssm_state, md, D, z, dt_bias, dt_softplus)

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        md: RecurrentMetadata,
        scale: float,
        use_qk_l2norm: bool = True,
    ) -> torch.Tensor:
        """The gated delta rule (Gated DeltaNet): q and k [T, Hk, K], v [T, Hv, V] (value head
        j reads key head j // (Hv // Hk)), g [T, Hv] (log decay), beta [T, Hv], state
        [slots, Hv, K, V] -> o [T, Hv, V]."""
        return ref.gated_delta_rule(q, k, v, g, beta, state, md, scale, use_qk_l2norm)


_REFERENCE = RecurrentKernels()


def kernels_for(ops: RecurrentKernels, md: RecurrentMetadata) -> RecurrentKernels:
    """The kernels to run a step with: `ops`, unless the step keeps per-token states
    (speculative decoding's verify rows) and `ops` overrides a recurrent kernel without listing it
    in `token_state_kernels`: then core's reference, which honours them."""
    if not md.keeps_token_states:
        return ops
    mro = type(ops).__mro__
    overrides = {n for c in mro[: mro.index(RecurrentKernels)] for n in RECURRENT_KERNELS if n in vars(c)}
    return ops if overrides <= type(ops).token_state_kernels else _REFERENCE
