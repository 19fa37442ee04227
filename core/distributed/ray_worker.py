"""The worker side of the Ray executor: the body of one Ray actor, holding one rank.

It wraps the same `Worker` and handles the same messages (`InitKVCache`, a `SchedulerOutput` per
step) as a process spawned by `MultiprocExecutor`; only the transport differs (Ray method calls
instead of a pipe). It never raises: a failure comes back as a `WorkerError`, as over the pipe,
and the executor then kills every actor. Plain Python: the executor wraps it with `ray.remote`,
so importing this module needs no Ray.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any

from portside.config import EngineConfig
from portside.contract import Platform
from portside.distributed.env import free_port, init_process_group
from portside.distributed.messages import Shutdown, WorkerError, WorkerReady
from portside.distributed.worker import Worker, destroy_process_group_quietly, step_reply


@dataclass(frozen=True)
class RankPlace:
    """Where Ray started an actor."""

    pid: int
    node_id: str  # Ray's node id (hex)
    ip: str  # the node's address in the Ray cluster


@dataclass(frozen=True)
class RankSetup:
    """What an actor needs to become its rank (sent once, after every actor is placed)."""

    rank: int
    world_size: int
    local_rank: int  # its index among the ranks on its node
    ranks_on_node: int
    init_method: str  # tcp://HOST:PORT of the torch.distributed rendezvous (rank 0's node)
    config: EngineConfig
    platform: type[Platform]
    eos_token_id: int | None
    num_threads: int | None  # cpu: torch threads (the engine's OMP_NUM_THREADS); None: cores / ranks on the node


class RayWorker:
    """One rank in a Ray actor. Methods are called in order by the executor (an actor runs one call at a time)."""

    def __init__(self) -> None:
        self.rank = -1
        self.output_rank = 0
        self.config: EngineConfig | None = None
        self.worker: Worker | None = None

    def place(self) -> RankPlace:
        import ray

        return RankPlace(os.getpid(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())

    def free_port(self, ip: str) -> int:
        """A port free on this node (rank 0's node hosts the rendezvous)."""
        return free_port(ip)

    def start(self, setup: RankSetup) -> WorkerReady | WorkerError:
        """Join the process group and load this rank's shard."""
        self.rank, self.output_rank = setup.rank, setup.config.parallel.output_rank
        self.config = setup.config
        try:
            share_cores(setup.platform, setup.ranks_on_node, setup.num_threads)
            init_process_group(setup.platform, setup.rank, setup.world_size, setup.init_method)
            # Ray makes only this actor's accelerator visible to it: its device is index 0 there
            # (a host device has no index).
            self.worker = Worker(setup.config, setup.platform, setup.eos_token_id, setup.rank, 0)
            return self.worker.ready()
        except BaseException as e:  # reported, never raised: the executor names the rank and stops every actor
            return self._error(e)

    def handle(self, msg: Any) -> Any:
        """One message; the reply, None (a step's result on a rank other than the output rank), or a `WorkerError`."""
        if isinstance(msg, Shutdown):
            destroy_process_group_quietly()
            return None
        try:
            if self.worker is None:
                raise RuntimeError(f"rank {self.rank} has no model loaded (its start failed)")
            reply = self.worker.handle(msg)
        except BaseException as e:
            return self._error(e)
        if self.config is None:
            return reply
        return step_reply(self.config, self.rank, reply)  # the engine reads one rank's result (and KV reports)

    def _error(self, e: BaseException) -> WorkerError:
        return WorkerError(self.rank, f"{type(e).__name__}: {e}", traceback.format_exc())


def share_cores(platform: type[Platform], ranks_on_node: int, num_threads: int | None) -> None:
    """On a host device (`Platform.host_device`: cpu), the node's cores shared between its ranks (as
    `limit_threads` does for local workers). Explicit: Ray sets OMP_NUM_THREADS to the actor's CPU
    reservation, which says nothing about cores."""
    if not platform.host_device:
        return
    import torch

    torch.set_num_threads(num_threads or max(1, (os.cpu_count() or 1) // ranks_on_node))
