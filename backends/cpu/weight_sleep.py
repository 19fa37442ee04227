"""Sleeping weights on cpu (`CpuPlatform.offload_weights` / `restore_weights`): the weights
already live in host memory, so "offloading" them means giving their pages back to the OS.

`pack_weights` put every parameter and buffer of the model into one private anonymous mapping
(`packed_buffer`). Sleep level 1 writes that buffer to an unlinked temporary file
(``$PORTSIDE_SLEEP_DIR``, else the system's temporary folder) and then discards its pages with
``madvise(MADV_DONTNEED)``: the process's resident memory falls by the weights' size while every
tensor keeps its address (views, the fused decode step's pointers and anything else built over
them stay valid). Wake-up reads the file back into the same pages. Level 2 saves only the
buffers (rotary tables and the like, which no checkpoint holds, as vLLM keeps them): the
parameters' pages come back as zeros, for a weight update to fill.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from dataclasses import dataclass
from typing import IO

import torch
from torch import nn

from portside.backends.cpu.weights import packed_buffer

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_CHUNK = 64 << 20  # bytes per read or write


@dataclass
class SleepingBuffer:
    flat: torch.Tensor  # the packed weights (uint8), their pages discarded
    file: IO[bytes] | None  # what they held (level 1); None: level 2
    buffers: list[tuple[torch.Tensor, torch.Tensor]]  # level 2: (buffer, its saved copy)


def offload_packed(model: nn.Module, keep: bool) -> SleepingBuffer | None:
    """Discard the pages of `model`'s packed weights, saved to a temporary file first when
    `keep`; None when the model's weights are not packed (the platform's default then applies)."""
    flat = packed_buffer(model)
    if flat is None:
        return None
    view = memoryview(flat.numpy())
    file = None
    buffers = [] if keep else [(b, b.detach().clone()) for b in model.buffers() if b.numel()]
    if keep:
        file = tempfile.TemporaryFile(dir=os.environ.get("PORTSIDE_SLEEP_DIR") or None)  # noqa: SIM115  (closed on wake)
        for start in range(0, len(view), _CHUNK):
            file.write(view[start : start + _CHUNK])
        file.flush()
    _discard_pages(flat)
    return SleepingBuffer(flat, file, buffers)


def restore_packed(handle: SleepingBuffer) -> None:
    """Read the saved weights back into their pages (after level 2: the buffers only, the
    parameters left zero)."""
    for b, saved in handle.buffers:
        b.copy_(saved)
    handle.buffers = []
    if handle.file is None:
        return
    view = memoryview(handle.flat.numpy())
    handle.file.seek(0)
    done = 0
    while done < len(view):
        n = handle.file.readinto(view[done : done + _CHUNK])
        if not n:
            raise OSError(f"the sleeping weights' file ended after {done} of {len(view)} bytes")
        done += n
    handle.file.close()
    handle.file = None


def _discard_pages(flat: torch.Tensor) -> None:
    """madvise(MADV_DONTNEED) over the buffer's pages: they leave the resident set and read as
    zeros when next touched."""
    addr, page = flat.data_ptr(), mmap.PAGESIZE
    if addr % page:
        raise ValueError("the packed weights do not start on a page boundary")
    length = -(-flat.numel() // page) * page  # the mapping extends to whole pages
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(addr, length, _MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) on the packed weights: {os.strerror(err)}")
