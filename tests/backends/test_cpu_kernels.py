"""The native cpu library's build cache, failure reporting and OpenMP runtime (`backends/cpu/native_ops.py`,
`native_build.py`; the ctypes kernels of `kernels.py`).

Numerics are in test_cpu_attention.py (the `native` backend against the reference)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from portside.backends.cpu import kernels, native_build, native_ops
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.backends.cpu.platform import CpuPlatform
from portside.config import EngineConfig, ModelConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the build cache tests assume Linux")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache under tmp_path; the in-process library is forgotten before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _forget()
    yield tmp_path
    _forget()


def _forget() -> None:
    kernels.load_library.cache_clear()
    native_ops.forget()


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _native_config() -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused"), platform_options=(("cpu_attention", "native"),))


def test_one_library_and_a_second_load_uses_the_cache():
    """The ctypes kernels and the torch operators are one .so in the cache; loading it again (another
    process, or this one after forgetting it) finds it built: no second compile, no temporaries left."""
    if kernels.native_unavailable_reason() is not None:
        pytest.skip(f"no working C++ compiler here: {kernels.native_unavailable_reason()}")
    first = kernels.load_library()
    assert first.path == native_ops.load() and first.path.is_relative_to(native_build.cache_dir())
    assert hasattr(torch.ops.portside_cpu_native, "argmax_rows") and first.lib.ps_abi_version() == kernels.ABI_VERSION
    # the build's lock file stays (deleting it would race a waiting process)
    assert sorted(p.name for p in first.path.parent.iterdir()) == ["portside_cpu_native.so", "portside_cpu_native.so.lock"]
    mtime = first.path.stat().st_mtime_ns
    _forget()
    assert kernels.load_library().path == first.path
    assert native_ops._build() == (first.path, False) and first.path.stat().st_mtime_ns == mtime


def test_cache_key_follows_source_flags_and_torch():
    cc = native_build.compiler()
    sources, flags = native_ops.SOURCES + native_ops.INCLUDED, native_ops.FLAGS
    key = native_build.build_key(cc, sources, flags, extra=torch.__version__)
    assert native_build.build_key(cc, sources, (*flags, "-DPORTSIDE_TEST=1"), extra=torch.__version__) != key
    assert native_build.build_key(cc, sources[:-1], flags, extra=torch.__version__) != key
    assert native_build.build_key(cc, sources, flags, extra="2.8.0") != key


def test_missing_compiler_is_a_reason(fresh, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh / "no-such-cxx"))
    reason = kernels.native_unavailable_reason()
    assert reason is not None and "could not run" in reason and "no-such-cxx" in reason
    assert native_ops.unavailable_reason() == reason


@pytest.mark.parametrize("cxx,expected", [(None, 0), ("no-such-cxx", 2)])
def test_build_ahead_of_time(fresh, cxx, expected):
    """`python -m portside.backends.cpu.native_ops` builds the library (or finds it built) and
    prints its path; without a compiler it says so and exits 2."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}  # the session's cache: already built
    if cxx:
        env["CXX"] = str(fresh / cxx)
    res = subprocess.run([sys.executable, "-m", "portside.backends.cpu.native_ops"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == expected, res.stderr
    if expected:
        assert "the native cpu library cannot be built here" in res.stderr and cxx in res.stderr
    else:
        assert res.stdout.strip().endswith("portside_cpu_native.so (already built)") or "(built)" in res.stdout


def test_no_compiler_on_path_is_a_reason(fresh, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(fresh))  # an empty folder
    assert "no C++ compiler found" in kernels.native_unavailable_reason()


def test_failing_compiler_reports_its_stderr(fresh, monkeypatch):
    cxx = _script(fresh / "c++", 'if [ "$1" = --version ]; then echo broken-cc 1.0; exit 0; fi\n'
                               'echo "fatal error: simulated compiler failure" >&2; exit 1\n')
    monkeypatch.setenv("CXX", cxx)
    reason = kernels.native_unavailable_reason()
    assert reason is not None and "simulated compiler failure" in reason and "exit 1" in reason
    assert not list((fresh / "cache").rglob("*.so"))  # nothing half-written left behind


def test_native_without_compiler_is_a_config_error(fresh, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh / "no-such-cxx"))
    with pytest.raises(ValueError, match="cpu_attention=native: .*no-such-cxx"):
        CpuPlatform.check_and_update_config(_native_config())


def test_auto_falls_back_to_torch_without_compiler(fresh, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh / "no-such-cxx"))
    config = EngineConfig(model=ModelConfig(path="unused"))
    backend = CpuPlatform.attention_backend(config)
    assert type(backend) is CpuAttentionBackend and backend.name == "torch-sdpa"


