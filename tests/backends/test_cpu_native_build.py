"""How a native cpu build runs (`backends/cpu/native_build.build`): a notice on stderr with its time,
the sources compiled in parallel and linked, one build when two threads ask at once."""

from __future__ import annotations

import ctypes
import shutil
import sys
import threading

import pytest

from portside.backends.cpu import native_build

pytestmark = pytest.mark.skipif(sys.platform != "linux" or shutil.which("cc") is None, reason="needs Linux and cc")

FLAGS = ("-O1", "-fPIC", "-shared")


@pytest.fixture
def sources(tmp_path):
    a, b = tmp_path / "a.c", tmp_path / "b.c"
    a.write_text("int ps_one(void) { return 1; }\n")
    b.write_text("int ps_one(void);\nint ps_two(void) { return ps_one() + 1; }\n")
    return a, b


def test_a_build_says_so_compiles_in_parallel_and_links(sources, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(native_build, "_cores", lambda: 2)
    target = tmp_path / "out" / "lib.so"
    assert native_build.build(["cc"], sources, FLAGS, (), target) is True
    err = capfd.readouterr().err
    assert "portside: building native cpu kernels (2 sources, 2 at a time; first run, ~" in err
    assert "portside: native cpu kernels built in " in err
    assert ctypes.CDLL(str(target)).ps_two() == 2  # both objects linked into one library
    assert native_build.build(["cc"], sources, FLAGS, (), target) is False  # cached: silent
    assert capfd.readouterr().err == ""
    # no objects or temporaries left; the lock file stays (removing it would race another process)
    assert sorted(p.name for p in target.parent.iterdir()) == ["lib.so", "lib.so.lock"]


def test_a_killed_builds_leftovers_go_with_the_next_build(sources, tmp_path):
    """A build killed mid-way (SIGKILL: no cleanup) leaves its temporary folder and a background
    build's log; the next build, holding the lock, removes them."""
    target = tmp_path / "out" / "lib.so"
    (target.parent / ".build-killed").mkdir(parents=True)
    (target.parent / ".build-killed" / "a.o").write_bytes(b"partial")
    (target.parent / "build.log").write_text("portside: building native cpu kernels ...\n")
    assert native_build.build(["cc"], sources, FLAGS, (), target) is True
    assert sorted(p.name for p in target.parent.iterdir()) == ["lib.so", "lib.so.lock"]


def test_two_threads_asking_at_once_build_once(sources, tmp_path):
    target = tmp_path / "lib.so"
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(native_build.build(["cc"], sources, FLAGS, (), target)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, True]


@pytest.mark.slow
def test_two_processes_asking_at_once_build_once(sources, tmp_path):
    """Test workers or servers sharing one cache wait for one build (a file lock), not compile twice."""
    import subprocess

    target = tmp_path / "lib.so"
    slow_cc = tmp_path / "slow-cc"  # a compile that outlasts the two processes' start-up skew
    slow_cc.write_text('#!/bin/sh\nsleep 4\nexec cc "$@"\n')
    slow_cc.chmod(0o755)
    script = (f"import pathlib; from portside.backends.cpu import native_build; "
              f"print(native_build.build([{str(slow_cc)!r}], tuple(map(pathlib.Path, {[str(p) for p in sources]!r})), {FLAGS!r}, (), "
              f"pathlib.Path({str(target)!r})))")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert outs == ["False", "True"], outs


def test_a_failing_source_is_named(sources, tmp_path, monkeypatch):
    monkeypatch.setattr(native_build, "_cores", lambda: 2)
    sources[1].write_text("int ps_two(void) { return }\n")
    with pytest.raises(native_build.NativeBuildError, match="building b.c with .* failed"):
        native_build.build(["cc"], sources, FLAGS, (), tmp_path / "lib.so")
    assert not (tmp_path / "lib.so").exists()


def _background_child(cc: str, sources, target) -> list[str]:
    """What `native_ops` runs detached (`python -m ... --background`), for these sources: a build
    holding the lock it inherits, its failure recorded."""
    script = (f"import pathlib, sys; from portside.backends.cpu import native_build as nb; "
              f"target = pathlib.Path({str(target)!r}); fd = nb.inherited_lock(); assert fd is not None\n"
              f"try: nb.build([{cc!r}], tuple(map(pathlib.Path, {[str(p) for p in sources]!r})), {FLAGS!r}, (), "
              f"target, lock_fd=fd)\n"
              f"except nb.NativeBuildError as e: nb.record_failure(target, str(e)); sys.exit(2)")
    return [sys.executable, "-c", script]


def _until(check, timeout: float = 120):
    import time

    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return result


def test_a_background_build_runs_detached_once_while_the_caller_goes_on(sources, tmp_path):
    """`start_background` returns while the compiler still runs (here: blocked until released), in
    a child that holds the build lock from the start, so a second caller (another engine) follows
    that build instead of starting one; the library appears whole, once."""
    target, release, calls = tmp_path / "out" / "lib.so", tmp_path / "release", tmp_path / "calls"
    blocked_cc = tmp_path / "blocked-cc"
    blocked_cc.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                          f'n=0; while [ ! -e {release} ] && [ $n -lt 1200 ]; do sleep 0.1; n=$((n+1)); done\n'
                          f'exec cc "$@"\n')
    blocked_cc.chmod(0o755)
    argv = _background_child(str(blocked_cc), sources, target)
    first = native_build.start_background(argv, target)
    assert first is not None and first.proc is not None
    assert first.done() is False and not target.exists()  # the compiler is still blocked: nobody waited
    second = native_build.start_background(argv, target)
    assert second is not None and second.proc is None and second.done() is False  # follows the first
    release.touch()
    assert _until(first.done) and second.done() and first.proc.wait(timeout=60) == 0
    assert ctypes.CDLL(str(target)).ps_two() == 2
    lines = calls.read_text().splitlines()
    assert len(lines) == 3 and sum(" -c " in line for line in lines) == 2  # a and b compiled once, linked once
    assert native_build.start_background(argv, target) is None  # built: nothing to start


def test_a_failed_background_build_gives_its_reason_and_is_recorded(sources, tmp_path):
    target = tmp_path / "lib.so"
    sources[1].write_text("int ps_two(void) { return }\n")
    build = native_build.start_background(_background_child("cc", sources, target), target)
    with pytest.raises(native_build.NativeBuildError, match="building b.c with cc failed"):
        _until(build.done)
    assert "building b.c with cc failed" in native_build.recorded_failure(target)
    assert not target.exists()
