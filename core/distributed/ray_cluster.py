"""Ray for the Ray executor: importing it with a clear error, joining (or starting) a cluster, and
reserving one placement-group bundle per rank."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from portside.backend_api import Platform

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


def connect(ray: Any, world_size: int) -> bool:
    """Use the Ray this process already joined, else the cluster RAY_ADDRESS names, else the one
    this machine joined with `ray start`, else start a one-node Ray here. Returns whether this
    call initialised Ray (then its caller calls `ray.shutdown()`, which leaves a cluster it joined
    running)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or node_cluster(ray)
    if address:
        logger.info("joining the Ray cluster at %s", address)
        # No address argument: Ray then reads RAY_ADDRESS or its record itself, and turns on
        # token authentication when this machine holds the cluster's token (~/.ray/auth_token).
        ray.init(log_to_driver=False)
        return True
    # "local": never join a cluster someone else started on this machine (plain ray.init() would).
    # A CPU per rank at least: ranks may share cores, as local worker processes do.
    logger.info("starting a one-node Ray (set RAY_ADDRESS to use a cluster)")
    ray.init(address="local", include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             num_cpus=max(os.cpu_count() or 1, world_size))
    return True


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
    """The Ray resource one rank reserves: a CPU, a GPU (cuda, rocm and other accelerators) or a TPU."""
    return {"cpu": "CPU", "xla": "TPU"}.get(platform.device_type, "GPU")


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
