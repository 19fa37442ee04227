"""The conformance kit against `--device tpu` on torch-xla's PJRT CPU device (the xla leg), run
exactly as a plugin author runs it; most of the xla leg's time."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

needs_xla = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                               reason="torch_xla is not importable (the xla leg installs it: ci/legs/xla.sh)")  # fmt: skip

# The checks the kit may skip here: the tpu platform on PJRT CPU has one device (tensor
# parallelism on tpu needs one process per chip, not wired up yet), and it declares LoRA
# unsupported (`supports_lora = False`: the engine refuses enable_lora there).
EXPECTED_KIT_SKIPS = ("world size 2 needs two tpu devices", "the tpu platform declares supports_lora = False")


@needs_xla
def test_tpu_platform_passes_the_conformance_kit():
    """The kit against `--device tpu` on PJRT CPU, run exactly as a plugin author runs it."""
    env = dict(os.environ, PJRT_DEVICE="CPU", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "portside.testing.conformance", "--device", "tpu", "-q", "-rs", "-p", "no:cacheprovider",
         "-n", str(min(4, os.cpu_count() or 1))],  # most of this leg's time: spread over the cores
        capture_output=True, text=True, timeout=1800, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, f"conformance kit failed for tpu:\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-8000:]
    skips = [ln for ln in proc.stdout.splitlines() if ln.startswith("SKIPPED")]
    unexpected = [ln for ln in skips if not any(reason in ln for reason in EXPECTED_KIT_SKIPS)]
    assert not unexpected and len(skips) == len(EXPECTED_KIT_SKIPS), "\n".join(skips)
