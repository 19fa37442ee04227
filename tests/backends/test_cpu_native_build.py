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
