"""CUDA graphs over padded decode-batch buckets (the logic is shared with rocm, see
`portside.backends.triton.graphs`)."""

from __future__ import annotations

from portside.backends.triton.graphs import DeviceGraphRunner

__all__ = ["CudaGraphRunner"]


class CudaGraphRunner(DeviceGraphRunner):
    """Replays a CUDA graph for decode batches that fit a captured bucket; eager otherwise."""

    name = "cuda_graph"
