"""The multi-LoRA end-to-end benchmark (`ci/bench/lora_e2e.py`): its ratios on recorded figures,
and a smoke run of its --quick mode (a tiny model, both engines, every adapter count)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "ci" / "bench" / "lora_e2e.py"


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("portside_lora_e2e_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_round_is_compared_with_the_base_run_of_the_same_round():
    bench = _bench()
    # round 2 ran while the machine was busy: both configurations slowed, the paired ratio did not
    summary = bench.summarize({"base": [100.0, 50.0, 200.0], "lora-4": [80.0, 45.0, 150.0], "lora-0": [100.0, 50.0, 200.0]})
    assert summary["base"] == {"rounds": 3, "best_tok_s": 200.0, "median_tok_s": 100.0}
    four = summary["lora-4"]
    assert four["vs_base_paired_median"] == 0.8  # median of 0.8, 0.9, 0.75
    assert four["vs_base_best"] == 0.75 and four["cost_vs_base"] == 0.2
    assert summary["lora-0"]["cost_vs_base"] == 0.0
    table = bench.table({"summary": {**summary, "target_4_adapters_under_25pct_met": True},
                         "lora_time_share": {"lora-4": {"share": 0.1234}}})
    assert "| lora-4 | 150.0 | 80.0 | 0.800 | 0.75 | 20.0% | 12.3% |" in table.splitlines()
    assert "| base | 200.0 | 100.0 |  |  |  |  |" in table.splitlines()


@pytest.mark.slow
def test_quick_run_writes_every_configuration(tmp_path: Path):
    bench = _bench()
    out = tmp_path / "lora_e2e.json"
    result = bench.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["summary"]) == {"base", "lora-0", "lora-1", "lora-4", "lora-16",
                                      "target_4_adapters_under_25pct_met"}
    assert all(r["best_tok_s"] > 0 for k, r in result["summary"].items() if k.startswith(("base", "lora")))
    assert result["workload"]["graph_runners"]["lora"] == "portside.contract.graph.EagerGraphRunner"
    shares = result["lora_time_share"]
    assert shares["lora-16"]["apply_s"] > 0 and 0 < shares["lora-16"]["share"] < 1
    assert result["machine"]["cpu"] and result["machine"]["threads"] == 1
