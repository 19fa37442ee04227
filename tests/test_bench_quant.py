"""The GGUF-vs-llama.cpp bench's ratios, bounds and targets (`ci/bench/quant_gguf.py`), on recorded figures."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "ci" / "bench"


@pytest.fixture
def qg(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import quant_gguf

    return quant_gguf


def _run(decode_ms: float, prefill: float, bw: float, tokens: list[int], **extra) -> dict:
    return {"decode_ms_per_token": decode_ms, "prefill_tok_s": prefill, "prefill_batch_tok_s": 2 * prefill,
            "decode_read_bandwidth_gbs": bw, "tokens": tokens, "load_before": "1.50 1.0 0.5 2/100 1",
            "load_after": "1.70 1.1 0.5 2/100 1", **extra}


def _section() -> dict:
    return {
        "decode_tokens": 128, "prompt_len": 128, "batch": 4, "repeats": 3,
        "files": {"Q4_0": {"bytes_per_token": 200e6, "writer": "llama.cpp's quantizer", "types": {"Q4_0": 57, "Q6_K": 1},
                           "transformers_tokens": [5, 6, 7, 8]}},
        "runs": {"Q4_0": {"1": {
            "gguf-q4_0": _run(8.0, 300.0, 20.0, [5, 6, 7, 9], kernels={"Q4_0->gguf-Q4_0": 56, "Q6_K->gguf-Q6_K": 1}),
            "gguf-q4_0-a8": {"skipped": "this build has no cpu platform option cpu_gguf_act"},
            "llama.cpp-q4_0": _run(12.0, 250.0, 25.0, [5, 6, 8, 9]),
        }}},
    }


def test_ratios_bound_and_targets_against_llama_cpp(qg):
    section = _section()
    rows = {r["peer"]: r for r in qg.summarize(section)}
    ours = rows["gguf-q4_0"]
    # bound: 200 MB at the 20 GB/s read around this peer's own decode = 10 ms; 8 ms is 0.8x of it
    assert ours["bound_ms"] == 10.0 and ours["vs_bound"] == 0.8
    assert ours["decode_speedup_vs_llama_cpp"] == 1.5  # llama.cpp 12 ms / 8 ms
    assert ours["prefill_vs_llama_cpp"] == 1.2 and ours["prefill_batch_vs_llama_cpp"] == 1.2
    assert ours["greedy_prefix_equal_to_llama_cpp"] == 2 and ours["greedy_compared"] == 4
    assert ours["greedy_equal_to_transformers"] == 3 and rows["llama.cpp-q4_0"]["greedy_equal_to_transformers"] == 2
    assert ours["targets_met"] == {"decode": True, "prefill": True, "bound": True}
    assert "targets_met" not in rows["llama.cpp-q4_0"]  # the reference is not compared with itself
    assert "cpu_gguf_act" in rows["gguf-q4_0-a8"]["note"]


def test_a_target_missed_is_reported_as_missed(qg):
    section = _section()
    section["runs"]["Q4_0"]["1"]["gguf-q4_0"]["decode_ms_per_token"] = 11.0  # 12/11 = 1.09x < 1.2x
    qg.summarize(section)
    text = "\n".join(qg.markdown(section))
    assert "decode 1.09x (not met), prefill 1.2x (met), 1.1x bound (met)" in text
    assert "Q4_0->gguf-Q4_0 x56, Q6_K->gguf-Q6_K x1" in text
    assert "| 3 / 2 of 4 |" in text


def test_without_llama_cpp_no_target_is_claimed(qg):
    section = _section()
    del section["runs"]["Q4_0"]["1"]["llama.cpp-q4_0"]
    rows = qg.summarize(section)
    assert not any("targets_met" in r for r in rows)
    assert "Targets: not checked" in "\n".join(qg.markdown(section))


def test_int8_activation_peer_runs_only_where_the_option_exists(qg, monkeypatch):
    from portside.backends.cpu import options
    from portside.contract import BackendOption

    monkeypatch.setattr(options, "BACKEND_OPTIONS", tuple(o for o in options.BACKEND_OPTIONS if o.name != "cpu_gguf_act"))
    assert "no cpu platform option cpu_gguf_act" in qg.a8_unavailable()
    monkeypatch.setattr(options, "BACKEND_OPTIONS", options.BACKEND_OPTIONS + (
        BackendOption("cpu_gguf_act", "GGUF kernels' activations", ("fp32", "int8"), "fp32"),))
    assert qg.a8_unavailable() is None
    monkeypatch.setattr(options, "BACKEND_OPTIONS", options.BACKEND_OPTIONS[:-1] + (
        BackendOption("cpu_gguf_act", "GGUF kernels' activations", ("fp32", "bf16"), "fp32"),))
    assert "not int8" in qg.a8_unavailable()


def test_a_negative_decode_time_is_no_figure(qg):
    section = _section()
    section["runs"]["Q4_0"]["1"]["gguf-q4_0"]["decode_ms_per_token"] = -8.1  # best of 1 token > best of 1 + D
    rows = {r["peer"]: r for r in qg.summarize(section)}
    assert "no valid decode time" in rows["gguf-q4_0"]["note"] and "targets_met" not in rows["gguf-q4_0"]


def test_rounds_keep_each_peers_best_figures(qg):
    """`--rounds`: a peer's faster decode is kept with the bandwidth measured around it, the higher
    prefill rates whichever round gave them, and a failed round gives way to a valid one."""
    slow = _run(12.0, 300.0, 30.0, [1, 2])
    fast = _run(9.0, 250.0, 40.0, [1, 3])
    best = qg._best(slow, fast)
    assert (best["decode_ms_per_token"], best["decode_read_bandwidth_gbs"], best["tokens"]) == (9.0, 40.0, [1, 3])
    assert (best["prefill_tok_s"], best["prefill_batch_tok_s"], best["rounds"]) == (300.0, 600.0, 2)
    assert qg._best({"error": "RuntimeError: boom"}, slow) is slow
    assert qg._best(slow, {"error": "RuntimeError: boom"}) is slow
    assert qg._best(slow, _run(-3.0, 900.0, 10.0, [])) is slow  # no valid decode time: not a figure
