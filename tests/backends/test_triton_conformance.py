"""The conformance kit against the cuda/rocm Triton kernels, on CPU tensors under the interpreter.

The device is `triton-interp` (plugins/triton_interp: CPU tensors, `TritonAttentionBackend`,
eager graphs, gloo), pip-installed into a private folder by the `triton_interp_site` fixture and
run exactly as a plugin author runs the kit: ``python -m portside.testing.conformance --device
triton-interp`` in a subprocess. Every check must pass and none may skip: attention against the
reference over the standard shape set, KV round trip, graph vs eager, the communicator at world
sizes 1 and 2, end-to-end parity with transformers, and the probe.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.slow,  # the triton leg runs it (-m "triton or xgrammar"); minutes under the interpreter
    pytest.mark.triton,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton on CPU tensors: interpreter only"),
]


def test_triton_kernels_pass_the_conformance_kit(triton_interp_site: str | None) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    env.pop("PORTSIDE_PLUGINS", None)
    if triton_interp_site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_interp_site, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "portside.testing.conformance", "--device", "triton-interp", "-q", "-p", "no:cacheprovider",
         "-n", str(min(4, os.cpu_count() or 1))],  # this leg's longest case by far: spread over the cores
        capture_output=True, text=True, timeout=1800, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, f"conformance kit failed for triton-interp:\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, proc.stdout[-8000:]  # every check runs here
