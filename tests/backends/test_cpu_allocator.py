"""The cpu backend's caching allocator (`csrc/cpu_allocator.cpp`, installed by
`CpuPlatform.prepare_model`): freed blocks are reused, results do not change, raw pointers from
the allocator that was there before are handed back to it, a zero cache frees everything, and
blocks nobody asks for any more (a prefill's, once decoding goes on or the engine is idle) go
back to the system, their pages with them.

It is process-wide and stays installed once set (see `set_caching_allocator`), so these tests
leave it installed with the default cache size, as any cpu engine in the test process would."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from portside.backends.cpu import native_ops
from portside.backends.cpu.platform import DEFAULT_ALLOCATOR_CACHE_MB, install_caching_allocator

pytestmark = pytest.mark.skipif(native_ops.unavailable_reason() is not None, reason="native library does not build here")

ops = torch.ops.portside_cpu_native if native_ops.unavailable_reason() is None else None


@pytest.fixture
def cache():
    assert install_caching_allocator(64)
    yield
    install_caching_allocator(DEFAULT_ALLOCATOR_CACHE_MB)


def stats() -> dict[str, int]:
    installed, cached, limit, hits, misses = ops.caching_allocator_stats()
    return {"installed": installed, "cached": cached, "limit": limit, "hits": hits, "misses": misses}


def test_freed_blocks_are_reused(cache):
    x = torch.empty(1000)
    ptr = x.data_ptr()
    assert ptr % 64 == 0  # c10's alignment
    del x
    before = stats()
    assert before["installed"] == 1 and before["limit"] == 64 << 20 and before["cached"] >= 4000
    y = torch.empty(1000)  # same size class: the block just freed
    assert y.data_ptr() == ptr
    assert stats()["hits"] == before["hits"] + 1
    del y  # sizes round up to a quarter of their power of two: 4000 and 4080 bytes share 4096
    assert torch.empty(1020).data_ptr() == ptr


def test_results_unchanged(cache):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(257, 129, generator=g), torch.randn(129, 65, generator=g)
    expected = (a.double() @ b.double()).float()
    for _ in range(3):  # fresh blocks, then reused ones holding old data
        out = torch.relu(a @ b) - torch.relu(-(a @ b))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    z = torch.zeros(4096)
    assert not z.any()  # zeros really zero a reused block


def test_large_blocks_are_not_cached(cache):
    big = torch.empty(80 << 20, dtype=torch.uint8)  # above the 64 MiB block cap
    big.fill_(1)
    cached = stats()["cached"]
    del big
    assert stats()["cached"] <= cached  # (less: the idle thread may let others go meanwhile)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _prefill_blocks() -> float:
    """Frees 24 MiB of 4 MiB blocks into the cache (as a prefill's activations); the RSS then."""
    blocks = [torch.ones(1 << 20) for _ in range(6)]
    del blocks
    assert stats()["cached"] >= 24 << 20
    return _rss_mib()


def test_blocks_nobody_asks_for_go_back_while_others_are_reused(cache):
    rss = _prefill_blocks()
    before = stats()
    for _ in range(6000):  # decode steps: the same small sizes again and again, past the 4096-allocation window
        x = torch.empty(300)
        del x
    after = stats()
    assert after["misses"] <= before["misses"] + 1  # the small block was reused throughout
    assert after["cached"] < 1 << 20  # the 4 MiB blocks went
    assert _rss_mib() < rss - 16  # and their pages with them (their own mappings)


def test_an_idle_cache_empties(cache):
    rss = _prefill_blocks()
    deadline = time.monotonic() + 10
    # no allocation meanwhile: the idle thread's work (its count drops as it takes the blocks, their
    # pages go back a moment later, so both are polled)
    while (stats()["cached"] or _rss_mib() >= rss - 16) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats()["cached"] == 0
    assert _rss_mib() < rss - 16


def test_zero_cache_frees_everything_and_stays_installed(cache):
    x = torch.empty(1 << 16)
    del x
    assert stats()["cached"] > 0
    assert not install_caching_allocator(0)
    s = stats()
    assert s["installed"] == 1 and s["cached"] == 0 and s["limit"] == 0
    y = torch.ones(1 << 16)
    del y
    assert stats()["cached"] == 0  # nothing kept


def test_raw_pointers_of_the_previous_allocator_go_back_to_it(cache):
    """oneDNN (ideep) frees its raw allocations through whichever CPU allocator is current: a
    packed weight made before the caching allocator, freed after, must not reach its cache."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN not built into this torch")
    code = (
        "import torch\n"
        "from portside.backends.cpu.platform import install_caching_allocator\n"
        "w = torch.randn(64, 64)\n"
        "packed = torch.ops.mkldnn._reorder_linear_weight(w)\n"
        "assert install_caching_allocator(64)\n"
        "del packed\n"
        "again = torch.ops.mkldnn._reorder_linear_weight(w)\n"
        "assert not install_caching_allocator(0)\n"
        "del again\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_fork_child_can_allocate(cache):
    x = torch.empty(100)
    del x
    pid = os.fork()
    if pid == 0:  # the child must not find the allocator's lock held
        try:
            torch.empty(100).fill_(1.0)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0


def test_option_is_validated():
    from portside.backends.cpu.platform import CpuPlatform
    from portside.config import EngineConfig, ModelConfig

    config = EngineConfig(model=ModelConfig(path="unused"), platform_options=(("cpu_allocator_cache_mb", "lots"),))
    with pytest.raises(ValueError, match="cpu_allocator_cache_mb='lots': give a size in MiB"):
        CpuPlatform.check_and_update_config(config)
