"""KV blocks outside the device cache: the layout-neutral form a block takes when it is copied to
host memory, a file or another instance (`KVBlockLayout`), and the reads and writes that move
whole blocks between a backend's cache tensors and that form (`KVBlockIO`).

A backend's cache layout is its own (`AttentionBackend.kv_cache_shape`: core's is
``[2, num_blocks, block_size, num_kv_heads, head_size]``, the xla backend's interleaves K and V
heads, the example NPU plugin's is block-major). A block leaving the device is therefore always
written in one neutral order, so that blocks saved by one backend are readable by another (cpu
prefill, xla decode). For a model's K/V cache (`element_order` `NEUTRAL_ELEMENT_ORDER`):

    for each attention layer (in model order): K then V, each [block_size, num_kv_heads, row],
    row-major, in `KVBlockLayout.dtype`, little-endian

i.e. one block is the tensor ``[num_layers, 2, block_size, num_kv_heads, row]``. A row is what
the cache stores for one (token, KV head), bit for bit, so a block saved and restored is exact:

- the model's dtype (or an fp8 cache's float8): ``head_size`` values;
- an int8 cache (`row_scale` "float32"): the row as `portside.contract.kv_quant.quantize_kv`
  stores it, ``head_size`` int8 values and then the 4 bytes of the row's fp32 scale
  (``row = head_size + 4``): the quantized values and their scales, never a lossy dequantized copy.

Latent attention (MLA, `LatentKVCacheSpec`; `element_order` `LATENT_ELEMENT_ORDER`): per layer
one row of ``head_size`` (latent + rotary) values per token, no K/V or head axis, i.e. one block
is ``[num_layers, block_size, head_size]``.

Speculative decoding with a draft model or an EAGLE/MTP head: its layers' caches use the target's
block ids, so a block carries them too, as a second layout (`KVBlockLayout.draft`) whose bytes
follow the target's in each block (a restored prefix gives the draft the KV it had).

Its bytes (`block_bytes` per block) are what a tier stores and a connector sends. The default
(`Platform.kv_block_layout`, `Platform.kv_block_io`) is built from the model's `KVCacheSpec` and
moves blocks through the backend's `read_stored_kv` / `write_stored_kv` (whose defaults go through
`read_kv` / `write_kv`, which every backend has, and read core's int8 layout directly) and
`read_latent` / `write_latent`, so every backend and plugin inherits a working transfer path
without code. A vendor may override `Platform.kv_block_io` with a faster copy (one strided copy
per layer) as long as the bytes it produces are the neutral ones; the conformance kit checks the
round trip (`test_kv_cache.py`), for 8-bit caches and latent layers too. Recurrent state (hybrid
models) is not described here: the KV connectors refuse such models (see `portside.kv_transfer`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from portside.contract.kv_quant import kv_row_bytes
from portside.contract.kv_spec import KVCacheSpec
from portside.contract.latent import LatentKVCacheSpec

__all__ = ["KVBlockLayout", "KVBlockIO", "NEUTRAL_ELEMENT_ORDER", "LATENT_ELEMENT_ORDER"]

NEUTRAL_ELEMENT_ORDER = "layer,kv,token,head,dim"
"""The axes of one neutral K/V block, outermost first."""
LATENT_ELEMENT_ORDER = "layer,token,dim"
"""The axes of one neutral latent (MLA) block, outermost first."""


@dataclass(frozen=True)
class KVBlockLayout:
    """What one KV block holds, independent of any backend's cache layout (see the module docstring)."""

    dtype: str
    """The elements' type, torch's name without ``torch.`` (``"float32"``, ``"bfloat16"``,
    ``"float8_e4m3fn"``, ``"int8"``)."""
    block_size: int
    """Token slots per block."""
    layer_shapes: tuple[tuple[int, ...], ...]
    """Per layer, the shape of its part of one block: ``(2, block_size, num_kv_heads, row)`` for
    K/V, ``(block_size, head_size)`` for a latent layer."""
    element_order: str = NEUTRAL_ELEMENT_ORDER
    """The axes' names, outermost first (the layer axis, then a layer shape's)."""
    row_scale: str | None = None
    """``"float32"``: an int8 cache's rows end in the 4 bytes of their fp32 scale (`quantize_kv`'s
    rows); None: rows hold values only."""
    draft: KVBlockLayout | None = None
    """A speculative draft model's or EAGLE/MTP head's layers, whose caches use the same block
    ids: their neutral bytes follow this layout's in each block. None: no draft."""

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, block_size: int) -> KVBlockLayout:
        """The neutral layout of a model's KV cache (its pipeline stage's layers, its TP rank's heads)."""
        dtype = str(spec.storage_dtype).removeprefix("torch.")
        if isinstance(spec, LatentKVCacheSpec):
            return cls(dtype, block_size, ((block_size, spec.head_size),) * spec.num_layers, LATENT_ELEMENT_ORDER)
        scaled = spec.storage_dtype == torch.int8
        row = kv_row_bytes(spec.head_size, spec.storage_dtype) if scaled else spec.head_size
        shape = (2, block_size, spec.num_kv_heads, row)
        return cls(dtype, block_size, (shape,) * spec.num_layers, row_scale="float32" if scaled else None)

    def with_draft(self, draft: KVBlockLayout) -> KVBlockLayout:
        """This layout carrying `draft`'s layers after its own in each block."""
        if draft.block_size != self.block_size:
            raise ValueError(f"KV block layout: a draft's blocks of {draft.block_size} tokens, the target's {self.block_size}")
        return dataclasses.replace(self, draft=draft)

    @property
    def latent(self) -> bool:
        """Whether the layers are latent (MLA) rows rather than K and V."""
        return self.element_order == LATENT_ELEMENT_ORDER

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"KV block layout: unknown dtype {self.dtype!r}")
        return dtype

    @property
    def elements_per_block(self) -> int:
        """Elements of one block's own layers (not its `draft`'s)."""
        return sum(math.prod(s) for s in self.layer_shapes)

    @property
    def own_bytes(self) -> int:
        """Bytes of one block's own layers (not its `draft`'s)."""
        return self.elements_per_block * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in the neutral form, a draft's layers included."""
        return self.own_bytes + (self.draft.block_bytes if self.draft is not None else 0)

    def parts(self) -> list[KVBlockLayout]:
        """This layout's own layers, then its draft's, each as a layout without a draft."""
        own = dataclasses.replace(self, draft=None)
        return [own] + (self.draft.parts() if self.draft is not None else [])

    def fingerprint(self, *identity: str) -> str:
        """A short digest of this layout and `identity` (e.g. the model's path and dtype): stored
        blocks are only read back by a process with the same fingerprint."""
        text = "|".join([self.dtype, str(self.block_size), repr(self.layer_shapes), self.element_order, *identity])
        if self.row_scale is not None:  # (a layout without these digests as before it had them)
            text += f"|row_scale={self.row_scale}"
        if self.draft is not None:
            text += f"|draft={self.draft.fingerprint()}"
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class KVBlockIO:
    """Copies whole blocks between a backend's per-layer caches and neutral blocks.

    `kv_caches`: the target's layer caches, then (for a layout with a `draft`) the draft's.
    Default: through the attention backend's `read_stored_kv` / `write_stored_kv` (latent layers:
    `read_latent` / `write_latent`) over the blocks' slots (one call per layer for all the blocks
    of a transfer). Thread-safe for disjoint blocks: a transfer into blocks no step reads may run
    beside the forward."""

    def __init__(self, backend: Any, layout: KVBlockLayout) -> None:
        self.backend = backend
        self.layout = layout

    def _slots(self, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        bs = self.layout.block_size
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        return (ids[:, None] * bs + torch.arange(bs)).reshape(-1).to(device)

    def _split(self, kv_caches: Sequence[torch.Tensor]) -> list[tuple[KVBlockLayout, Sequence[torch.Tensor]]]:
        """Each part of the layout with its caches."""
        out, at = [], 0
        for part in self.layout.parts():
            n = len(part.layer_shapes)
            out.append((part, kv_caches[at : at + n]))
            at += n
        if at != len(kv_caches):
            raise ValueError(f"KV block IO: {len(kv_caches)} layer caches for a layout of {at} layers")
        return out

    def read(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks as neutral tensors on the host: ``[len(block_ids), num_layers, *layer shape]``
        in the layout's dtype (``[n, num_layers, 2, block_size, H, row]`` for K/V); for a layout
        with a draft, ``[n, block_bytes]`` uint8. Either way ``.reshape(n, -1).view(torch.uint8)``
        holds each block's neutral bytes."""
        parts = [self._read_part(part, caches, block_ids) for part, caches in self._split(kv_caches)]
        if len(parts) == 1:
            return parts[0]
        n = len(block_ids)
        return torch.cat([p.reshape(n, -1).view(torch.uint8) for p in parts], dim=1)

    def _read_part(self, part: KVBlockLayout, caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
        n, dtype = len(block_ids), part.torch_dtype
        shape = part.layer_shapes[0]
        if any(s != shape for s in part.layer_shapes):
            raise ValueError(f"KV block IO: layers of different shapes {sorted(set(part.layer_shapes))}")
        out = torch.empty((n, len(caches), *shape), dtype=dtype)
        for i, cache in enumerate(caches):
            slots = self._slots(block_ids, cache.device)
            if part.latent:
                out[:, i] = self.backend.read_latent(cache, slots).to("cpu", dtype).reshape(n, *shape)
                continue
            k, v = self.backend.read_stored_kv(cache, slots)
            out[:, i, 0] = k.to("cpu", dtype).reshape(n, *shape[1:])
            out[:, i, 1] = v.to("cpu", dtype).reshape(n, *shape[1:])
        return out

    def write(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Store neutral blocks (as `read` returns them, or their bytes ``[n, block_bytes]``
        uint8) into the caches at `block_ids`."""
        n = len(block_ids)
        raw = blocks.contiguous().view(torch.uint8).reshape(n, -1) if blocks.dtype != torch.uint8 else blocks.reshape(n, -1)
        if raw.shape[1] != self.layout.block_bytes:
            raise ValueError(f"KV block IO: blocks of {raw.shape[1]} bytes, the layout's are {self.layout.block_bytes}")
        at = 0
        for part, caches in self._split(kv_caches):
            data = raw[:, at : at + part.own_bytes]
            at += part.own_bytes
            self._write_part(part, caches, block_ids, data.contiguous().view(part.torch_dtype))

    def _write_part(self, part: KVBlockLayout, caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                    data: torch.Tensor) -> None:
        n, shape = len(block_ids), part.layer_shapes[0]
        data = data.reshape(n, len(caches), *shape)
        for i, cache in enumerate(caches):
            slots = self._slots(block_ids, cache.device)
            if part.latent:
                self.backend.write_latent(cache, data[:, i].reshape(n * shape[0], shape[1]).to(cache.device), slots)
                continue
            rows = (n * shape[1], *shape[2:])
            k = data[:, i, 0].reshape(rows).to(cache.device)
            v = data[:, i, 1].reshape(rows).to(cache.device)
            self.backend.write_stored_kv(cache, k, v, slots)

