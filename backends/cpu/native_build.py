"""How the cpu backend's native code is built: with the system compiler, on first use, into a cache.

A library is compiled into ``$XDG_CACHE_HOME/portside/kernels/<key>/`` (default ``~/.cache``),
where the key hashes the sources, the flags, the compiler's version, this CPU's feature flags and
the torch version, so a changed kernel, a new compiler or another machine sharing the home
directory never loads a stale build. The .so is written to a temporary name and renamed into
place, so a concurrent process sees either no file or a whole one; a lock file per library makes
processes sharing the cache (test workers, servers started together) wait for one build. Several
sources compile in parallel, one compiler process per core, then link. A build says so on stderr
with its expected and actual time. What is built is `native_ops`' one library.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """The kernels could not be built or loaded; the message says why."""


def compiler() -> list[str]:
    """The C++ compiler command: ``$CXX`` (may carry flags), else ``c++``, else ``g++``."""
    cmd = os.environ.get("CXX")
    if cmd:
        return shlex.split(cmd)
    for name in ("c++", "g++"):
        found = shutil.which(name)
        if found:
            return [found]
    raise NativeBuildError("no C++ compiler found ($CXX unset, neither c++ nor g++ on PATH)")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"compiler {cmd[0]!r} could not run: {type(e).__name__}: {e}") from e


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _cpu_flags() -> str:
    from portside.backends.cpu.platform import cpu_flags

    return " ".join(sorted(cpu_flags()))


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "portside" / "kernels"


def build_key(cc: list[str], sources: tuple[Path, ...], flags: tuple[str, ...], extra: str = "") -> str:
    """sha256 of what a .so depends on: its sources (and the files they include), flags, compiler
    version, CPU (and `extra`, e.g. the torch version a C++ operator library is built against)."""
    version = _run([*cc, "--version"], timeout=30)
    if version.returncode != 0:
        raise NativeBuildError(f"compiler {shlex.join(cc)!r} failed on --version:\n{_tail(version.stderr)}")
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in sources), " ".join([*cc, *flags]).encode(), version.stdout.encode(),
                 platform.machine().encode(), _cpu_flags().encode(), extra.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:32]


_BUILD_LOCKS: dict[Path, threading.Lock] = {}  # per target: a background prebuild and the first use never
_LOCKS_LOCK = threading.Lock()  # compile one library twice, and two libraries still build side by side
SECONDS_PER_SOURCE = {".c": 2, ".cpp": 15}  # rough one-core compile times (torch headers: 5-25 s a .cpp), for the notice


def _notice(msg: str) -> None:
    print(f"portside: {msg}", file=sys.stderr, flush=True)


def build(cc: list[str], sources: tuple[Path, ...], flags: tuple[str, ...], libs: tuple[str, ...], target: Path) -> bool:
    """Compile `sources` into the shared library `target` unless it is already there; True when
    this call compiled it. `libs` go after the sources, as the linker wants. Several sources
    compile in parallel (one compiler process per core), then link. A build says so on stderr,
    with its expected and its actual time (a first run's only long silence otherwise)."""
    if target.exists():
        return False
    with _LOCKS_LOCK:
        lock = _BUILD_LOCKS.setdefault(target, threading.Lock())
    target.parent.mkdir(parents=True, exist_ok=True)
    with lock, _process_lock(target):
        if target.exists():  # built by the thread or process that held the lock
            return False
        names = " ".join(src.name for src in sources)
        jobs = max(1, min(len(sources), _cores()))
        estimate = round(sum(SECONDS_PER_SOURCE.get(src.suffix, 10) for src in sources) / jobs) + 1
        logger.info("building native cpu kernels: %s -> %s (%d jobs)", names, target, jobs)
        what = sources[0].name if len(sources) == 1 else f"{len(sources)} sources, {jobs} at a time"
        _notice(f"building native cpu kernels ({what}; first run, ~{estimate} s) ...")
        start = time.monotonic()
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as work:
            tmp = os.path.join(work, target.name)
            if len(sources) > 1 and jobs > 1:
                objects = _compile_objects(cc, sources, flags, Path(work), jobs)
                _checked(_run([*cc, *flags, "-o", tmp, *objects, *libs], timeout=300), cc, names)
            else:
                _checked(_run([*cc, *flags, "-o", tmp, *map(str, sources), *libs], timeout=300), cc, names)
            os.replace(tmp, target)  # atomic: other processes see no file or a whole one
        _notice(f"native cpu kernels built in {time.monotonic() - start:.1f} s ({target.parent})")
    return True


@contextlib.contextmanager
def _process_lock(target: Path) -> Iterator[None]:
    """An exclusive lock on `target`'s lock file: processes sharing the cache (test workers, several
    servers started at once) wait for one build instead of each compiling the same library."""
    with open(target.with_name(target.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _compile_objects(cc: list[str], sources: tuple[Path, ...], flags: tuple[str, ...], work: Path, jobs: int) -> list[str]:
    """Each source compiled to an object file in `work`, `jobs` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    objects = [str(work / f"{i}-{src.stem}.o") for i, src in enumerate(sources)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda so: _run([*cc, *flags, "-c", "-o", so[1], str(so[0])], timeout=300),
                                zip(sources, objects)))
    for src, res in zip(sources, results):
        _checked(res, cc, src.name)
    return objects


def _checked(res: subprocess.CompletedProcess[str], cc: list[str], names: str) -> None:
    if res.returncode != 0:
        raise NativeBuildError(f"building {names} with {shlex.join(cc)} failed "
                               f"(exit {res.returncode}):\n{_tail(res.stderr or res.stdout)}")
