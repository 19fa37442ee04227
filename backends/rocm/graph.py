"""HIP graphs over padded decode-batch buckets. torch exposes HIP graphs as `torch.cuda.CUDAGraph`,
so the logic is the shared `portside.backends.triton.graphs.DeviceGraphRunner`."""

from __future__ import annotations

from portside.backends.triton.graphs import DeviceGraphRunner

__all__ = ["HipGraphRunner"]


class HipGraphRunner(DeviceGraphRunner):
    """Replays a HIP graph for decode batches that fit a captured bucket; eager otherwise."""

    name = "hip_graph"
