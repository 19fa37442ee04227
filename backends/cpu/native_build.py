"""How the cpu backend's native code is built: with the system compiler, on first use, into a cache.

A library is compiled into ``$XDG_CACHE_HOME/portside/kernels/<key>/`` (default ``~/.cache``),
where the key hashes the sources, the flags, the compiler's version, this CPU's feature flags and
the torch version, so a changed kernel, a new compiler or another machine sharing the home
directory never loads a stale build. The .so is written to a temporary name and renamed into
place, so a concurrent process sees either no file or a whole one; a lock file per library makes
processes sharing the cache (test workers, servers started together) wait for one build. Several
sources compile in parallel, one compiler process per core, then link. A build says so on stderr
with its expected and actual time. What is built is `native_ops`' one library.

`start_background` runs a build in a detached process at nice 19 instead, so that
an engine answers on its torch paths meanwhile and the build outlives a one-shot command: the
parent takes the build lock and hands it to the child (no second process starts a duplicate), the
child's output goes to ``build.log`` beside the library, and a failed build leaves its reason in
``<library>.failed``, so later starts report it instead of compiling again (a foreground build,
``python -m portside.backends.cpu.native_ops``, tries again).
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
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from portside.backends.cpu.host import cpu_flags

logger = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """The kernels could not be built or loaded; the message says why."""


class NativeBuildTimeout(NativeBuildError):
    """A compiler call ran out of time (a busy machine: worth trying again, unlike a compile error)."""


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
    except subprocess.TimeoutExpired as e:
        raise NativeBuildTimeout(f"compiler {cmd[0]!r} could not run: {type(e).__name__}: {e}") from e
    except OSError as e:
        raise NativeBuildError(f"compiler {cmd[0]!r} could not run: {type(e).__name__}: {e}") from e


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _cpu_flags() -> str:
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


def describe(sources: tuple[Path, ...]) -> tuple[str, int]:
    """(what a build of `sources` compiles, e.g. "11 sources, 2 at a time"; its rough time in
    seconds on an idle machine), for the notices."""
    jobs = max(1, min(len(sources), _cores()))
    estimate = round(sum(SECONDS_PER_SOURCE.get(src.suffix, 10) for src in sources) / jobs) + 1
    return (sources[0].name if len(sources) == 1 else f"{len(sources)} sources, {jobs} at a time"), estimate


def build(cc: list[str], sources: tuple[Path, ...], flags: tuple[str, ...], libs: tuple[str, ...], target: Path,
          timeout: float = 300, lock_fd: int | None = None) -> bool:
    """Compile `sources` into the shared library `target` unless it is already there; True when
    this call compiled it. `libs` go after the sources, as the linker wants. Several sources
    compile in parallel (one compiler process per core), then link, each compiler call within
    `timeout` seconds. A build says so on stderr with its expected and its actual time (a first
    run's only long silence otherwise). `lock_fd`: the build lock, already held (the child of
    `start_background`); closed on return."""
    if target.exists():
        if lock_fd is not None:
            os.close(lock_fd)
        return False
    with _LOCKS_LOCK:
        lock = _BUILD_LOCKS.setdefault(target, threading.Lock())
    target.parent.mkdir(parents=True, exist_ok=True)
    with lock, _process_lock(target, lock_fd):
        if target.exists():  # built by the thread or process that held the lock
            return False
        for stale in target.parent.glob(".build-*"):  # a build killed mid-way (we hold the lock: none runs)
            shutil.rmtree(stale, ignore_errors=True)
        if lock_fd is None:  # a foreground build: a killed background build's log is stale
            (target.parent / "build.log").unlink(missing_ok=True)
        names = " ".join(src.name for src in sources)
        what, estimate = describe(sources)
        jobs = max(1, min(len(sources), _cores()))
        logger.info("building native cpu kernels: %s -> %s (%d jobs)", names, target, jobs)
        _notice(f"building native cpu kernels ({what}; first run, ~{estimate} s) ...")
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as work:
            tmp = os.path.join(work, target.name)
            if len(sources) > 1 and jobs > 1:
                objects = _compile_objects(cc, sources, flags, Path(work), jobs, timeout)
                _checked(_run([*cc, *flags, "-o", tmp, *objects, *libs], timeout=timeout), cc, names)
            else:
                _checked(_run([*cc, *flags, "-o", tmp, *map(str, sources), *libs], timeout=timeout), cc, names)
            os.replace(tmp, target)  # atomic: other processes see no file or a whole one
        _failure_file(target).unlink(missing_ok=True)  # an earlier background build's failure
        _notice(f"native cpu kernels built in {time.monotonic() - start:.1f} s ({target.parent})")
    return True


def _lock_file(target: Path) -> Path:
    return target.with_name(target.name + ".lock")


@contextlib.contextmanager
def _process_lock(target: Path, held_fd: int | None = None) -> Iterator[None]:
    """An exclusive lock on `target`'s lock file: processes sharing the cache (test workers, several
    servers started at once) wait for one build instead of each compiling the same library.
    `held_fd`: a descriptor of that file whose lock this process holds already (inherited)."""
    if held_fd is not None:
        try:
            yield
        finally:
            os.close(held_fd)  # the last descriptor of the locked file: releases the lock
        return
    with open(_lock_file(target), "a") as f:
        if _held_elsewhere(f.fileno()):
            _notice("waiting for the native cpu kernels another process is building ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _held_elsewhere(fd: int) -> bool:
    """Take the exclusive lock on `fd` without waiting; True (and not taken) when another holder has it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def _failure_file(target: Path) -> Path:
    return target.with_name(target.name + ".failed")


