"""The `portside` command as a user runs it: a real subprocess, real exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def portside(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "portside.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_devices_lists_every_platform_with_reasons():
    proc = portside("devices")
    assert proc.returncode == 0, proc.stderr
    table, options = proc.stdout.split("\n\n", 1)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["DEVICE", "STATUS", "PACKAGE"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert "available" in rows["cpu"].split()[1]
    for name in ("cuda", "rocm", "tpu"):
        assert name in rows, f"{name} missing from `portside devices`:\n{proc.stdout}"
    # without the hardware each says why, on its own line under the row (the reason depends on the leg's environment)
    assert "unavailable" in rows["cuda"]
    below = lines[lines.index(rows["cuda"]) + 1]
    assert below.startswith("    reason: ") and len(below.split("reason: ", 1)[1].strip()) > 10, proc.stdout
    # then each platform's backend options (`Platform.backend_options`): name, choices, default, help
    assert options.startswith("BACKEND OPTIONS (--backend-option KEY=VALUE"), options
    assert "\ncpu:\n  cpu_graph=eager|inductor|openvino (default: eager)\n      how the model step runs" in options
    assert "\ncuda:\n  graph_sizes=VALUE\n" in options and "\ntpu:\n  xla_token_buckets=VALUE\n" in options


def test_unavailable_device_exits_2_naming_devices_and_reasons(tiny_llama):
    if "PJRT_DEVICE" in os.environ:
        pytest.skip("the xla leg makes tpu available")
    proc = portside("generate", "hello", "--model", str(tiny_llama), "--device", "tpu")
    assert proc.returncode == 2
    assert "device 'tpu' is unavailable" in proc.stderr
    assert "devices found" in proc.stderr and "cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_unknown_device_and_missing_model_exit_2(tmp_path, capsys):
    proc = portside("generate", "hello", "--device", "no-such-device", "--model", str(tmp_path))
    assert proc.returncode == 2 and "no platform named 'no-such-device'" in proc.stderr
    # the same entry point in this process (a subprocess each costs ~10 s of imports on CI's 2 cores)
    from portside.cli import main

    assert main(["generate", "hello", "--device", "cpu", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as usage:  # argparse's own exit
        main(["generate", "hello", "--max-tokens", "many"])
    assert usage.value.code == 2 and "invalid int value" in capsys.readouterr().err


def test_bad_sampling_value_exits_2(tiny_llama):
    proc = portside("generate", "hello", "--model", str(tiny_llama), "--device", "cpu", "--top-p", "1.5")
    assert proc.returncode == 2 and "top_p" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_generate_with_a_local_model(tiny_llama):
    from portside.testing.tiny import hf_greedy

    proc = portside("generate", "the quick brown fox", "--raw", "--model", str(tiny_llama), "--device", "cpu",
                    "--max-tokens", "8", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    expected = tok.decode(hf_greedy(tiny_llama, tok.encode("the quick brown fox"), 8), skip_special_tokens=True)
    assert proc.stdout.strip() == expected.strip()


@pytest.mark.slow
def test_default_model_answers_paris():
    """The README's first command (the model is fetched and converted once, then cached)."""
    proc = portside("generate", "What is the capital of France?", timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flags,sequences", [((), 1), (("-n", "3"), 3), (("--max-num-seqs", "5"), 5)])
def test_generate_sizes_its_kv_cache_for_its_prompt(tiny_llama, flags, sequences, caplog):
    """One prompt's n samples: `--max-num-seqs` defaults to -n, so the KV cache is the runner's cap
    for that many sequences (twice their full length), not a server's budget (the default model's
    4 GiB cost a first answer ~10 s of CPU)."""
    import logging
    import re

    argv = ["--log-level", "INFO", "generate", "hello", "--raw", "--model", str(tiny_llama), "--device", "cpu",
            "--max-model-len", "256", "--block-size", "16", "--max-tokens", "2", *flags]
    if flags == ("-n", "3"):  # as a user runs it
        proc = portside(*argv)
        assert proc.returncode == 0, proc.stderr
        log = proc.stderr
    else:  # the same entry point in this process (a subprocess costs ~10 s of imports on CI's 2 cores)
        from portside.cli import main

        caplog.set_level(logging.INFO)
        assert main(argv) == 0
        log = caplog.text
    blocks = int(re.search(r"KV cache: (\d+) blocks of 16 tokens", log).group(1))
    assert blocks == 2 * sequences * (256 // 16)
