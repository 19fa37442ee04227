"""The KV budget of a DeepSeek-V2-shaped model (`portside.engine.kv_report`, `portside devices
--model`): its latent cache (one row of kv_lora_rank + rope values per token and layer) holds
several times the tokens the same model would with full multi-head K and V. Real layer shapes
(DeepSeek-V2-Lite's), built on the meta device from config.json alone (no weights, no memory)."""

from __future__ import annotations

import torch

from portside.cli import main
from portside.contract import KVCacheSpec, LatentKVCacheSpec
from portside.engine.kv_report import CacheReport, cache_report
from portside.testing.tiny_deepseek import write_deepseek_v2_lite_config

BUDGET = 8 * 2**30
SEQ = 4096
LAYERS, HEADS, LATENT, ROPE, NOPE, V = 27, 16, 512, 64, 128, 128


def test_v2_lite_shaped_latent_cache_holds_over_5x_the_tokens(tmp_path):
    mla = cache_report(write_deepseek_v2_lite_config(tmp_path / "v2"), torch.bfloat16)
    assert isinstance(mla.kv, LatentKVCacheSpec) and mla.state is None
    assert (mla.kv.num_layers, mla.kv.num_kv_heads, mla.kv.latent_dim, mla.kv.rope_dim) == (LAYERS, 1, LATENT, ROPE)
    assert mla.bytes_per_token == LAYERS * (LATENT + ROPE) * 2  # 30.4 KiB: one bf16 row per layer
    # the same model caching full multi-head K and V: every head's key (nope + rope) and value, in
    # rows of the key's width (V padded, as a paged K/V cache holds them) ...
    full = CacheReport(mla.architecture, LAYERS, KVCacheSpec(LAYERS, HEADS, NOPE + ROPE, torch.bfloat16), None)
    assert full.bytes_per_token == 2 * LAYERS * HEADS * (NOPE + ROPE) * 2
    ratio = mla.tokens(BUDGET) / full.tokens(BUDGET)
    assert ratio >= 5, ratio  # 10.7x: 276k tokens against 25.9k in 8 GiB
    assert mla.sequences(BUDGET, SEQ) >= 5 * full.sequences(BUDGET, SEQ)
    # ... or unpadded (key 192 + value 128 values per head): still 8.9x
    unpadded = LAYERS * HEADS * (NOPE + ROPE + V) * 2
    assert unpadded / mla.bytes_per_token >= 5


def test_portside_devices_reports_the_latent_cache(tmp_path, capsys):
    """`portside devices --model` through the CLI's entry point in this process (test_cli runs
    `portside devices` as a subprocess; another interpreter here cost ~10 s of imports on CI)."""
    path = write_deepseek_v2_lite_config(tmp_path / "v2")
    code = main(["devices", "--model", str(path), "--max-model-len", "4096", "--kv-cache-memory", str(BUDGET)])
    out = capsys.readouterr()
    assert code == 0, out.err
    tokens = BUDGET // (LAYERS * (LATENT + ROPE) * 2)
    assert "latent attention (MLA): 27 layers, one row of 512 latent + 64 rotary values per token, 30.4 KiB per token" \
        in out.out, out.out
    assert f"hold {tokens} tokens" in out.out, out.out
    assert f"hold {BUDGET // (SEQ * LAYERS * (LATENT + ROPE) * 2)} sequences of 4096 tokens" in out.out


def test_portside_devices_refuses_an_8bit_latent_cache(tmp_path, capsys):
    path = write_deepseek_v2_lite_config(tmp_path / "v2")
    code = main(["devices", "--model", str(path), "--kv-cache-dtype", "fp8"])
    out = capsys.readouterr()
    assert code == 2, (out.out, out.err)
    assert "multi-head latent attention (MLA)" in out.err and "--kv-cache-dtype auto" in out.err


def test_v3_shaped_latent_cache(tmp_path):
    """DeepSeek-V3's shapes (61 layers, 128 heads, the same 512 + 64 row): 68.6 KiB a token, 85x
    less than 128 heads of K and V would take."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=3,
        num_experts_per_tok=8, n_group=8, topk_group=4, num_nextn_predict_layers=1)  # fmt: skip
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(str(tmp_path / "v3"))
    mla = cache_report(tmp_path / "v3", torch.bfloat16)
    assert mla.bytes_per_token == 61 * 576 * 2
    full = KVCacheSpec(61, 128, NOPE + ROPE, torch.bfloat16)
    assert full.bytes_per_token // mla.bytes_per_token == 85
