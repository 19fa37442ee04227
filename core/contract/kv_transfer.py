"""KV blocks outside the device cache: the layout-neutral form a block takes when it is copied to
host memory, a file or another instance (`KVBlockLayout`), and the reads and writes that move
whole blocks between a backend's cache tensors and that form (`KVBlockIO`).

A backend's cache layout is its own (`AttentionBackend.kv_cache_shape`: core's is
``[2, num_blocks, block_size, num_kv_heads, head_size]``, the xla backend's interleaves K and V
heads, the example NPU plugin's is block-major). A block leaving the device is therefore always
written in one neutral order, so that blocks saved by one backend are readable by another (cpu
prefill, xla decode):

    for each attention layer (in model order): K then V, each [block_size, num_kv_heads, head_size],
    row-major, in `KVBlockLayout.dtype`, little-endian

i.e. one block is the tensor ``[num_layers, 2, block_size, num_kv_heads, head_size]``, the axes
named by `KVBlockLayout.element_order`. Its bytes are what a tier stores and a connector sends.

The default (`Platform.kv_block_layout`, `Platform.kv_block_io`) is built from the model's
`KVCacheSpec` and moves blocks through the backend's own `read_kv` / `write_kv`, which every
backend has, so every backend and plugin inherits a working transfer path without code. A vendor
may override `Platform.kv_block_io` with a faster copy (one strided copy per layer) as long as the
bytes it produces are the neutral ones; the conformance kit checks the round trip
(`test_kv_cache.py`). An 8-bit cache, latent attention (MLA) and recurrent state are not
described here yet: the KV connectors refuse such models (see `portside.kv_transfer`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from portside.contract.kv_spec import KVCacheSpec

__all__ = ["KVBlockLayout", "KVBlockIO", "NEUTRAL_ELEMENT_ORDER"]

NEUTRAL_ELEMENT_ORDER = "layer,kv,token,head,dim"
"""The axes of one neutral block, outermost first."""


@dataclass(frozen=True)
class KVBlockLayout:
    """What one KV block holds, independent of any backend's cache layout (see the module docstring)."""

    dtype: str
    """The elements' type, torch's name without ``torch.`` (``"float32"``, ``"bfloat16"``)."""
    block_size: int
    """Token slots per block."""
    layer_shapes: tuple[tuple[int, ...], ...]
    """Per attention layer, the shape of its part of one block: ``(2, block_size, num_kv_heads, head_size)``."""
    element_order: str = NEUTRAL_ELEMENT_ORDER
    """The axes' names, outermost first (the layer axis, then a layer shape's)."""

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, block_size: int) -> KVBlockLayout:
        """The neutral layout of a model's KV cache (its pipeline stage's layers, its TP rank's heads)."""
        shape = (2, block_size, spec.num_kv_heads, spec.head_size)
        return cls(str(spec.storage_dtype).removeprefix("torch."), block_size, (shape,) * spec.num_layers)

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"KV block layout: unknown dtype {self.dtype!r}")
        return dtype

    @property
    def elements_per_block(self) -> int:
        """Elements of one block, every layer's."""
        return sum(math.prod(s) for s in self.layer_shapes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in the neutral form."""
        return self.elements_per_block * torch.empty((), dtype=self.torch_dtype).element_size()

    def fingerprint(self, *identity: str) -> str:
        """A short digest of this layout and `identity` (e.g. the model's path and dtype): stored
        blocks are only read back by a process with the same fingerprint."""
        text = "|".join([self.dtype, str(self.block_size), repr(self.layer_shapes), self.element_order, *identity])
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class KVBlockIO:
    """Copies whole blocks between a backend's per-layer caches and neutral blocks.

    Default: through the attention backend's `read_kv` / `write_kv` over the blocks' slots (one
    call per layer for all the blocks of a transfer). Thread-safe for disjoint blocks: a transfer
    into blocks no step reads may run beside the forward."""

    def __init__(self, backend: Any, layout: KVBlockLayout) -> None:
        self.backend = backend
        self.layout = layout

    def _slots(self, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        bs = self.layout.block_size
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        return (ids[:, None] * bs + torch.arange(bs)).reshape(-1).to(device)

    def read(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks as neutral tensors on the host: ``[len(block_ids), num_layers, 2, block_size, H, D]``."""
        layout, n = self.layout, len(block_ids)
        _, bs, h, d = layout.layer_shapes[0]
        out = torch.empty((n, len(kv_caches), 2, bs, h, d), dtype=layout.torch_dtype)
        for i, cache in enumerate(kv_caches):
            k, v = self.backend.read_kv(cache, self._slots(block_ids, cache.device))
            out[:, i, 0] = k.reshape(n, bs, h, d).to("cpu", layout.torch_dtype)
            out[:, i, 1] = v.reshape(n, bs, h, d).to("cpu", layout.torch_dtype)
        return out

    def write(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Store neutral blocks (as `read` returns them) into the caches at `block_ids`."""
        n = len(block_ids)
        _, bs, h, d = self.layout.layer_shapes[0]
        blocks = blocks.view(self.layout.torch_dtype).reshape(n, len(kv_caches), 2, bs, h, d)
        for i, cache in enumerate(kv_caches):
            slots = self._slots(block_ids, cache.device)
            k = blocks[:, i, 0].reshape(n * bs, h, d).to(cache.device)
            v = blocks[:, i, 1].reshape(n * bs, h, d).to(cache.device)
            self.backend.write_kv(cache, k, v, slots)
