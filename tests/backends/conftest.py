"""Backend tests: without a GPU, Triton kernels run in the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any `@triton.jit` decorator runs, i.e. before a kernel
module is imported; pytest imports this conftest before the test modules of this folder.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()

if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where kernel tests put their tensors: the GPU when there is one, else CPU (interpreter)."""
    return torch.device("cuda") if HAS_GPU else torch.device("cpu")


@pytest.fixture(scope="session")
def triton_interp_site(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """The `triton-interp` test device (plugins/triton_interp) pip-installed into a private
    folder: returned for sys.path / PYTHONPATH, so the shared environment is left as it was.
    None when the package is installed in this environment already (use that one)."""
    import importlib.metadata
    import importlib.util
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    try:
        importlib.metadata.distribution("portside-triton-interp")
        return None
    except importlib.metadata.PackageNotFoundError:
        pass
    root = tmp_path_factory.mktemp("triton_interp")
    site = root / "site"
    plugin = root / "src"  # a copy: the build writes build/ and *.egg-info next to the sources
    shutil.copytree(Path(__file__).resolve().parents[2] / "plugins" / "triton_interp", plugin,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    # Build with this environment's setuptools when it has one (no download); else pip's isolated build.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps", *isolation,
         "--target", str(site), str(plugin)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"installing plugins/triton_interp failed:\n{proc.stderr[-3000:]}"
    return str(site)


@pytest.fixture(scope="module")
def triton_plugin(triton_interp_site: str | None):
    """The `triton-interp` plugin discoverable in this process for a module's tests: its folder
    on sys.path and stevedore's per-namespace entry-point cache emptied (a test that discovered
    platforms earlier in this worker would otherwise hide the new entry point)."""
    from stevedore import ExtensionManager

    mp = pytest.MonkeyPatch()
    if triton_interp_site is not None:
        mp.syspath_prepend(triton_interp_site)
    mp.delenv("PORTSIDE_PLUGINS", raising=False)
    mp.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
    yield
    mp.undo()
