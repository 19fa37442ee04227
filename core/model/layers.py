"""Tensor-parallel building blocks. With ``tp_size == 1`` each is a plain layer.

Every parameter carries a ``weight_loader(param, full_tensor, shard_id=None)`` that receives the
*full* checkpoint tensor and copies only this rank's slice, so no rank keeps the whole model.
Collectives go through a `portside.contract.Communicator`.

Sharding (rank r of n):
- `ColumnParallelLinear` / `MergedColumnParallelLinear` / `QKVParallelLinear`: output rows split
  (no collective; the next row-parallel layer consumes the local slice);
- `RowParallelLinear`: input columns split, partial outputs summed with ``all_reduce``;
- `VocabParallelEmbedding`: vocabulary rows split, lookups of other ranks' rows are zero, summed
  with ``all_reduce``; `ParallelLMHead` gathers the vocabulary slices with ``all_gather``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from portside.contract import Communicator, SingleRankCommunicator
from portside.ops import batch_invariant

__all__ = [
    "LinearBase",
    "RMSNorm",
    "GemmaRMSNorm",
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "default_weight_loader",
]


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


def _param(*shape: int, dtype: torch.dtype, loader: Callable) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)  # filled by the loader
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint slice has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def _set_shard_ids(layer: nn.Module, shard_ids: list[object]) -> None:
    """Name the checkpoint parts a fused layer's parameters are loaded from (``shard_ids``: what
    `weight_loader` takes), so a loader can tell which part never came."""
    for p in layer.parameters(recurse=False):
        p.shard_ids = shard_ids  # type: ignore[attr-defined]


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Replicated parameter: copy the whole tensor."""
    _copy(param.data, loaded, "weight")


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last axis, in fp32, scaled in x's dtype (Llama's order)."""

    batch_invariant = False  # set by batch-invariant mode (`portside.model.batch_invariant`)

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if self.batch_invariant:
            return batch_invariant.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if self.batch_invariant:
            return batch_invariant.rms_norm(x, self.weight, self.eps, offset=True)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class LinearBase(nn.Module):
    """What every linear layer shares: where this rank's slice of the checkpoint tensor is
    (`out_partition`, `in_partition`), used by the dense weight loader and by quantized formats
    alike, and the matmul, dense or through `ModelOps.quantized_linear` once a quantized format
    has replaced ``weight`` with a `QuantWeight` (``quant``).

    ``parts``: the checkpoint parts a fused layer is loaded from (shard ids), None for one part.
    """

    parts: list[object] | None = None
    quantizable = True  # False: a quantized format leaves it in full precision (MoE routers)
    quant: nn.Module | None
    weight: nn.Parameter | None  # None once quantized
    lora: Any = None  # a portside.lora.layers.LoRALayer: its adapters' term is added to the output
    batch_invariant = False  # set by batch-invariant mode (`portside.model.batch_invariant`)

    def __init__(self, in_local: int, out_local: int, bias: bool, dtype: torch.dtype, bias_sharded: bool) -> None:
        super().__init__()
        self.in_local, self.out_local, self.dtype = in_local, out_local, dtype
        self.weight = _param(out_local, in_local, dtype=dtype, loader=self.weight_loader)
        self.bias = None
        if bias:
            self.bias = _param(out_local if bias_sharded else self.out_features, dtype=dtype,
                               loader=self.weight_loader if bias_sharded else default_weight_loader)
        self.quant = None
        self.ops: object = None  # the ModelOps a quantized format computes through

    @property
    def out_features(self) -> int:  # rows of this rank's weight
        return self.out_local

    def out_partition(self, shard_id: object = None) -> tuple[int, int, int]:
        """(first row in this rank's weight, first row in the checkpoint tensor, rows) of part
        `shard_id`. Default: the whole tensor."""
        return 0, 0, self.out_local

    def in_partition(self) -> tuple[int, int] | None:
        """(first column in the checkpoint tensor, columns) this rank keeps; None: all."""
        return None

    def checkpoint_rows(self, shard_id: object = None) -> int:
        """Rows of part `shard_id`'s whole checkpoint tensor (what every rank's slice is cut from)."""
        return self.out_partition(shard_id)[2] * getattr(self, "tp_size", 1) if self.column_split else self.out_local

    column_split = False  # output rows split over ranks

    def part_index(self, shard_id: object) -> int:
        return 0 if self.parts is None else self.parts.index(shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        dst, src, n = self.out_partition(shard_id)
        if loaded.shape[0] != self.checkpoint_rows(shard_id):
            raise ValueError(f"has {loaded.shape[0]} rows, expected {self.checkpoint_rows(shard_id)}")
        cols = self.in_partition()
        if cols is not None and loaded.dim() == 2:
            loaded = loaded.narrow(1, *cols)
        _copy(param.data.narrow(0, dst, n), loaded.narrow(0, src, n), "weight" if shard_id is None else f"part {shard_id!r}")

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.quant, nn.ModuleList):  # `QuantParts`: fused parts kept apart (act orders that differ)
            ys, row, parts = [], 0, cast(list[Any], list(self.quant))
            for w in parts:
                ys.append(self.ops.quantized_linear(x, w, None if bias is None else bias[row : row + w.out_features]))  # type: ignore[attr-defined]
                row += w.out_features
            return torch.cat(ys, dim=-1)
        if self.quant is not None:
            return self.ops.quantized_linear(x, self.quant, bias)  # type: ignore[attr-defined]
        assert self.weight is not None
        if self.batch_invariant:
            return batch_invariant.linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y


class ReplicatedLinear(LinearBase):
    """y = x W^T (+ b), the whole weight on every rank (a MoE router, a shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype, bias_sharded=False)


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's output rows split across ranks: y is this rank's slice."""

    column_split = True

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int, dtype: torch.dtype
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        super().__init__(in_features, _divide(out_features, tp_size, "output features"), bias, dtype, bias_sharded=True)

    def out_partition(self, shard_id: object = None) -> tuple[int, int, int]:
        return 0, self.tp_rank * self.out_local, self.out_local


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and
    up). Checkpoint part i (shard_id i) fills rows ``[sum(local sizes before i), +local size)``."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, tp_rank: int, tp_size: int, dtype: torch.dtype
    ) -> None:
        self.local_sizes = [_divide(s, tp_size, "output features") for s in output_sizes]
        self.parts = list(range(len(output_sizes)))
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size, dtype)
        _set_shard_ids(self, self.parts)

    def out_partition(self, shard_id: object = None) -> tuple[int, int, int]:
        assert isinstance(shard_id, int), "merged linear needs the index of the part being loaded"
        size = self.local_sizes[shard_id]
        return sum(self.local_sizes[:shard_id]), self.tp_rank * size, size


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projection. Query heads are split across ranks; KV heads are split when
    there are at least as many as ranks, else each rank keeps (a replica of) the one KV head its
    query heads use."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "KV heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            _divide(tp_size, num_kv_heads, "tensor-parallel size / KV heads")  # replicas must be even
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank * num_kv_heads // tp_size
        self.total_kv_heads = num_kv_heads
        out_local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.parts = ["q", "k", "v"]
        super().__init__(hidden_size, out_local, bias, 0, 1, dtype)  # sizes already per rank
        self.tp_rank, self.tp_size = tp_rank, tp_size
        _set_shard_ids(self, self.parts)

    def out_partition(self, shard_id: object = None) -> tuple[int, int, int]:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            return 0, self.tp_rank * q_size, q_size
        if shard_id in ("k", "v"):
            return (q_size if shard_id == "k" else q_size + kv_size), self.kv_head_start * d, kv_size
        raise ValueError(f"qkv shard_id must be 'q', 'k' or 'v', got {shard_id!r}")

    def checkpoint_rows(self, shard_id: object = None) -> int:
        return (self.num_heads * self.tp_size if shard_id == "q" else self.total_kv_heads) * self.head_dim


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's input columns split: x is this rank's slice, partial products are
    summed over ranks (all_reduce), then the (replicated) bias is added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        comm: Communicator | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        super().__init__(_divide(in_features, tp_size, "input features"), out_features, bias, dtype, bias_sharded=False)
        self.comm = comm or SingleRankCommunicator()

    def in_partition(self) -> tuple[int, int] | None:
        return (self.tp_rank * self.in_local, self.in_local) if self.tp_size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        y = self.matmul(x)
        if self.lora is not None:  # x is this rank's slice: a partial term, summed with y's
            self.lora.apply(x, y)
        if self.tp_size > 1:
            y = self.comm.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows split across ranks (the last shard zero-padded)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        comm: Communicator | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size, self.dtype = vocab_size, dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.comm = comm or SingleRankCommunicator()
        self.rows = -(-vocab_size // tp_size)  # per rank, padded
        self.start = tp_rank * self.rows
        self.weight = _param(self.rows, hidden_size, dtype=dtype, loader=self.weight_loader)
        self.quant: nn.Module | None = None  # a quantized table (GGUF), looked up through `ops`
        self.ops: object = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding has {loaded.shape[0]} rows, expected vocab size {self.vocab_size}")
        n = max(0, min(self.rows, self.vocab_size - self.start))
        param.data.zero_()
        _copy(param.data[:n], loaded.narrow(0, self.start, n), "embedding")

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.ops.quantized_embedding(ids, self.quant).to(self.dtype)  # type: ignore[attr-defined]
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = self.lookup(local.masked_fill(outside, 0))
        h = h.masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(h)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharing the embedding's vocabulary split; logits are gathered so that
    every rank returns the full vocabulary."""

    batch_invariant = False  # set by batch-invariant mode (`portside.model.batch_invariant`)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        if self.quant is not None:
            logits = self.ops.quantized_linear(hidden, self.quant)  # type: ignore[attr-defined]
        elif self.batch_invariant:
            logits = batch_invariant.linear(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)  # [N, rows]
        if self.tp_size > 1:
            logits = self.comm.all_gather(logits, dim=-1)[:, : self.vocab_size]  # [N, vocab]
        return logits
