"""Virtual environments for the benchmark's peers, built on demand, never in the project's own.

Each lives in ``$PORTSIDE_BENCH_VENVS/<name>-<version>`` (default ``~/.cache/portside-bench``) and
is marked ready (``.portside-ready``) once its packages installed and its import check passed; a
failed build is retried on the next run and its log kept beside it (``install.log``).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path


class PeerUnavailable(RuntimeError):
    """A peer that cannot be installed or imported here; the message says why."""


def venvs_root() -> Path:
    return Path(os.environ.get("PORTSIDE_BENCH_VENVS", Path.home() / ".cache" / "portside-bench"))


def ensure_venv(name: str, packages: list[str], check: str, *, system_site_packages: bool = False,
                env: dict[str, str] | None = None, drop_broken: tuple[str, ...] = (), timeout_s: float = 3600) -> Path:
    """The python of venv `name` with `packages` installed (pip, with `env` added to the build's
    environment, e.g. llama.cpp's CMAKE_ARGS), once `python -c check` passes; PeerUnavailable if
    it does not. With `system_site_packages` the venv also sees this interpreter's packages
    (torch, gguf and portside for the bandwidth readings the harness shares with cpu.py).
    `drop_broken`: optional modules uninstalled where they do not import (PyPI's torchvision,
    torchaudio and torchcodec are CUDA builds that fail beside torch's CPU build, which only
    download.pytorch.org has the CPU builds of; transformers and vLLM's text models run without them)."""
    root = venvs_root() / name
    python = root / "bin" / "python"
    ready = root / ".portside-ready"
    log = root / "install.log"
    if not ready.exists():
        print(f"building {root} ({' '.join(packages)}); log: {log}", flush=True)
        try:
            if not python.exists():
                venv.EnvBuilder(with_pip=True, system_site_packages=system_site_packages).create(root)
            with open(log, "a") as f:
                subprocess.run([str(python), "-m", "pip", "install", *packages], stdout=f, stderr=subprocess.STDOUT,
                               check=True, timeout=timeout_s, env={**os.environ, **(env or {})})
                for mod in drop_broken:
                    if subprocess.run([str(python), "-c", f"import {mod}"], capture_output=True).returncode:
                        print(f"{mod} does not import beside this torch: uninstalled", file=f, flush=True)
                        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", mod], stdout=f,
                                       stderr=subprocess.STDOUT, check=True)
        except (OSError, subprocess.SubprocessError) as e:
            raise PeerUnavailable(f"could not install {' '.join(packages)} into {root}: {e}; "
                                  f"last lines of {log}: {_tail(log)}") from e
    if system_site_packages:
        _see_this_environment(python)
    probe = subprocess.run([str(python), "-c", check], capture_output=True, text=True, timeout=600)
    if probe.returncode:
        raise PeerUnavailable(f"{' '.join(packages)} installed in {root} but `{check}` failed: "
                              f"{probe.stderr.strip()[-800:]}")
    ready.write_text(probe.stdout)
    return python


def _see_this_environment(python: Path) -> None:
    """Where this interpreter is itself a venv (the project's .venv), `system_site_packages` gives
    the peer venv the base interpreter's packages, not this venv's: a ``.pth`` file in the peer's
    site-packages adds this environment's site-packages (and its .pth files) after its own, so the
    peer's packages win and the harness imports torch, gguf and portside from here."""
    if sys.prefix == sys.base_prefix:
        return
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    pth = Path(out) / "portside-parent-env.pth"
    # an "import" line runs: addsitedir also reads that folder's own .pth files (the editable portside)
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages())
    if not pth.exists() or pth.read_text() != lines:
        pth.write_text(lines)


def run_harness(python: Path, script: Path, args: dict, out: Path, env: dict[str, str] | None = None,
                timeout_s: float = 3600) -> dict:
    """Run `script` with `python` on `args` (JSON file beside `out`); its figures come back in `out`."""
    spec = out.with_suffix(".args.json")
    spec.write_text(json.dumps(args))
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.run([str(python), str(script), str(spec), str(out)], stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})}, timeout=timeout_s)
    if proc.returncode or not out.exists():
        raise RuntimeError(f"{script.name} exited {proc.returncode}; last lines of {log}: {_tail(log)}")
    return json.loads(out.read_text())


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"

