"""cpu collectives: torch.distributed over gloo, or oneCCL when its bindings are installed.

oneCCL (``oneccl_bindings_for_pytorch``, backend name ``"ccl"``) is faster than gloo for
all-reduce across sockets or hosts; importing the bindings registers the backend with
torch.distributed. ``PORTSIDE_CPU_DIST=gloo|ccl`` overrides the choice.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

CCL_MODULE = "oneccl_bindings_for_pytorch"


def ccl_installed() -> bool:
    """Whether the oneCCL bindings are installed (a file lookup; imports nothing)."""
    try:
        return importlib.util.find_spec(CCL_MODULE) is not None
    except (ImportError, ValueError):
        return False


def select_dist_backend(env: dict[str, str] | None = None) -> str:
    """"ccl" when the oneCCL bindings are installed and import (registering the backend), else
    "gloo". `PORTSIDE_CPU_DIST` forces one; forcing "ccl" without the bindings raises."""
    env = os.environ if env is None else env
    forced = env.get("PORTSIDE_CPU_DIST", "").strip().lower()
    if forced not in ("", "gloo", "ccl"):
        raise ValueError(f"PORTSIDE_CPU_DIST={forced!r}: use 'gloo' or 'ccl'")
    if forced == "gloo" or (not forced and not ccl_installed()):
        return "gloo"
    try:
        importlib.import_module(CCL_MODULE)
    except Exception as e:
        if forced == "ccl":
            raise RuntimeError(f"PORTSIDE_CPU_DIST=ccl but {CCL_MODULE} does not import: {e}") from e
        logger.warning("%s is installed but does not import (%s); using gloo", CCL_MODULE, e)
        return "gloo"
    return "ccl"