def test_auto_picks_native_for_fp32_and_bf16_only():
    # the session's library (built once)
    if kernels.native_unavailable_reason() is not None:
        pytest.skip("no working C compiler here")
    fp32 = EngineConfig(model=ModelConfig(path="unused"))
    bf16 = EngineConfig(model=ModelConfig(path="unused", dtype=torch.bfloat16))
    fp16 = EngineConfig(model=ModelConfig(path="unused", dtype=torch.float16))
    assert CpuPlatform.attention_backend(fp32).name == NativeAttentionBackend.name == "native-paged"
    assert CpuPlatform.attention_backend(bf16).name == "native-paged"
    assert CpuPlatform.attention_backend(fp16).name == "torch-sdpa"


def test_wrappers_check_their_inputs():
    if kernels.native_unavailable_reason() is not None:
        pytest.skip("no working C compiler here")
    cache = torch.zeros(2, 4, 8, 2, 64)
    q, out = torch.zeros(3, 4, 64), torch.zeros(3, 4, 64)
    tables, lens = torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="expected torch.float32"):
        kernels.paged_decode(out, q.double(), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="expected torch.int32"):
        kernels.paged_decode(out, q, cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.paged_decode(out, torch.zeros(3, 3, 64), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="longer than its block-table row"):
        kernels.paged_decode(out, q, cache, tables, torch.full((3,), 17, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="slot outside the cache"):
        kernels.write_kv(cache, torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), torch.tensor([4 * 8]))


def test_one_openmp_runtime_next_to_torch():
    """The kernels' libgomp is torch's (same SONAME libgomp.so.1, already loaded, so the system's
    is never mapped): one OpenMP pool, and multi-threaded kernel calls interleaved with torch's own
    parallel ops neither crash nor diverge. (Other wheels may bundle renamed copies, e.g.
    libgomp-<hash>.so.1; those are theirs.)"""
    if kernels.native_unavailable_reason() is not None:
        pytest.skip("no working C compiler here")
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    gomp = {line.split()[-1] for line in maps.splitlines() if line.endswith("/libgomp.so.1")}
    assert len(gomp) == 1, gomp
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 96, 16, 2, 64, generator=gen)
    q = torch.randn(6, 4, 64, generator=gen)
    tables = torch.randperm(96, generator=gen)[:90].view(6, 15).int()
    lens = torch.tensor([1, 5, 129, 9, 240, 3], dtype=torch.int32)  # two split into 128-token tasks
    expected = torch.empty_like(q)
    kernels.paged_decode(expected, q, cache, tables, lens, 0.125, num_threads=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for _ in range(20):
            torch.randn(256, 256) @ torch.randn(256, 256)  # torch's OpenMP pool
            out = torch.empty_like(q)
            kernels.paged_decode(out, q, cache, tables, lens, 0.125, num_threads=2)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)  # per-task work is thread-independent
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows,cols,bias", [(960, 576, False), (577, 1536, True), (7, 33, True), (1, 1, False)])
def test_native_linear_row_matches_linear(rows, cols, bias):
    """`portside_cpu_native::linear_row` (built here) equals F.linear for one fp32 row, with odd
    row counts and a column tail that is not a multiple of the vector width."""
    import torch.nn.functional as F

    from portside.backends.cpu import native_ops

    assert native_ops.unavailable_reason() is None
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, cols, generator=g), torch.randn(rows, cols, generator=g)
    b = torch.randn(rows, generator=g) if bias else None
    out = torch.ops.portside_cpu_native.linear_row(x, w, b)
    assert out.shape == (1, rows)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_native_linear_row_hands_other_inputs_to_linear():
    """Inputs the kernel is not written for (several rows, bf16, a transposed weight) still give
    F.linear's result: the operator is always correct to call."""
    import torch.nn.functional as F

    from portside.backends.cpu import native_ops

    native_ops.load()
    op = torch.ops.portside_cpu_native.linear_row
    x, w = torch.randn(3, 16), torch.randn(5, 16)
    torch.testing.assert_close(op(x, w, None), F.linear(x, w))
    xb, wb = x[:1].bfloat16(), w.bfloat16()
    torch.testing.assert_close(op(xb, wb, None), F.linear(xb, wb))
    wt = torch.randn(16, 5).t()
    torch.testing.assert_close(op(x[:1], wt, None), F.linear(x[:1], wt))


