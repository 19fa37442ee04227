"""A first run does not wait for the native cpu library (`native_ops.start` / `ready`): with an empty
kernel cache the engine answers on its torch paths while the library is built in a detached
process, then takes the native kernels from the first step after the build finished, with the
same greedy tokens (transformers'); the build is reported on stderr, and a failed one is recorded
so that later starts run the torch paths without compiling again."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from portside.backends.cpu import native_ops
from portside.testing.tiny import hf_greedy

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the background build assumes Linux")

PROMPT = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45]
TOKENS = 12


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _blocked_compiler(tmp_path: Path, cache: Path, release: Path, library: Path) -> str:
    """A C++ compiler that, for a build into `cache`, waits until `release` exists, then "builds" the
    library this test process built from the same sources (its objects empty, its link step a
    copy): so the background build runs exactly as long as the test wants, and what it leaves is
    the real library. It gives up after 5 minutes. Everything else (`--version` for the cache key,
    Inductor's compiles, which $CXX names too) is the real compiler's."""
    return _script(tmp_path / "blocked-c++", textwrap.dedent(f"""\
        case "$*" in *{cache}*) ;; *) exec c++ "$@";; esac
        n=0; while [ ! -e {release} ]; do sleep 0.1; n=$((n+1)); [ $n -lt 3000 ] || exit 1; done
        for a; do [ "$prev" = -o ] && out=$a; prev=$a; done
        case $out in *.so) cp {library} "$out";; *) : > "$out";; esac
        """))


ENGINE = """
import json, sys, time
from pathlib import Path

from portside import LLM, SamplingParams
from portside.backends.cpu.fused_decode import FusedDecoder

model, release, prompt, n, mode = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
fused = []
step = FusedDecoder.__call__
FusedDecoder.__call__ = lambda self, *a: fused.append(1) or step(self, *a)

llm = LLM(model=model, device="cpu", max_model_len=256, block_size=8, num_kv_blocks=64, platform_options={"cpu_graph": mode})
runner = llm.engine.executor.runner
params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

def generate(p=params):
    return llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0].outputs[0].token_ids

def state():
    return {"switched": not runner.graph_runner._native_pending, "fused_steps": len(fused),
            "attention_native": runner.attn_backend._kernels_ready(), "linears_native": runner.graph_runner._native}

first = generate()  # the compiler is blocked: an engine that waited for it would never get here
before = state()
release.touch()  # now the background build may finish
deadline = time.monotonic() + 240
while runner.graph_runner._native_pending and time.monotonic() < deadline:
    generate(SamplingParams(max_tokens=2, temperature=0.0))  # later requests: each step asks whether it is built
    time.sleep(0.2)
fused.clear()  # (the inductor runner's warm-up)
last = generate()
print(json.dumps({"first": first, "last": last, "before": before, "after": state()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "inductor"])
def test_the_engine_answers_before_the_build_and_switches_to_native_after(mode, tiny_llama, tmp_path):
    if native_ops.unavailable_reason() is not None:
        pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}")
    release = tmp_path / "release"
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "CXX": _blocked_compiler(tmp_path, cache, release, native_ops.load())}
    argv = [sys.executable, "-c", ENGINE, str(tiny_llama), str(release), json.dumps(PROMPT), str(TOKENS), mode]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    expected = hf_greedy(tiny_llama, PROMPT, TOKENS)
    assert out["first"] == expected and out["last"] == expected
    # the first answer on the torch paths; after the build, every decode step of a request in the fused native
    # step, and the eager runner's linears native too (the inductor runner's graphs keep torch's until a restart)
    assert out["before"] == {"switched": False, "fused_steps": 0, "attention_native": False, "linears_native": False}
    assert out["after"] == {"switched": True, "fused_steps": TOKENS - 1, "attention_native": True,
                            "linears_native": mode == "eager"}
    assert "building native cpu kernels in the background" in res.stderr
    assert "native cpu kernels built in the background in " in res.stderr
    built = list(cache.glob("portside/kernels/*/portside_cpu_native.so"))
    assert len(built) == 1 and not list(cache.glob("portside/kernels/*/build.log"))  # a build that succeeded leaves no log


def test_a_failed_background_build_is_reported_and_not_tried_again(tmp_path, monkeypatch, capfd):
    """A compiler that fails: `ready()` never waits, says why once the detached build ends, and the
    next process (here: this one, its state forgotten) reports the recorded failure without
    starting another build."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", _script(tmp_path / "c++", 'if [ "$1" = --version ]; then echo broken-cc 1.0; exit 0; fi\n'
                                                        'echo "fatal error: simulated compiler failure" >&2; exit 1\n'))
    native_ops.forget()
    try:
        assert native_ops.ready() is False and native_ops.pending()
        build = native_ops._state.build
        assert build is not None and build.proc is not None
        assert build.proc.wait(timeout=120) == 2
        native_ops._state.next_poll = 0.0
        assert native_ops.ready() is False and not native_ops.pending()
        assert "simulated compiler failure" in native_ops.not_ready_reason()
        err = capfd.readouterr().err
        assert "building native cpu kernels in the background" in err and "simulated compiler failure" in err
        native_ops.forget()
        assert native_ops.ready() is False and native_ops._state.build is None  # no second build
        assert "simulated compiler failure" in native_ops.not_ready_reason()
        assert "python -m portside.backends.cpu.native_ops" in native_ops.not_ready_reason()
    finally:
        native_ops.forget()
