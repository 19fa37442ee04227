"""The KV budget of hybrid models (`portside.engine.kv_report`, `portside devices --model`): 24 layers of
which 18 keep a fixed recurrent state hold several times the sequences of the same model with
attention in every layer. Real layer shapes, built on the meta device (no weights, no memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from portside.engine.kv_report import cache_report
from portside.testing.tiny_hybrid import write_real_shaped_config

BUDGET = 8 * 2**30
SEQ = 4096


def test_qwen3_next_shaped_hybrid_holds_nearly_3x_the_sequences(tmp_path):
    hybrid = cache_report(write_real_shaped_config(tmp_path / "hybrid", "qwen3_next", True), torch.bfloat16)
    full = cache_report(write_real_shaped_config(tmp_path / "full", "qwen3_next", False), torch.bfloat16)
    assert hybrid.kv.num_layers == 6 and hybrid.state is not None and hybrid.state.num_layers == 18
    assert full.state is None and full.kv.num_layers == 24
    assert hybrid.bytes_per_token * 4 == full.bytes_per_token
    # per layer: conv state 8192 x 3 and delta-rule state 32 x 128 x 128, in the model's dtype (auto)
    assert hybrid.state.bytes_per_layer == (8192 * 3 + 32 * 128 * 128) * 2
    ratio = hybrid.sequences(BUDGET, SEQ) / full.sequences(BUDGET, SEQ)
    assert 2.8 < ratio < 4  # 122 vs 42 sequences of 4k tokens in 8 GiB: the state costs what 1.3k tokens do
    fp32 = cache_report(tmp_path / "hybrid", torch.bfloat16, mamba_ssm_cache_dtype="float32")
    assert fp32.state is not None and fp32.state_bytes_per_sequence > hybrid.state_bytes_per_sequence
    assert fp32.sequences(BUDGET, SEQ) < hybrid.sequences(BUDGET, SEQ)


def test_granite_4_h_shaped_hybrid_holds_over_3x_the_sequences(tmp_path):
    """Granite 4.0-H-Tiny's layer shapes, 24 layers of which 18 Mamba-2: 132 sequences of 4k tokens
    in 8 GiB against 42 with attention everywhere (3.1x); 108 with float32 SSM state (2.6x)."""
    hybrid = cache_report(write_real_shaped_config(tmp_path / "hybrid", "granite_hybrid", True), torch.bfloat16)
    full = cache_report(write_real_shaped_config(tmp_path / "full", "granite_hybrid", False), torch.bfloat16)
    assert hybrid.state is not None and hybrid.state.num_layers == 18 and hybrid.state.kind == "mamba2"
    # conv state over x, B and C (3072 + 2 x 128 channels) x 3, SSM state 48 x 64 x 128, both bf16
    assert hybrid.state.bytes_per_layer == (3328 * 3 + 48 * 64 * 128) * 2
    assert hybrid.sequences(BUDGET, SEQ) >= 3 * full.sequences(BUDGET, SEQ)
    fp32 = cache_report(tmp_path / "hybrid", torch.bfloat16, mamba_ssm_cache_dtype="float32")
    assert 2.5 < fp32.sequences(BUDGET, SEQ) / full.sequences(BUDGET, SEQ) < 3


def test_portside_devices_reports_a_models_cache(tmp_path):
    path = write_real_shaped_config(tmp_path / "hybrid", "qwen3_next", True)
    out = subprocess.run([sys.executable, "-m", "portside.cli", "devices", "--model", str(path), "--max-model-len", "4096",
                          "--kv-cache-memory", str(BUDGET)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "gated_deltanet (recurrent state): 18 layers" in out.stdout
    assert "full attention: 6 layers" in out.stdout
    assert "hold 122 sequences of 4096 tokens" in out.stdout


@pytest.mark.parametrize("flag", [["--dtype", "nope"], ["--mamba-ssm-cache-dtype", "int3"]])
def test_portside_devices_refuses_a_bad_report_flag(tmp_path, flag):
    path = write_real_shaped_config(tmp_path / "hybrid", "qwen3_next", True)
    out = subprocess.run([sys.executable, "-m", "portside.cli", "devices", "--model", str(path), *flag],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "error:" in out.stderr and flag[0] in out.stderr
