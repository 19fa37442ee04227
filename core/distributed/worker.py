"""The worker side of multi-process tensor parallelism: one process per rank, each holding its
shard of the model in a `ModelRunner`.

Two loops share `Worker`:

- `run_pipe_worker`: a process spawned by `MultiprocExecutor`, talking to the engine over a pipe;
- `main` (``python -m portside.distributed.worker``): a rank > 0 started by a launcher
  (torchrun), receiving rank 0's messages through `broadcast_object_list`.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from portside.config import EngineConfig
from portside.contract import Platform
from portside.distributed.env import destroy_process_group, init_process_group, launcher_env
from portside.distributed.messages import (
    CollectiveRPC,
    InitKVCache,
    KVCacheReady,
    KVStepReport,
    Shutdown,
    WorkerError,
    WorkerReady,
    WorkerSetup,
)
from portside.distributed.rpc import run_rpc
from portside.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Worker:
    """One rank: loads its shard and runs the model runner on the messages it is sent."""

    def __init__(
        self, config: EngineConfig, platform: type[Platform], eos_token_id: int | None, rank: int, local_rank: int
    ) -> None:
        from portside.runner.model_runner import ModelRunner

        self.rank = rank
        # Every rank seeds like the engine does, so unseeded sampling draws the same numbers
        # (rank 0's tokens are broadcast anyway; see ModelRunner.execute_model).
        platform.seed(config.model.seed)
        comm = stage_communicator(platform, config, rank)
        self.runner = ModelRunner(config, platform, comm, eos_token_id, rank=rank, local_rank=local_rank)

    def ready(self) -> WorkerReady:
        r = self.runner
        return WorkerReady(self.rank, r.kv_cache_spec(), r.determine_num_blocks(), r.vocab_size, r.weight_bytes)

    def handle(self, msg: Any) -> Any:
        """Run one message; returns the reply (None when there is none)."""
        if isinstance(msg, SchedulerOutput):
            return self.runner.execute_model(msg)
        if isinstance(msg, InitKVCache):
            self.runner.initialize_kv_cache(msg.num_blocks)
            return KVCacheReady(self.rank)
        if isinstance(msg, CollectiveRPC):  # its errors are replies: the worker goes on
            return run_rpc(self.runner, self.rank, msg)
        raise TypeError(f"worker rank {self.rank} got an unknown message {type(msg).__name__}")


def stage_communicator(platform: type[Platform], config: EngineConfig, rank: int) -> Any:
    """This rank's tensor-parallel group: the whole world without pipeline parallelism; with it,
    its stage's TP ranks (every rank creates every stage's group, in the same order, as
    torch.distributed requires)."""
    par = config.parallel
    if par.pipeline_parallel_size == 1:
        return platform.communicator()
    import torch.distributed as dist

    tp = par.tensor_parallel_size
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(par.pipeline_parallel_size)]
    return platform.communicator(groups[rank // tp])


def limit_threads(platform: type[Platform], ranks_on_this_machine: int) -> None:
    """On a host device (`Platform.host_device`: cpu), share the machine's cores between the ranks
    instead of oversubscribing them (unless OMP_NUM_THREADS already says how many)."""
    if not platform.host_device or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_this_machine))


# --------------------------------------------------------------------------------------------
# Spawned by MultiprocExecutor: one pipe to the engine
# --------------------------------------------------------------------------------------------


def run_pipe_worker(
    rank: int,
    world_size: int,
    init_method: str,
    config: EngineConfig,
    platform: type[Platform],
    eos_token_id: int | None,
    conn: Connection,
    environ: dict[str, str],
) -> None:
    """Process entry point. Replies: `WorkerReady`, `KVCacheReady`, and per step what
    `step_reply` says; any exception is sent as a `WorkerError`, then the
    process exits with status 1. The engine stops it with `Shutdown` (or by closing the pipe).
    `environ` is the engine's environment when it started the worker: a fork of the fork server
    would otherwise see the server's, from when it started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    name_process(multiprocessing.current_process().name)
    try:
        limit_threads(platform, world_size * config.parallel.data_parallel_size)  # every replica's ranks share the cores
        init_process_group(platform, rank, world_size, init_method)
        worker = Worker(config, platform, eos_token_id, rank, local_rank=rank)
        conn.send(worker.ready())
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the engine is gone
                break
            if isinstance(msg, Shutdown):
                break
            reply = step_reply(config, rank, worker.handle(msg))
            if reply is not None:
                conn.send(reply)
    except BaseException as e:  # report, then die: the engine fails fast on this
        try:
            conn.send(WorkerError(rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except (OSError, EOFError):
            pass
        destroy_process_group_quietly()
        sys.exit(1)
    destroy_process_group_quietly()


def step_reply(config: EngineConfig, rank: int, reply: Any) -> Any:
    """What a rank sends back for a message's `reply`: a step's `ModelRunnerOutput` from the output
    rank (the first rank of the last pipeline stage) only; with a KV connector every other rank
    sends its connector's report (`KVStepReport`); None: nothing."""
    if not isinstance(reply, ModelRunnerOutput) or rank == config.parallel.output_rank:
        return reply
    return KVStepReport(rank, reply.kv_connector_output) if config.kv_transfer is not None else None


def name_process(name: str) -> None:
    """Show `name` (portside-tp0, portside-pp1-tp0, ...) for this process in ps and top, Linux
    only; elsewhere a no-op."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def destroy_process_group_quietly() -> None:
    try:
        destroy_process_group()
    except Exception:  # a peer may already be gone
        pass


# --------------------------------------------------------------------------------------------
# Started by a launcher: rank 0 broadcasts every message over a gloo control group
# --------------------------------------------------------------------------------------------


def control_group() -> Any:
    """A CPU (gloo) group over every rank for object messages; the default group's backend
    (nccl, xla) may not move host objects. Collective: every rank calls it once, in order."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None  # the default group already is one
    return dist.new_group(backend="gloo")


def broadcast_message(msg: Any, group: Any) -> Any:
    """Rank 0 passes `msg`; every rank gets it back."""
    import torch.distributed as dist

    box = [msg]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def run_launched_worker(platform: type[Platform], rank: int, world_size: int, local_rank: int, init_method: str) -> None:
    """The loop of a rank > 0 in a launcher-started world (rank 0 runs `LaunchedExecutor`)."""
    import torch.distributed as dist

    init_process_group(platform, rank, world_size, init_method)
    group = control_group()
    try:
        setup = broadcast_message(None, group)
        if not isinstance(setup, WorkerSetup):
            raise RuntimeError(f"rank {rank}: expected the engine's setup from rank 0, got {type(setup).__name__}")
        if setup.config.device != platform.name:
            raise RuntimeError(
                f"rank {rank} runs on {platform.name!r} but rank 0's engine runs on {setup.config.device!r}; "
                f"pass --device {setup.config.device}"
            )
        worker = Worker(setup.config, platform, setup.eos_token_id, rank, local_rank)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (worker.ready().num_blocks, worker.runner.weight_bytes), group=group)
        while True:
            msg = broadcast_message(None, group)
            if isinstance(msg, Shutdown):
                break
            reply = worker.handle(msg)
            if isinstance(msg, CollectiveRPC):  # rank 0 gathers every rank's reply
                dist.all_gather_object(gathered, reply, group=group)
            elif isinstance(reply, ModelRunnerOutput) and setup.config.kv_transfer is not None:
                dist.all_gather_object(gathered, reply.kv_connector_output, group=group)  # rank 0 merges them
    finally:
        destroy_process_group_quietly()


def main(argv: list[str] | None = None) -> int:
    """``python -m portside.distributed.worker`` (or ``portside worker``): run as a non-zero rank
    of a launcher-started world; rank 0 runs ``portside serve`` / ``LLM(...)`` with the same
    ``--tensor-parallel-size`` as WORLD_SIZE."""
    parser = argparse.ArgumentParser(prog="portside worker", description=main.__doc__)
    parser.add_argument("--device", default=None, help="the platform rank 0 uses (default: the best available)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    env = launcher_env()
    if env is None or env.world_size < 2:
        print("portside worker: set RANK, WORLD_SIZE (> 1), MASTER_ADDR and MASTER_PORT (torchrun does)", file=sys.stderr)
        return 2
    if env.rank == 0:
        print("portside worker: rank 0 runs the engine (portside serve / LLM), not a worker", file=sys.stderr)
        return 2
    from portside.platform import resolve_platform

    platform = resolve_platform(args.device)
    limit_threads(platform, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    run_launched_worker(platform, env.rank, env.world_size, env.local_rank, env.init_method)
    return 0


if __name__ == "__main__":
    sys.exit(main())
