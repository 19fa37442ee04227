"""The mixture-of-experts block: a replicated router, every expert's weights stacked in two
tensors, computed by the platform's `ModelOps.fused_moe`, and (Qwen2-MoE) a gated shared expert.

Under tensor parallelism each rank keeps a slice of every expert's intermediate dimension (as
vLLM's TP MoE does), so routing is the same on every rank and one all-reduce sums the experts.

Checkpoint parts (`shard_id`s of `experts.w13` / `experts.w2`): ``(e, "gate")``, ``(e, "up")``,
``(e, "down")`` for expert e's HF tensors; None for transformers 5's fused ``experts.gate_up_proj``
[E, 2I, hidden] and ``experts.down_proj`` [E, hidden, I].
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from portside.contract import Communicator, ModelOps
from portside.model.layers import ReplicatedLinear, _copy, _divide, _param

__all__ = ["MoEExperts", "SparseMoEBlock"]


class MoEExperts(nn.Module):
    """w13 [E, 2 * I / tp, hidden] (each expert's gate rows then up rows), w2 [E, hidden, I / tp]."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp_rank: int, tp_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.tp_rank, self.tp_size = num_experts, hidden_size, tp_rank, tp_size
        self.local = _divide(intermediate_size, tp_size, "expert intermediate size")
        self.w13 = _param(num_experts, 2 * self.local, hidden_size, dtype=dtype, loader=self.w13_loader)
        self.w2 = _param(num_experts, hidden_size, self.local, dtype=dtype, loader=self.w2_loader)
        self.w13.shard_ids = [(e, part) for e in range(num_experts) for part in ("gate", "up")]  # type: ignore[attr-defined]
        self.w2.shard_ids = [(e, "down") for e in range(num_experts)]  # type: ignore[attr-defined]
        self.quant13: nn.Module | None = None  # quantized w13 / w2 (`QuantWeight`s) instead
        self.quant2: nn.Module | None = None

    def _rows(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.narrow(dim, self.tp_rank * self.local, self.local)

    def w13_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = self.local
        if shard_id is None:  # fused [E, 2I, hidden]
            gate, up = loaded.chunk(2, dim=1)
            _copy(param.data[:, :n], self._rows(gate, 1), "experts.gate_up_proj")
            _copy(param.data[:, n:], self._rows(up, 1), "experts.gate_up_proj")
            return
        e, part = cast(tuple[int, str], shard_id)
        _copy(param.data[e, :n] if part == "gate" else param.data[e, n:], self._rows(loaded, 0), f"expert {e} {part}_proj")

    def w2_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:  # fused [E, hidden, I]
            _copy(param.data, self._rows(loaded, 2), "experts.down_proj")
            return
        e, _ = cast(tuple[int, str], shard_id)
        _copy(param.data[e], self._rows(loaded, 1), f"expert {e} down_proj")


class SparseMoEBlock(nn.Module):
    """x [T, hidden] -> sum of its top-k experts' outputs weighted by the router (+ the shared
    expert scaled by sigmoid(shared_expert_gate(x)), where the model has one)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        ops: ModelOps,
        comm: Communicator,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.ops = top_k, renormalize, ops
        self.comm, self.tp_size = comm, tp_size
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, dtype)
        self.gate.quantizable = False  # routers stay in full precision (as GPTQ/AWQ tools leave them)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size, tp_rank, tp_size, dtype)
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, False, dtype) if shared_expert is not None else None
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.quantizable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        router_logits = self.gate(x)  # [T, E]
        ex = self.experts
        if ex.quant13 is not None:
            weights, ids = self.ops.select_experts(router_logits, self.top_k, self.renormalize)
            y = self.ops.quantized_moe_experts(x, ex.quant13, ex.quant2, weights, ids)  # type: ignore[arg-type]
        else:
            y = self.ops.fused_moe(x, router_logits, ex.w13, ex.w2, self.top_k, self.renormalize)
        if self.tp_size > 1:
            y = self.comm.all_reduce(y)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
