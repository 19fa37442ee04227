"""`portside bench latency` and `portside bench throughput`, run in-process through `portside.cli.main`
on a tiny random-weight Llama: the figures they print and write, speculative decoding's figures, and
bad flags exiting 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from portside.cli import main


@pytest.fixture(scope="module")
def repetitive_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Narrow initial weights: greedy decoding settles into repeats, which n-gram speculation finds."""
    from portside.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("bench_llama"), "llama", init_std=0.02)


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text}"
    return float(m.group(1))


def test_latency_prints_and_writes_its_figures(repetitive_llama, tmp_path, capsys):
    out_json = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", str(repetitive_llama), "--device", "cpu", "--input-len", "8",
               "--output-len", "4", "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3",
               "--output-json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0
    avg = _number(r"Avg latency: ([0-9.]+) seconds", text)
    p50 = _number(r"50% percentile latency: ([0-9.]+) seconds", text)
    p99 = _number(r"99% percentile latency: ([0-9.]+) seconds", text)
    assert 0 < p50 <= p99 and avg > 0
    assert "acceptance" not in text  # no speculative figures without speculation
    result = json.loads(out_json.read_text())
    assert len(result["latencies"]) == 3
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    assert "spec_decode" not in result


def test_throughput_counts_every_token(repetitive_llama, tmp_path, capsys):
    out_json = tmp_path / "throughput.json"
    rc = main(["bench", "throughput", "--model", str(repetitive_llama), "--device", "cpu", "--input-len", "6",
               "--output-len", "5", "--num-prompts", "3", "--output-json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0
    assert _number(r"Throughput: ([0-9.]+) requests/s", text) > 0
    assert "total tokens/s" in text and "output tokens/s" in text
    result = json.loads(out_json.read_text())
    # ignore_eos: every request generates exactly --output-len tokens
    assert result["num_requests"] == 3 and result["total_output_tokens"] == 15 and result["total_num_tokens"] == 33
    assert result["tokens_per_second"] == pytest.approx(33 / result["elapsed_time"])


def test_ngram_speculation_prints_acceptance_length(repetitive_llama, tmp_path, capsys):
    out_json = tmp_path / "spec.json"
    rc = main(["bench", "throughput", "--model", str(repetitive_llama), "--device", "cpu", "--input-len", "8",
               "--output-len", "24", "--num-prompts", "2", "--output-json", str(out_json),
               "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}'])
    text = capsys.readouterr().out
    assert rc == 0
    length = _number(r"Mean acceptance length: ([0-9.]+)", text)
    assert length >= 1
    assert "Acceptance per position: " in text
    spec = json.loads(out_json.read_text())["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
    assert spec["acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert spec["acceptance_length"] == pytest.approx(length, abs=0.005)
    assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
    assert len(spec["acceptance_per_pos"]) <= 3


@pytest.mark.parametrize("argv, message", [
    (["bench"], "the following arguments are required"),
    (["bench", "latency", "--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
    (["bench", "throughput", "--num-prompts", "many"], "--num-prompts: invalid int value: 'many'"),
    (["bench", "latency", "--num-iters-warmup", "-1"], "--num-iters-warmup: must be at least 0"),
    (["bench", "latency", "--input-lenn", "4"], "unknown flag --input-lenn; did you mean --input-len?"),
    (["bench", "throughput", "--batch-size", "4"], "unknown flag --batch-size"),
])
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
