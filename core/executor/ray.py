"""RayExecutor: the ranks of one engine replica (TP x PP) as Ray actors, on one node or many.

Like `MultiprocExecutor`, every rank runs outside the engine process, in a `RayWorker` actor that
wraps the same `Worker` and handles the same messages; the engine holds no shard and never enters
a collective. The actors sit in one placement group (a bundle of one CPU, GPU or TPU per rank,
packed onto as few nodes as fit). Ranks are numbered node by node, the engine's node first, so a
tensor-parallel group stays on one node when it fits; the torch.distributed rendezvous is on rank
0's node.

Per step the engine sends the `SchedulerOutput` to every actor and waits for all of them, reading
the `ModelRunnerOutput` of `ParallelConfig.output_rank` (with a KV connector, merged with every
rank's connector report: `portside.kv_transfer.ranks`). It only ever waits in `ray.wait` with a
timeout: an actor whose process dies (or whose node is lost) fails its pending call, a rank that
raises replies with a `WorkerError`, and either becomes a `RuntimeError` naming the rank, its node
and the cause; then every actor is killed and the placement group removed.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from portside.config import EngineConfig
from portside.contract import Platform
from portside.distributed.messages import (
    CollectiveRPC,
    InitKVCache,
    KVCacheReady,
    RPCReply,
    Shutdown,
    WorkerError,
    WorkerReady,
)
from portside.distributed.ray_cluster import bundle_resource, connect, disconnect, forwarded_env, import_ray, reserve
from portside.distributed.ray_worker import RankPlace, RankSetup, RayWorker
from portside.distributed.rpc import rpc_results
from portside.executor.workers import GRACE_S, WORKER_TIMEOUT_S, WorkerExecutor, no_reply, protocol_error
from portside.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # how often a wait wakes up to check its deadline
_HEALTH_S = 2.0  # check_health: how long an idle actor may take to answer a ping
_STOP_S = 5.0  # shutdown: how long the actors get to leave their process group before they are killed


class RayExecutor(WorkerExecutor):
    kind = "Ray"
    workers = "Ray worker actors"

    def __init__(self, config: EngineConfig, platform: type[Platform], eos_token_id: int | None) -> None:
        self._ray = ray = import_ray()
        super().__init__(config)
        self._actors: list[Any] = []  # by rank once placed
        self._places: list[RankPlace] = []  # by rank
        self._state: dict[str, Any] = {"pg": None, "graceful": True}
        self._state["connected"] = connect(ray, self.world_size * config.parallel.data_parallel_size)
        # Kills the actors when the executor is garbage-collected or at exit, even without
        # shutdown(). It must not reference self.
        self._finalizer = weakref.finalize(self, _release, ray, self._actors, self._state)
        try:
            self._take_ready(self._start(config, platform, eos_token_id))
        except BaseException:
            self._stop_ranks(graceful=False)
            raise

    @property
    def places(self) -> list[RankPlace]:
        """Where each rank's actor runs (process id, node), by rank. Not `pids`: those would be
        local processes, and an actor's is on its node."""
        return list(self._places)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._check()
        calls = {r: a.handle.remote(InitKVCache(num_blocks)) for r, a in enumerate(self._actors)}
        self._expect(self._wait(calls, "allocating its KV cache"), KVCacheReady, "allocating its KV cache")

    def submit(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Send a step to every actor now; the returned call waits for all of them and gives the
        output rank's result. Pipeline parallelism keeps several in flight: each actor runs its
        calls in order, so a stage starts the next step while the later stages finish this one."""
        self._check()
        calls = {r: a.handle.remote(scheduler_output) for r, a in enumerate(self._actors)}

        def result() -> ModelRunnerOutput:
            self._check()
            replies = self._wait(calls, "running a step")
            ranks, kinds = self._step_replies
            return self._merge_kv(self._expect({r: replies[r] for r in ranks}, kinds, "running a step"), "running a step")

        return result

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        self._check()
        msg = CollectiveRPC(method, tuple(args), dict(kwargs or {}))
        calls = {r: a.handle.remote(msg) for r, a in enumerate(self._actors)}
        return rpc_results(self._expect(self._wait(calls, "running collective_rpc"), RPCReply, "running collective_rpc"))

    def check_health(self) -> None:
        """While the engine is idle (the async engine asks every second): the error a step would
        raise when an actor has died, found with a ping to each. A ping still unanswered after
        _HEALTH_S passes: a lost node's actors are declared dead by Ray later, and the next step
        reports them."""
        self._check()
        calls = {ref: r for r, ref in enumerate(a.place.remote() for a in self._actors)}
        ready, _ = self._ray.wait(list(calls), num_returns=len(calls), timeout=_HEALTH_S)
        failures: list[WorkerError | _Died] = []
        for ref in ready:
            reply = self._get(ref, calls.pop(ref))
            if isinstance(reply, _Died):
                failures.append(reply)
        if failures:
            self._fail([], failures, calls)

    def _stop_ranks(self, graceful: bool) -> None:
        """Stop every actor (leave the process group unless a rank failed, then kill), remove the
        placement group, and disconnect from Ray if this executor connected."""
        self._state["graceful"] = self._state["graceful"] and graceful
        self._finalizer()

    # ---- start-up -----------------------------------------------------------------------------

    def _start(self, config: EngineConfig, platform: type[Platform], eos_token_id: int | None) -> dict[int, WorkerReady]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, world = self._ray, self.world_size
        resource = bundle_resource(platform)
        pg = self._state["pg"] = reserve(ray, world, resource)
        need = {"CPU": {"num_cpus": 1}, "GPU": {"num_cpus": 0, "num_gpus": 1}}.get(
            resource, {"num_cpus": 0, "resources": {resource: 1}})
        env = forwarded_env()
        actor_class = ray.remote(RayWorker)
        for i in range(world):
            self._actors.append(actor_class.options(
                **need, max_restarts=0, runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i),
            ).remote())  # fmt: skip
        places = self._wait({i: a.place.remote() for i, a in enumerate(self._actors)}, "starting its Ray actor")
        # Ranks node by node, the engine's node first: a tensor-parallel group (consecutive ranks) shares a node.
        here = ray.get_runtime_context().get_node_id()
        order = sorted(range(world), key=lambda i: (places[i].node_id != here, places[i].ip, places[i].node_id, i))
        self._actors[:] = [self._actors[i] for i in order]
        self._places[:] = [places[i] for i in order]
        self._warn_split_groups(config)
        ip = self._places[0].ip
        port = self._wait({0: self._actors[0].free_port.remote(ip)}, "choosing the rendezvous port")[0]
        init_method = f"tcp://{f'[{ip}]' if ':' in ip else ip}:{port}"
        omp = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(omp) if omp.isdigit() and int(omp) > 0 else None
        node_ranks = [[r for r in range(world) if self._places[r].node_id == p.node_id] for p in self._places]
        setups = {
            r: RankSetup(r, world, node_ranks[r].index(r), len(node_ranks[r]), init_method, config, platform,
                         eos_token_id, threads)
            for r in range(world)
        }  # fmt: skip
        logger.info("Ray worker actors (rendezvous %s): %s", init_method,
                    ", ".join(f"rank {r} pid {p.pid} on {p.ip}" for r, p in enumerate(self._places)))
        replies = self._wait({r: a.start.remote(setups[r]) for r, a in enumerate(self._actors)}, "loading its model shard")
        return self._expect(replies, WorkerReady, "loading its model shard")

    def _warn_split_groups(self, config: EngineConfig) -> None:
        tp = config.parallel.tensor_parallel_size
        for first in range(0, self.world_size, tp):
            nodes = {p.ip for p in self._places[first : first + tp]}
            if len(nodes) > 1:
                logger.warning("tensor-parallel ranks %d-%d span nodes %s: every layer's collectives cross the "
                               "network; give each node at least %d devices", first, first + tp - 1, sorted(nodes), tp)

    # ---- plumbing -----------------------------------------------------------------------------

    def _wait(self, calls: dict[int, Any], doing: str) -> dict[int, Any]:
        """Every call's reply, by rank. A dead actor, a `WorkerError`, or no reply within
        WORKER_TIMEOUT_S raises RuntimeError."""
        ray = self._ray
        pending = {ref: rank for rank, ref in calls.items()}
        got: dict[int, Any] = {}
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail([no_reply(pending.values(), doing)], [], pending)
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(_POLL_S, left))
                for ref in ready:
                    rank = pending.pop(ref)
                    reply = self._get(ref, rank)
                    if isinstance(reply, (WorkerError, _Died)):
                        self._fail([], [reply], pending)
                    got[rank] = reply
        except (KeyboardInterrupt, SystemExit):  # calls may still be running: the actors are out of step
            self._interrupted(doing)
            raise
        return got

    def _get(self, ref: Any, rank: int) -> Any:
        """A finished call's reply, or a `_Died` when its actor died or Ray failed it."""
        exceptions = self._ray.exceptions
        try:
            return self._ray.get(ref, timeout=0)
        except exceptions.RayActorError as e:
            return _Died(rank, f"died: {_death_cause(e)}")
        except exceptions.RayError as e:
            return _Died(rank, f"failed in Ray: {_first_line(e)}")

    def _expect(self, replies: dict[int, Any], kind: type | tuple[type, ...], doing: str) -> dict[int, Any]:
        for rank, reply in replies.items():
            if not isinstance(reply, kind):
                self._fail([protocol_error(rank, reply, doing)], [], {})
        return replies

    def _label(self, rank: int) -> str:
        if rank >= len(self._places):
            return f"rank {rank}"
        p = self._places[rank]
        return f"rank {rank} (pid {p.pid} on node {p.ip}, node id {p.node_id[:12]})"

    def _fail(self, reasons: list[str], failures: list[WorkerError | _Died], pending: dict[Any, int]) -> NoReturn:
        """Name the failed rank(s), their node and cause, kill every actor, and raise."""
        # The other ranks get a moment to fail too: one killed inside a collective makes its peers
        # raise, and the dead one is the cause.
        grace_end = time.monotonic() + GRACE_S
        while pending and time.monotonic() < grace_end:
            try:
                ready, _ = self._ray.wait(list(pending), num_returns=1, timeout=grace_end - time.monotonic())
            except Exception:  # Ray itself is failing: report what we have
                break
            for ref in ready:
                reply = self._get(ref, pending.pop(ref))
                if isinstance(reply, (WorkerError, _Died)):
                    failures.append(reply)
        died = [f for f in failures if isinstance(f, _Died)]
        raised = [f for f in failures if isinstance(f, WorkerError)]
        causes = [f"{self._label(f.rank)} {f.cause}" for f in died]
        causes += [f"{self._label(f.rank)} raised {f.error}" for f in raised]
        if causes:  # a lost node's actors are declared dead only after Ray's health checks (seconds)
            causes += [f"{self._label(rank)} gave no reply within {GRACE_S:.0f} s (its process or node may be lost, "
                       "or it waits in a collective)" for rank in sorted(set(pending.values()))]
        # a death is the cause: the peers' errors are its echo, and their tracebacks are not shown
        self._raise("Ray worker failed", causes or reasons, raised[0] if raised and not died else None)


class _Died:
    """A rank whose actor died (or whose call Ray failed)."""

    def __init__(self, rank: int, cause: str) -> None:
        self.rank, self.cause = rank, cause


def _death_cause(e: Exception) -> str:
    """Ray's reason an actor died, without its boilerplate ("Some common causes include ...")."""
    text = " ".join(str(e).split())
    marker = "The actor is dead because "
    if marker in text:
        text = text.split(marker, 1)[1]
    for cut in (" Some common causes", " There are some potential root causes"):
        text = text.split(cut, 1)[0]
    return text[:400]


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def _release(ray: Any, actors: list[Any], state: dict[str, Any]) -> None:
    """Stop the actors (gracefully unless a rank failed), kill them, remove the placement group,
    and disconnect from a Ray that `connect` joined or started for the executor; leaves no actor
    behind."""
    if not ray.is_initialized():  # Ray already shut down (at exit): its actors went with it
        return
    try:
        _stop(ray, actors, state)
    finally:
        if state.pop("connected", False):
            disconnect(ray)


def _stop(ray: Any, actors: list[Any], state: dict[str, Any]) -> None:
    try:
        if state["graceful"] and actors:
            refs = [a.handle.remote(Shutdown()) for a in actors]
            ray.wait(refs, num_returns=len(refs), timeout=_STOP_S)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # already gone
                logger.debug("ray.kill: %s", e)
        if state["pg"] is not None:
            ray.util.remove_placement_group(state["pg"])
            state["pg"] = None
    except Exception as e:
        logger.warning("stopping the Ray worker actors: %s: %s", type(e).__name__, e)
