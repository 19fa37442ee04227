"""portside-triton-interp: registers the test device `triton-interp`.

CPU tensors, the cuda/rocm backends' Triton attention kernels run by the Triton interpreter
(``TRITON_INTERPRET=1``). It exists so CPU-only CI can put those kernels through the
conformance kit and end-to-end parity; it is never auto-selected (priority -1) and is slow.

Imported by discovery on every `portside` start: no torch, no triton here.
"""

from __future__ import annotations


def register() -> str:
    """Entry point of group ``portside.platforms``: the platform class path."""
    return "portside_triton_interp.platform:TritonInterpPlatform"
