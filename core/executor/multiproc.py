"""MultiprocExecutor: tensor and pipeline parallelism on one machine, one worker process per rank
(TP x PP of them).

On cpu the workers are forked from multiprocessing's fork server, which imports what every rank
needs (torch, portside's worker and model code, transformers' config classes) once per engine
process: a worker then starts without re-importing all of it (~6 s of CPU a rank on a 2-core
Zen 3). The engine process itself is never forked: its threads and torch's thread pool would
be copied mid-state. See `worker_context` for the choice and its override.

Every rank, rank 0 included, runs in its own worker process; the engine process holds no model
shard and never enters a collective. That keeps the engine's failure handling simple: it only
ever waits on pipes and process sentinels, with timeouts, so a worker that dies (even inside a
collective, where its peers would block) or raises turns into a `RuntimeError` naming the rank
within about a second, never a hang. It also keeps the engine process free of torch.distributed
state (the async server runs the engine in a thread).

Per step the engine pickles ONE `SchedulerOutput` to every rank's pipe and reads the
`ModelRunnerOutput` from `ParallelConfig.output_rank` (rank 0 without pipeline parallelism, else
the first rank of the last stage, which samples; every rank continues from its tokens, which the
runner broadcasts). With a KV connector every other rank also answers each step with its
connector's report (`KVStepReport`), merged into that output (`portside.kv_transfer.ranks`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn, cast

from portside.config import EngineConfig
from portside.contract import Platform
from portside.distributed.env import free_port
from portside.distributed.messages import (
    CollectiveRPC,
    InitKVCache,
    KVCacheReady,
    RPCReply,
    Shutdown,
    WorkerError,
    WorkerReady,
)
from portside.distributed.rpc import rpc_results
from portside.distributed.worker import run_pipe_worker
from portside.executor.workers import GRACE_S, WORKER_TIMEOUT_S, WorkerExecutor, no_reply, protocol_error
from portside.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_POLL_S = 0.5  # how often a wait wakes up to check deadlines


class MultiprocExecutor(WorkerExecutor):
    kind = "tensor-parallel"
    workers = "tensor-parallel workers"

    def __init__(self, config: EngineConfig, platform: type[Platform], eos_token_id: int | None) -> None:
        super().__init__(config)
        world = self.world_size
        ctx = worker_context(platform)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        # Stops the workers when the executor is garbage-collected or at interpreter exit,
        # even if nobody calls shutdown(). It must not reference self.
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        tp = config.parallel.tensor_parallel_size
        environ = dict(os.environ)  # the forks' environment (see run_pipe_worker)
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=run_pipe_worker,
                args=(rank, world, init_method, config, platform, eos_token_id, child, environ),
                name=f"portside-pp{rank // tp}-tp{rank % tp}" if world > tp else f"portside-tp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()  # only the worker holds its end: its exit shows as EOF here
            self._procs.append(proc)
            self._conns.append(parent)
        logger.info("started %d workers (TP %d x PP %d): pids %s", world, tp, world // tp, [p.pid for p in self._procs])
        self._take_ready(self._collect(range(world), WorkerReady, "loading its model shard"))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(InitKVCache(num_blocks))
        self._collect(range(self.world_size), KVCacheReady, "allocating its KV cache")

    def submit(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Send a step to every rank now; the returned call waits for its output. Pipeline
        parallelism keeps several in flight: the output rank answers them in order, so the calls
        must be made in the order of the submits."""
        self._broadcast(scheduler_output)
        ranks, kinds = self._step_replies
        return lambda: self._merge_kv(self._collect(ranks, kinds, "running a step"), "running a step")

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        self._broadcast(CollectiveRPC(method, tuple(args), dict(kwargs or {})))
        return rpc_results(self._collect(range(self.world_size), RPCReply, "running collective_rpc"))

    def check_health(self) -> None:
        """RuntimeError when a worker process exited while the engine was idle (a step would
        fail); the other workers are stopped."""
        pids = self.pids
        if not pids:
            return
        alive = {p.pid for p in multiprocessing.active_children()}  # polls (reaps) exited children
        dead = [pid for pid in pids if pid not in alive]
        if dead:
            self.shutdown()
            raise RuntimeError(f"worker process(es) {dead} of {len(pids)} exited while the engine was idle; "
                               "the other workers were stopped")

    def _stop_ranks(self, graceful: bool) -> None:
        """Shutdown to every worker, then terminate, then kill (see `_stop_workers`)."""
        self._finalizer()

    # ---- plumbing -----------------------------------------------------------------------------

    def _broadcast(self, msg: Any) -> None:
        self._check()
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(msg)
            except (OSError, EOFError) as e:  # its pipe closed: it died
                self._fail(f"rank {rank} could not be sent a message ({type(e).__name__}: {e})")

    def _collect(self, ranks: Any, kind: type | tuple[type, ...], doing: str) -> dict[int, Any]:
        """One `kind` reply from each of `ranks`, watching every worker: a `WorkerError` or an
        exit from any rank, or no reply within WORKER_TIMEOUT_S, raises RuntimeError."""
        self._check()
        try:
            return self._collect_replies(ranks, kind, doing)
        except (KeyboardInterrupt, SystemExit):
            self._interrupted(doing)
            raise

    def _collect_replies(self, ranks: Any, kind: type | tuple[type, ...], doing: str) -> dict[int, Any]:
        want = set(ranks)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        index = {id(c): r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while want - got.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(no_reply(want - got.keys(), doing))
            # only the pipes of ranks still to answer: a rank that answered may already have sent
            # its reply to a later step (pipeline parallelism keeps several in flight)
            waiting = [self._conns[r] for r in sorted(want - got.keys())]
            ready = wait([*waiting, *sentinels], timeout=min(_POLL_S, left))
            for obj in ready:
                if isinstance(obj, int):  # a sentinel: that process exited
                    rank = sentinels[obj]
                    if rank not in want or rank in got or not self._conns[rank].poll():  # report the death
                        self._fail(f"rank {rank} exited while {doing}")
                    continue
                rank = index[id(obj)]
                try:
                    msg = cast(Connection, obj).recv()  # not an int: one of self._conns
                except (EOFError, OSError):
                    self._fail(f"rank {rank} closed its pipe without a reply while {doing}")
                if isinstance(msg, WorkerError):
                    self._fail(None, first_error=msg)
                if rank not in want or not isinstance(msg, kind):
                    self._fail(protocol_error(rank, msg, doing))
                got[rank] = msg
        return got

    def _fail(self, reason: str | None, first_error: WorkerError | None = None) -> NoReturn:
        """Name the failed rank and its cause, stop every worker, and raise."""
        errors = [first_error] if first_error else []
        # Give the other ranks a moment to exit or report: a rank killed inside a collective
        # makes its peers raise too, and the killed one is the cause.
        grace_end = time.monotonic() + GRACE_S
        while any(p.exitcode is None for p in self._procs) and time.monotonic() < grace_end:
            wait([p.sentinel for p in self._procs if p.exitcode is None], timeout=grace_end - time.monotonic())
        for conn in self._conns:
            try:
                while conn.poll():
                    msg = conn.recv()
                    if isinstance(msg, WorkerError) and msg not in errors:
                        errors.append(msg)
            except (EOFError, OSError):
                pass
        reported = {e.rank for e in errors}
        dead = [(r, p) for r, p in enumerate(self._procs) if p.exitcode is not None and r not in reported]
        causes = [f"rank {r} (pid {p.pid}) {_describe_exit(p.exitcode)}" for r, p in dead]
        causes += [f"rank {e.rank} raised {e.error}" for e in errors]
        if not causes and reason is not None:
            causes.append(reason)
        self._raise("tensor-parallel worker failed", causes, errors[0] if errors else None)


# What every rank imports before it loads a model. No platform module: one could touch its device
# on import, and the forks would inherit that.
_PRELOAD = ["portside.distributed.worker", "portside.model.registry", "transformers.activations",
            "transformers.models.auto.configuration_auto"]
# Variables that the libraries the preloaded modules load read when imported: a fork server
# started before one of them changed would give its forks the old value. (portside's own modules
# read PORTSIDE_* only when they use them.)
_READ_ON_IMPORT = ("TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "PYTHON", "HF_", "TRANSFORMERS_",
                   "TOKENIZERS_")
_forkserver_env: dict[str, str] | None = None  # the environment the fork server started with


def worker_context(platform: type[Platform]) -> SpawnContext | ForkServerContext:
    """How the workers start: `PORTSIDE_WORKER_MULTIPROC_METHOD` (forkserver or spawn), by default
    the platform's `worker_start_method` (the fork server on cpu, spawn on accelerators: forking
    from a server is unverified with their runtimes). The fork server starts on first use with `_PRELOAD` imported. A worker takes
    the engine's environment as it is when the worker starts (`run_pipe_worker`), but what was
    read on import stays as the fork server saw it: once a `_READ_ON_IMPORT` variable changed,
    the workers are spawned."""
    global _forkserver_env
    method = os.environ.get("PORTSIDE_WORKER_MULTIPROC_METHOD", platform.start_method())
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"PORTSIDE_WORKER_MULTIPROC_METHOD={method!r}: use forkserver or spawn")
    if method == "spawn":
        return multiprocessing.get_context("spawn")
    env = dict(os.environ)
    if _forkserver_env is None:
        multiprocessing.set_forkserver_preload(_PRELOAD)
        _forkserver_env = env
    elif changed := sorted(k for k in env.keys() | _forkserver_env.keys()
                           if k.startswith(_READ_ON_IMPORT) and env.get(k) != _forkserver_env.get(k)):  # fmt: skip
        logger.info("%s changed since the fork server started: spawning the workers", ", ".join(changed))
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("forkserver")


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _stop_workers(procs: list[BaseProcess], conns: list[Connection], timeout: float = 5.0) -> None:
    """Ask every worker to stop, then terminate and kill stragglers; leaves no process behind."""
    for conn in conns:
        try:
            conn.send(Shutdown())
        except (OSError, EOFError, ValueError):
            pass
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in conns:
        conn.close()
