"""One rank of the kit's collectives check, run in its own process.

    python -m portside.testing.conformance.comm_worker DEVICE RANK WORLD_SIZE PORT

Joins a process group of the platform's `dist_backend`, gets `platform.communicator()` and
checks all_reduce, all_gather (dims 0 and -1), broadcast (every source), barrier, and send / recv
around the ring (what pipeline-parallel stages use; skipped where the platform sets
`supports_pipeline_parallel = False`). Prints
"OK" or the first failure (prefixed with the collective's name) and exits 0 or 1.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def check(device_name: str, rank: int, world: int, port: int) -> str | None:
    from portside.platform import resolve_platform

    platform = resolve_platform(device_name)
    platform.set_device(rank)
    dev = platform.device(rank)
    dist.init_process_group(platform.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    try:
        comm = platform.communicator()
        if (comm.rank, comm.world_size) != (rank, world):
            return f"communicator: rank/world_size {(comm.rank, comm.world_size)}, expected {(rank, world)}"
        x = torch.full((3, 4), float(rank + 1), device=dev)
        got = comm.all_reduce(x.clone())
        platform.synchronize()
        if not torch.equal(got.cpu(), torch.full((3, 4), float(world * (world + 1) // 2))):
            return f"all_reduce: got {got.cpu().tolist()}, expected the sum over ranks"
        x = torch.arange(6, dtype=torch.float32, device=dev).view(2, 3) + 100 * rank
        for dim in (0, -1):
            got = comm.all_gather(x.clone(), dim=dim).cpu()
            want = torch.cat([torch.arange(6.0).view(2, 3) + 100 * r for r in range(world)], dim=dim)
            if got.shape != want.shape or not torch.equal(got, want):
                return f"all_gather(dim={dim}): got shape {tuple(got.shape)}, expected rank order concatenation {tuple(want.shape)}"
        for src in range(world):
            got = comm.broadcast(torch.full((5,), float(rank), device=dev), src=src).cpu()
            if not torch.equal(got, torch.full((5,), float(src))):
                return f"broadcast(src={src}): got {got.tolist()}"
        comm.barrier()
        if platform.supports_pipeline_parallel and world > 1:
            nxt, prev = (rank + 1) % world, (rank - 1) % world
            out = torch.arange(12, dtype=torch.float32, device=dev).view(3, 4) + 1000 * rank
            box = torch.empty(3, 4, device=dev)
            for step in (0, 1):  # even ranks send first, odd ones receive first: no order can deadlock
                if (rank + step) % 2 == 0:
                    comm.send(out, dst=nxt)
                else:
                    got = comm.recv(box, src=prev).cpu()
            if not torch.equal(got, torch.arange(12.0).view(3, 4) + 1000 * prev):
                return f"send/recv: rank {rank} got {got.tolist()} from rank {prev}"
        comm.destroy()
        return None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    device, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    error = check(device, rank, world, port)
    print("OK" if error is None else f"FAIL {error}")
    sys.exit(0 if error is None else 1)
