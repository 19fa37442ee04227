"""The conformance kit against the in-tree cpu backend, run exactly as a plugin author runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the whole kit in a subprocess: CI runs it


def test_cpu_backend_passes_the_conformance_kit() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "portside.testing.conformance", "--device", "cpu", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, f"conformance kit failed for cpu:\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, proc.stdout[-8000:]  # the cpu runs every check