def record_failure(target: Path, reason: str) -> None:
    """Leave why a background build of `target` failed, for later starts (`recorded_failure`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.failed.{os.getpid()}")
    tmp.write_text(reason)
    os.replace(tmp, _failure_file(target))


def recorded_failure(target: Path) -> str | None:
    """Why the last background build of `target` failed (None: none did, or one since succeeded)."""
    try:
        return _failure_file(target).read_text().strip() or "no reason recorded"
    except OSError:
        return None


LOCK_FD_ENV = "PORTSIDE_NATIVE_BUILD_LOCK_FD"  # in a background build's child: its inherited build lock


class BackgroundBuild:
    """A build of `target` in another process: the detached child `start_background` started
    (`proc`), or a process that held the build lock already (`proc` None)."""

    def __init__(self, target: Path, proc: subprocess.Popen[bytes] | None, log: Path) -> None:
        self.target, self.proc, self.log = target, proc, log
        self.started = time.monotonic()

    def done(self) -> bool:
        """True once the library is there, False while the build runs; raises `NativeBuildError`
        with the reason when the build ended without it."""
        if self.target.exists():
            return True
        if self.proc is not None:
            if self.proc.poll() is None:
                return False
        else:
            with open(_lock_file(self.target), "a") as f:
                if _held_elsewhere(f.fileno()):
                    return False  # the other process still builds
        if self.target.exists():
            return True
        reason = recorded_failure(self.target)
        if reason is None:
            tail = _tail(self.log.read_text(errors="replace")) if self.proc is not None and self.log.is_file() else ""
            reason = "the background build ended without a library" + (f":\n{tail}" if tail else "")
        raise NativeBuildError(reason)


def start_background(argv: list[str], target: Path) -> BackgroundBuild | None:
    """Build `target` in a detached process, so that this one need not wait: `argv` runs in a
    process group of its own (a terminal's Ctrl-C does not reach it, it ignores a hang-up,
    `inherited_lock`, and it outlives this process) at nice 19, holding the build
    lock taken here (its descriptor in the environment variable `LOCK_FD_ENV`, for
    `build(lock_fd=...)`), its output in ``build.log`` beside `target`. When another process holds
    the lock (building it already) no second build starts: the handle follows that one. None when
    `target` is there already.

    Not a session of its own: with the kernel's autogroup scheduling (most desktop and server
    kernels) a new session is a new group that shares the CPU evenly with this one whatever its
    nice value, so the build would take half of a 2-core machine from the engine."""
    if target.exists():
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    log = target.parent / "build.log"
    fd = os.open(_lock_file(target), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        if _held_elsewhere(fd):
            return BackgroundBuild(target, None, log)
        if target.exists():  # finished between the check above and the lock
            return None
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, LOCK_FD_ENV: str(fd)}, pass_fds=(fd,), process_group=0)
    finally:
        os.close(fd)  # the child's copy keeps the lock until it exits
    return BackgroundBuild(target, proc, log)


def inherited_lock() -> int | None:
    """In a child of `start_background`: the build lock's descriptor (then cleared from the
    environment, so the child's own children do not take it for theirs). Also lowers this
    process's CPU priority (and so its compilers') to nice 19, so the build takes little of the
    CPU the engine answering meanwhile uses (not SCHED_IDLE: a process waiting for the build,
    `cpu_attention=native`, must not wait for an idle machine), and ignores a terminal's hang-up.
    (A build that succeeds removes its ``build.log``; a failed one leaves it, `record_failure`.)"""
    fd = os.environ.pop(LOCK_FD_ENV, None)
    if fd is None:
        return None
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(19)
    return int(fd)


def _cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _compile_objects(cc: list[str], sources: tuple[Path, ...], flags: tuple[str, ...], work: Path, jobs: int,
                     timeout: float = 300) -> list[str]:
    """Each source compiled to an object file in `work`, `jobs` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    objects = [str(work / f"{i}-{src.stem}.o") for i, src in enumerate(sources)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda so: _run([*cc, *flags, "-c", "-o", so[1], str(so[0])], timeout=timeout),
                                zip(sources, objects)))
    for src, res in zip(sources, results):
        _checked(res, cc, src.name)
    return objects


def _checked(res: subprocess.CompletedProcess[str], cc: list[str], names: str) -> None:
    if res.returncode != 0:
        raise NativeBuildError(f"building {names} with {shlex.join(cc)} failed "
                               f"(exit {res.returncode}):\n{_tail(res.stderr or res.stdout)}")


def unavailable_reason(load: Callable[[], object]) -> str | None:
    """None when `load` (a loader of a native library, building it on first call) succeeds, else
    why not: its `NativeBuildError`'s message."""
    try:
        load()
    except NativeBuildError as e:
        return str(e)
    return None
