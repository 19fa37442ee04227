"""The standard torch.distributed launcher environment and process-group initialisation."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from portside.contract import Platform


def dist_timeout_s() -> float:
    """How long a collective (or the rendezvous) may wait for a peer before torch.distributed
    raises: PORTSIDE_DIST_TIMEOUT, read when a group is made (a worker forked from the fork server
    has the engine's environment only from its start)."""
    return float(os.environ.get("PORTSIDE_DIST_TIMEOUT", "600"))


@dataclass(frozen=True)
class LauncherEnv:
    """What a launcher (torchrun, mpirun wrappers, a job scheduler) tells each process."""

    rank: int  # RANK: this process's rank in the world
    world_size: int  # WORLD_SIZE
    local_rank: int  # LOCAL_RANK: which device on this machine
    master_addr: str  # MASTER_ADDR: where rank 0 listens for the rendezvous
    master_port: int  # MASTER_PORT

    @property
    def init_method(self) -> str:
        return f"tcp://{_host(self.master_addr)}:{self.master_port}"


def launcher_env(environ: Mapping[str, str] | None = None) -> LauncherEnv | None:
    """The launcher environment when ``WORLD_SIZE`` and ``RANK`` are set, else None.

    Raises ValueError naming the missing or malformed variable when only part of it is set.
    """
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        port = int(env.get("MASTER_PORT", "29500"))
    except ValueError as e:
        raise ValueError(f"malformed launcher environment (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT): {e}") from e
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    if "MASTER_ADDR" not in env and world > 1:
        raise ValueError("WORLD_SIZE > 1 but MASTER_ADDR is not set; set MASTER_ADDR and MASTER_PORT to rank 0's address")
    return LauncherEnv(rank, world, local_rank, env.get("MASTER_ADDR", "127.0.0.1"), port)


def init_process_group(platform: type[Platform], rank: int, world_size: int, init_method: str) -> None:
    """Join the default process group with the platform's collectives backend (gloo, nccl, ...),
    its collectives timing out after `dist_timeout_s()`."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    # torch.distributed.nn binds `group.WORLD` into its functions' defaults when imported; once
    # the group exists, that import (transformers makes it when a config is read) would keep the
    # group alive past destroy_process_group, its gloo threads running into interpreter exit,
    # where they can abort the process ("terminate called without an active exception").
    # Imported first, the defaults hold None. (~3 ms)
    import torch.distributed.nn  # noqa: F401

    dist.init_process_group(
        backend=platform.dist_backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=dist_timeout_s()),
    )


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a single-machine rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
