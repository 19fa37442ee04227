"""Run one plugin's register() and probe in a fresh interpreter and report what they did.

    python -m portside.testing.conformance.probe_worker ENTRY_POINT_NAME

Prints one JSON object: what register() returned, the platform's name, the probe's result and
timing, the heavy modules each phase imported, and whether a device runtime got initialised.
Only the standard library is imported before register() runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
import time

GROUP = "portside.platforms"
# Vendor runtimes and kernel compilers: none may be imported by register() or is_available().
HEAVY_MODULES = (
    "torch_xla", "triton", "intel_extension_for_pytorch", "openvino", "torch_npu", "habana_frameworks",
    "jax", "tensorflow", "deepspeed", "cupy", "pynvml", "tensorrt",
)  # fmt: skip


def _heavy(before: set[str]) -> list[str]:
    return sorted(m for m in set(sys.modules) - before if m.split(".")[0] in HEAVY_MODULES)


def _runtimes_initialised() -> list[str]:
    """Device runtimes torch reports as initialised in this process."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    out = []
    for name in ("cuda", "xpu", "mps", "mtia"):
        mod = getattr(torch, name, None)
        check = getattr(mod, "is_initialized", None)
        try:
            if check is not None and check():
                out.append(f"torch.{name}")
        except Exception:
            pass
    return out


def probe(entry_point: str) -> dict:
    report: dict = {"entry_point": entry_point}
    eps = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == entry_point]
    if not eps:
        return {**report, "error": f"no entry point {entry_point!r} in group {GROUP}"}
    before = set(sys.modules)
    register = eps[0].load()
    t = time.perf_counter()
    target = register()
    report["register_s"] = time.perf_counter() - t
    report["register_returned"] = repr(target)
    report["register_heavy"] = _heavy(before)
    report["register_runtimes"] = _runtimes_initialised()
    if target is None:
        return report
    if not isinstance(target, str) or ":" not in target:
        return {**report, "error": f"register() returned {target!r}; expected 'module:PlatformClass' or None"}
    module, _, attr = target.partition(":")
    before = set(sys.modules)
    cls = getattr(importlib.import_module(module), attr)
    report["import_heavy"] = _heavy(before)
    from portside.contract import Availability, Platform

    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        return {**report, "error": f"{target} is {cls!r}, not a portside.contract.Platform subclass"}
    platform_cls: type[Platform] = cls
    report["name"] = getattr(cls, "name", None)
    before = set(sys.modules)
    t = time.perf_counter()
    first = platform_cls.is_available()
    report["probe_s"] = time.perf_counter() - t
    second = platform_cls.is_available()
    report["probe_heavy"] = _heavy(before)
    report["probe_runtimes"] = _runtimes_initialised()
    report["probe_type"] = type(first).__name__
    if isinstance(first, Availability):
        report["available"] = first.available
        report["reason"] = first.reason
        report["stable"] = first == second
    return report


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])))
