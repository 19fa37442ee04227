"""The cpu benchmark's bounds and targets (`ci/bench/cpu.py`, `_ratios`), on recorded figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "ci" / "bench" / "cpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("portside_cpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(decode_bw: float) -> dict:
    return {
        "machine": {"read_bandwidth_gbs": 35.0, "fp32_matmul_gflops": 200.0},
        "model": {"weight_bytes_per_token": 538e6, "flops_per_prompt_token": 2 * 106e6,
                  "flops_per_generated_token": 2 * 134.5e6},
        "workload": {"num_prompts": 64, "prompt_len": 128, "gen_len": 128},
        "bounds": {},
        "runs": {
            "transformers-static": {"output_tok_s": 150.0, "decode_ms_per_token": 60.0, "read_bandwidth_after_gbs": 34.0},
            "portside-inductor": {"output_tok_s": 270.0, "decode_ms_per_token": 12.0,
                                  "decode_read_bandwidth_gbs": decode_bw, "read_bandwidth_after_gbs": 35.5},
        },
    }


def test_decode_bound_counts_the_bandwidth_around_each_decode():
    bench = _bench()
    fast = _result(decode_bw=63.0)  # the decode ran in the VM's fast state, everything else slow
    bench._ratios(fast)
    assert fast["bounds"]["read_bandwidth_best_gbs"] == 63.0
    assert abs(fast["bounds"]["decode_ms_per_token"] - 538 / 63.0) < 1e-9
    inductor = fast["summary"]["portside-inductor"]
    assert inductor["decode_vs_bandwidth_bound"] == inductor["decode_vs_bandwidth_bound_then"] == round(12.0 / (538 / 63), 3)
    assert fast["summary"]["target_throughput_1.5x_met"] and not fast["summary"]["target_decode_1.25x_met"]

    slow = _result(decode_bw=34.0)  # the best reading elsewhere (35.5) sets the strict bound
    bench._ratios(slow)
    assert slow["bounds"]["read_bandwidth_best_gbs"] == 35.5
    assert slow["summary"]["target_decode_1.25x_met"] and slow["summary"]["target_decode_1.25x_met_then"]


def test_weight_streams_are_held_to_the_bound_of_their_own_minute():
    bench = _bench()
    result = _result(decode_bw=34.0)
    result["runs"]["portside-inductor"]["weight_streams"] = {
        "read_bandwidth_before_gbs": 60.0, "read_bandwidth_after_gbs": 64.0,
        "flat_sum_ms": 8.6, "matrix_sums_ms": 9.6, "linear_row_ms": 10.4}
    result["runs"]["portside-inductor"]["read_bandwidth_after_gbs"] = 66.0  # the run's own reading, kept too
    bench._ratios(result)
    assert result["bounds"]["read_bandwidth_best_gbs"] == 66.0
    result["runs"]["portside-inductor"]["read_bandwidth_after_gbs"] = 35.5
    bench._ratios(result)
    assert result["bounds"]["read_bandwidth_best_gbs"] == 64.0  # its readings count for the strict bound
    bound = 538 / 64.0
    streams = result["summary"]["portside-inductor"]["weight_streams_vs_bandwidth_bound_then"]
    assert streams == {"flat_sum": round(8.6 / bound, 3), "matrix_sums": round(9.6 / bound, 3),
                       "linear_row": round(10.4 / bound, 3)}


def test_weight_streams_measures_a_packed_model():
    import torch

    from portside.backends.cpu.weights import pack_weights

    bench = _bench()
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False))
    out = bench.weight_streams(model, repeats=3)
    assert "flat_sum_ms" not in out  # separate allocations: no single buffer to sum
    assert {"matrix_sums_ms", "read_bandwidth_before_gbs", "read_bandwidth_after_gbs"} <= out.keys()
    pack_weights(model)
    out = bench.weight_streams(model, repeats=3)
    assert out["flat_sum_ms"] > 0 and out["read_bandwidth_before_gbs"] > 0


def test_throughput_bound_uses_the_best_matmul_rate_of_the_run():
    bench = _bench()
    result = _result(decode_bw=35.0)  # 200 GFLOP/s at the start
    bench._ratios(result)
    at_start = result["bounds"]["throughput_tok_s"]
    assert abs(at_start - 64 * 128 * 200e9 / (64 * 128 * 2 * (106e6 + 134.5e6))) < 1e-6
    result["runs"]["portside-inductor"]["fp32_matmul_gflops_after"] = 250.0  # a faster minute later on
    bench._ratios(result)
    assert result["bounds"]["fp32_matmul_gflops_best"] == 250.0
    assert abs(result["bounds"]["throughput_tok_s"] - at_start * 250 / 200) < 1e-6
    assert result["summary"]["portside-inductor"]["fraction_of_compute_bound"] == round(270.0 / (at_start * 1.25), 3)
