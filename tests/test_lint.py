"""ruff and mypy over the tree, as the workflow's lint and typecheck jobs run them (so .ci/run catches them too)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        pytest.skip("ruff is not installed (pip install 'portside[test]')")
    proc = subprocess.run([exe, "check", "core", "backends", "tests", "plugins", "ci"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_is_clean(tmp_path: Path):
    """mypy over core/ as the package it is installed as (`portside`), as the typecheck job runs it."""
    pytest.importorskip("mypy", reason="mypy is not installed (pip install 'portside[test]')")
    (tmp_path / "portside").symlink_to(ROOT / "core", target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", "portside"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
