"""Sleeping weights: the default `Platform.offload_weights` / `restore_weights` (a platform whose
weights live somewhere special, such as the cpu backend's one packed buffer, overrides them).

`offload_weights(model, keep=True)` (sleep level 1) copies every parameter and buffer to host
memory and leaves the model holding empty tensors, so its device memory can be released;
`keep=False` (level 2) keeps a copy of the buffers only (rotary tables and the like, which no
checkpoint holds), as vLLM does. `restore_weights` puts back the copies, and after level 2 the
parameters as tensors of their shapes and dtypes with undefined values, for an update to fill. Every
tensor keeps its identity (only its `.data` changes): whatever holds a parameter object still
holds it; whatever holds its old storage (a graph captured over it) must be rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["OffloadedWeights", "model_tensors", "offload_to_host", "restore_from_host"]


@dataclass
class OffloadedWeights:
    """What `offload_to_host` took: each tensor with its shape, dtype and device, and its host
    copy (None: discarded)."""

    entries: list[tuple[torch.Tensor, torch.Size, torch.dtype, torch.device, torch.Tensor | None]]

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * torch.empty((), dtype=d).element_size() for _, s, d, _, _ in self.entries)


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every non-empty parameter and buffer of `model`, each once (tied ones share an entry)."""
    seen: set[int] = set()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen and t.numel():
            seen.add(id(t))
            out.append(t)
    return out


def offload_to_host(model: torch.nn.Module, keep: bool, pin: bool = False) -> OffloadedWeights:
    """Move the weights' data off the device (see the module docstring). `pin`: page-locked host
    copies (faster copies back on accelerators that have them)."""
    entries = []
    buffers = {id(b) for b in model.buffers()}
    for t in model_tensors(model):
        host = None
        if keep or id(t) in buffers:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.copy_(t.detach())
        entries.append((t, t.shape, t.dtype, t.device, host))
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return OffloadedWeights(entries)


def restore_from_host(handle: Any) -> None:
    """Give every tensor `offload_to_host` emptied its data back (undefined values where none was kept)."""
    for t, shape, dtype, device, host in handle.entries:
        t.data = host.to(device) if host is not None else torch.empty(shape, dtype=dtype, device=device)
