"""Ray for the Ray executor: importing it with a clear error, joining (or starting) a cluster, and
reserving one placement-group bundle per rank."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import queue
import signal
import threading
from typing import Any

from portside.contract import Platform

logger = logging.getLogger(__name__)

RAY_MISSING = "distributed_executor_backend ray needs Ray, which is not installed: pip install 'portside[ray]'"
# Longest wait for the cluster to grant the placement group (resources busy with other jobs).
PG_TIMEOUT_S = float(os.environ.get("PORTSIDE_RAY_PG_TIMEOUT", "120"))
# Sent to every actor (the engine's values win over a node's): how torch.distributed picks its
# network interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, TP_SOCKET_IFNAME, ...), portside's
# own settings, and the engine's thread count.
_FORWARDED_SUFFIXES = ("_SOCKET_IFNAME",)
_FORWARDED_PREFIXES = ("PORTSIDE_",)
_FORWARDED = ("OMP_NUM_THREADS",)


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ValueError(f"{RAY_MISSING} ({e})") from e
    return ray


# Executors sharing the Ray connection `connect` opened (data-parallel replicas start side by
# side, in threads); 0 when it opened none (Ray is then its caller's, left alone).
_lock = threading.Lock()
_users = 0


def connect(ray: Any, num_ranks: int) -> bool:
    """Use the Ray this process already joined, else the cluster RAY_ADDRESS names, else the one
    this machine joined with `ray start`, else start a one-node Ray here with a CPU for each of
    `num_ranks` at least. Returns whether the caller shares a connection opened here: then it
    calls `disconnect` when done."""
    global _users
    with _lock:
        if ray.is_initialized():
            if _users:
                _users += 1
            return _users > 0
        address = os.environ.get("RAY_ADDRESS") or node_cluster(ray)
        if address:
            logger.info("joining the Ray cluster at %s", address)
            try:
                # No address argument: Ray then reads RAY_ADDRESS or its record itself, and turns on
                # token authentication when this machine holds the cluster's token (~/.ray/auth_token).
                ray.init(log_to_driver=False)
            except ConnectionError as e:
                raise ValueError(
                    f"could not join the Ray cluster at {address} ({e}): is it running (`ray status`), does this "
                    "machine hold its token (~/.ray/auth_token), and is RAY_ADDRESS right?"
                ) from e
        else:
            # "local": never join a cluster someone else started here (plain ray.init() would);
            # ranks may share cores, as local worker processes do.
            logger.info("starting a one-node Ray (set RAY_ADDRESS to use a cluster)")
            start = functools.partial(ray.init, address="local", include_dashboard=False, log_to_driver=False,
                                      _node_ip_address="127.0.0.1", num_cpus=max(os.cpu_count() or 1, num_ranks))
            if threading.current_thread() is threading.main_thread():
                start()
            else:  # Ray's processes die with the thread that starts them: not a short-lived one
                _on_lasting_thread(start)
        _users = 1
        return True


_lasting: queue.Queue[Any] | None = None


def _on_lasting_thread(fn: Any) -> Any:
    """`fn()` on a daemon thread that lives as long as the process. Ray starts its processes with
    Linux's parent-death signal, which fires when the starting *thread* ends: started from a
    pool thread (data-parallel replicas start side by side), Ray would be killed under us."""
    global _lasting
    if _lasting is None:
        _lasting = queue.Queue()
        threading.Thread(target=_serve_forever, args=(_lasting,), name="portside-ray-owner", daemon=True).start()
    done: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
    _lasting.put((fn, done))
    ok, value = done.get()
    if not ok:
        raise value
    return value


def _serve_forever(tasks: queue.Queue[Any]) -> None:
    while True:
        fn, done = tasks.get()
        try:
            done.put((True, fn()))
        except BaseException as e:
            done.put((False, e))


def disconnect(ray: Any) -> None:
    """One user of `connect`'s connection is done; the last calls `ray.shutdown()` (which stops a
    Ray started here and leaves a joined cluster running), from the main thread only: Ray's
    shutdown leaves SIGTERM and SIGINT at their defaults underneath Python's handlers, which only
    the main thread may install again. Elsewhere Ray's own exit hook disconnects."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users or threading.current_thread() is not threading.main_thread():
            return
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        ray.shutdown()
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def node_cluster(ray: Any) -> str | None:
    """The address of the cluster `ray start` joined this machine to (Ray records it under its
    temporary directory, $RAY_TMPDIR or /tmp, until `ray stop`), if any. Unlike
    `ray.init("auto")`, never any Ray process that merely runs on this machine."""
    try:
        return ray._private.utils.read_ray_address() or None
    except Exception as e:  # a Ray without that record: RAY_ADDRESS still works
        logger.debug("no record of `ray start` on this node: %s", e)
        return None


def bundle_resource(platform: type[Platform]) -> str:
    """The Ray resource one rank reserves (`Platform.ray_resource`): a CPU, a GPU (cuda, rocm and
    other accelerators), a TPU, or a plugin's own."""
    return platform.ray_resource_name()


def reserve(ray: Any, world_size: int, resource: str, timeout_s: float = PG_TIMEOUT_S) -> Any:
    """A placement group of `world_size` bundles of one `resource`, packed onto as few nodes as fit."""
    have = ray.cluster_resources().get(resource, 0)
    if have < world_size:
        raise ValueError(
            f"the Ray cluster has {have:g} {resource} but {world_size} ranks (tensor x pipeline parallel size) need one "
            f"each; add nodes (`ray start --address HEAD:6379` on each) or lower -tp / -pp (see `ray status`)"
        )
    pg = ray.util.placement_group([{resource: 1}] * world_size, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not reserve {world_size} x {{{resource!r}: 1}} within {timeout_s:.0f} s: other jobs hold them "
            "(see `ray status`); raise PORTSIDE_RAY_PG_TIMEOUT if that is expected"
        )
    return pg


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment variables every actor gets (see `_FORWARDED*`)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items()
            if k in _FORWARDED or k.startswith(_FORWARDED_PREFIXES) or k.endswith(_FORWARDED_SUFFIXES)}
