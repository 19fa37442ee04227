"""Communicator contract: collectives at world size 1 (no process group, and an initialised one)
and at world size 2 in subprocesses (send / recv too, for pipeline parallelism), where the platform's distributed backend can run here."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from portside.contract import Platform
from portside.testing.conformance.cases import contract_failure


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_world_size_1_without_process_group(conformance_platform: type[Platform]) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    comm = conformance_platform.communicator()
    if (comm.rank, comm.world_size) != (0, 1):
        contract_failure("communicator", f"without a process group communicator() must be rank 0 of 1; "
                         f"got rank {comm.rank} of {comm.world_size}")  # fmt: skip
    dev = conformance_platform.device(0)
    x = torch.randn(2, 3).to(dev)
    for name, got in (("all_reduce", comm.all_reduce(x.clone())), ("all_gather", comm.all_gather(x.clone(), dim=-1)),
                      ("broadcast", comm.broadcast(x.clone(), src=0))):  # fmt: skip
        if not torch.equal(got.cpu(), x.cpu()):
            contract_failure("communicator", f"{name} at world size 1 must be the identity")
    comm.barrier()


def _run_ranks(device: str, world: int) -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "portside.testing.conformance.comm_worker", device]
    procs = [subprocess.Popen([*cmd, str(r), str(world), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]  # fmt: skip
    failures = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            failures.append(f"rank {rank} timed out (a collective hung)")
            continue
        if p.returncode != 0:
            last = (out.strip().splitlines() or [""])[-1]
            failures.append(f"rank {rank}: {last if last.startswith('FAIL') else err.strip()[-1500:]}")
    if failures:
        contract_failure("communicator", f"world size {world}: " + "; ".join(failures))


def test_world_size_1_with_process_group(conformance_platform: type[Platform], conformance_device: str) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_backend_available(conformance_platform.dist_backend):
        pytest.skip(f"torch.distributed backend {conformance_platform.dist_backend!r} is not available in this torch build")
    _run_ranks(conformance_device, 1)


def test_world_size_2(conformance_platform: type[Platform], conformance_device: str) -> None:
    import torch.distributed as dist

    p = conformance_platform
    if not dist.is_available() or not dist.is_backend_available(p.dist_backend):
        pytest.skip(f"torch.distributed backend {p.dist_backend!r} is not available in this torch build")
    if not p.host_device and p.device_info().count < 2:
        pytest.skip(f"world size 2 needs two {p.name} devices; {p.device_info().count} visible")
    _run_ranks(conformance_device, 2)