def test_decode_step_checks_its_inputs():
    """`kernels.DecodeStep` checks the step's tables once and each layer's tensors on every call."""
    tables, lens, slots = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32), torch.tensor([2, 4])
    with pytest.raises(ValueError, match="do not match 2 decodes"):
        kernels.DecodeStep(tables, lens, slots[:1])
    with pytest.raises(ValueError, match="expected torch.int64"):
        kernels.DecodeStep(tables, lens, slots.int())
    step = kernels.DecodeStep(tables, lens, slots)
    cache = torch.zeros(2, 4, 8, 2, 16)
    q, kv = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    assert step(q, kv, kv, cache, 0.25).shape == (2, 4, 16)
    with pytest.raises(ValueError, match="do not fit 2 decodes"):
        step(q[:1], kv[:1], kv[:1], cache, 0.25)
    with pytest.raises(ValueError, match="query heads do not fit 2 cached KV heads"):
        step(torch.randn(2, 3, 16), kv, kv, cache, 0.25)
    with pytest.raises(ValueError, match="dense heads"):
        step(q.bfloat16(), kv, kv, cache, 0.25)
    bad = torch.tensor([2, 8 * 4])  # one past the last slot
    with pytest.raises(ValueError, match="slot outside the cache"):
        kernels.DecodeStep(tables, lens, bad)(q, kv, kv, cache, 0.25)


def test_native_attention_operator_runs_the_installed_plan():
    """`portside_cpu_native::attention` with a decode plan installed (`set_decode_step`) writes K/V
    and attends exactly as `kernels.DecodeStep` (the same kernels), split sequences included;
    without a plan it hands the call to the Python operator; a bad plan is refused."""
    from portside.backends.cpu import native_ops

    native_ops.load()
    ops = torch.ops.portside_cpu_native
    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(2, 40, 16, 3, 64, generator=g) for _ in range(2)]
    tables = torch.randperm(40, generator=g)[:36].view(2, 18).int()
    lens = torch.tensor([200, 37], dtype=torch.int32)  # the first in two 128-token splits
    slots = (tables[:, 0].long() * 16 + 5).contiguous()
    q, k, v = torch.randn(2, 9, 64, generator=g), torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    expected_cache = caches[1].clone()
    expected = kernels.DecodeStep(tables, lens, slots)(q, k, v, expected_cache, 0.125)
    ops.set_decode_step(caches, tables, lens, slots)
    try:
        out = ops.attention(q, k, v, 1, 0.125)
    finally:
        ops.clear_decode_step()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(caches[1], expected_cache, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="outside forward_context"):  # no plan: the Python operator
        ops.attention(q, k, v, 1, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        ops.set_decode_step(caches, tables.long(), lens, slots)
    with pytest.raises(RuntimeError, match="fp32, all bf16"):
        ops.set_decode_step([caches[0].half()], tables, lens, slots)


def test_linear_row_without_cxx_compiler_falls_back(monkeypatch, tmp_path):
    """No C++ compiler: the operator's reason names it, and the GEMV pass uses Inductor's reduction."""
    from portside.backends.cpu import native_ops
    from portside.backends.cpu.gemv_pass import GemvAsReduction

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached there
    native_ops.load.cache_clear()
    try:
        assert "could not run" in native_ops.unavailable_reason()
        assert GemvAsReduction().native is False
    finally:
        monkeypatch.undo()
        native_ops.load.cache_clear()
    assert native_ops.unavailable_reason() is None  # loads again in the same process


def test_every_native_source_ships_in_the_package():
    """setup.py's package_data carries every file the build reads: an installed (non-editable)
    portside missing a header could not build its native library."""
    import re

    setup = (Path(__file__).parents[2] / "setup.py").read_text()
    globs = re.findall(r'"([^"]+)"', re.search(r'"portside\.backends\.cpu": \[([^\]]*)\]', setup).group(1))
    package = Path(native_ops.__file__).parent
    for path in native_ops.SOURCES + native_ops.INCLUDED:
        assert any(path.relative_to(package).match(g) for g in globs), f"{path.name} is not in package_data {globs}"
    shipped = {p for g in globs for p in package.glob(g)}
    assert set(native_ops.SOURCES + native_ops.INCLUDED) == shipped, "a csrc file the build does not name"
