"""MXFP4 mixture-of-experts checkpoints (``quant_method: mxfp4``: gpt-oss), written from tiny random
gpt-oss folders in OpenAI's layout (``*_blocks`` / ``*_scales``: `portside.testing.fp8_mxfp4_checkpoints`)
and kept in their e2m1 codes and e8m0 scales: greedy tokens equal transformers' run of the same
folder on cpu (``Mxfp4Config(dequantize=True)``: every block decoded to the model's dtype), alone
and batched, with chunked prefill, through the cpu backend's native kernel, its tiled torch path
and core's reference; two tensor-parallel ranks; the layout (nibble order, e8m0, gate/up
interleave) checked against transformers' own dequantizer; the kernels against the reference;
resident memory after load and generation within 1.3x the checkpoint's tensor bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from portside import LLM, SamplingParams
from portside.quant.config import QuantConfig
from portside.quant.mxfp4 import mxfp4_weight, quantize_mxfp4
from portside.quant.weight import FP4_VALUES, QuantWeight, dequantize, quantized_linear
from portside.testing.fp8_mxfp4_checkpoints import mxfp4_oracle, oracle_greedy, tensor_bytes, write_mxfp4_experts
from portside.testing.tiny_gpt_oss import make_tiny_gpt_oss

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64, dtype="float32")
PROMPTS = [[1, 5, 9, 33, 70], list(range(3, 23)), [7, 8, 9]]  # the second longer than the 8-token window


def _greedy(path: Path, prompts: list[list[int]] = PROMPTS, **kwargs) -> list[list[int]]:
    llm = LLM(model=str(path), **{**ENGINE, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


_ORACLES: dict[str, list[list[int]]] = {}


def _hf_greedy(path: Path, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """transformers' greedy tokens for the MXFP4 folder (its cpu dequantized run), in fp32."""
    key = f"{path}:{prompts}"
    if key not in _ORACLES:
        _ORACLES[key] = oracle_greedy(mxfp4_oracle(path), prompts, MAX_TOKENS)
    return _ORACLES[key]


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mxfp4")
    return write_mxfp4_experts(make_tiny_gpt_oss(root / "gpt-oss"), root / "gpt-oss-mxfp4")


# ---- the format ----------------------------------------------------------------------------------


def test_config_keeps_everything_but_the_experts_dense() -> None:
    qc = QuantConfig.resolve({"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}, None)
    assert qc is not None and qc.method == "mxfp4" and "e2m1" in qc.describe()
    assert qc.quantizes("model.layers.3.mlp.experts")
    assert not qc.quantizes("model.layers.3.self_attn.qkv_proj") and not qc.quantizes("model.layers.0.mlp.router")


def test_layout_matches_transformers_dequantizer() -> None:
    """Low nibble first, FP4 e2m1 table, 2^(s - 127): our reference decodes the blocks as
    transformers' `convert_moe_packed_tensors` does (which transposes to [E, K, N])."""
    from transformers.integrations.mxfp4 import FP4_VALUES as HF_FP4
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    assert tuple(HF_FP4) == FP4_VALUES
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(110, 135, (3, 40, 4), generator=gen, dtype=torch.int32).to(torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    w = QuantWeight("mxfp4", (40, 128), blocks.flatten(-2), bits=4, scales=scales, group_size=32)
    assert torch.equal(dequantize(w), theirs.transpose(1, 2))


def test_quantizer_rounds_to_the_nearest_value() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize_mxfp4(w)
    dense = dequantize(QuantWeight("mxfp4", (8, 64), blocks.flatten(-2), bits=4, scales=scales, group_size=32))
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)  # 2^e: e2m1's widest gap (4 -> 6) is 2 of them
    assert ((dense - w).abs() <= step + 1e-6).all()
    assert (dense.abs().unflatten(-1, (2, 32)).amax(-1) <= 6 * step[:, ::32]).all()


# ---- greedy parity with transformers -------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["native", "torch", "reference"])
def test_gpt_oss_mxfp4_matches_transformers(gpt_oss_mxfp4: Path, monkeypatch, kernels: str) -> None:
    """Every layer's experts in MXFP4 (stacked [E, 2I, hidden / 2] codes, the checkpoint's bytes),
    attention, router and biases dense; through each cpu path."""
    from portside.backends.cpu import block_quant, native_ops
    from portside.backends.cpu import quant as cpu_quant

    if kernels == "native" and native_ops.unavailable_reason() is not None:
        pytest.skip(f"native cpu kernels: {native_ops.unavailable_reason()}")
    if kernels == "torch":
        prepare = block_quant.prepare
        monkeypatch.setattr(block_quant, "prepare", lambda w, native: prepare(w, False))
    if kernels == "reference":
        monkeypatch.setattr(cpu_quant.CpuQuantOps, "prepare_quantized", lambda self, w: w)
        monkeypatch.setattr(cpu_quant.CpuQuantOps, "_expert_linear", lambda self, x, w, e: quantized_linear(x, w.expert(e)))
    llm = LLM(model=str(gpt_oss_mxfp4), **ENGINE)
    model = llm.engine.executor.runner.model
    weights = [m for m in model.modules() if isinstance(m, QuantWeight)]
    assert len(weights) == 2 * 4 and all(w.kind == "mxfp4" and w.qweight.dtype == torch.uint8 for w in weights)
    experts = model.model.layers[0].mlp.experts
    assert experts.quant13.qweight.shape == (8, 64, 32) and experts.quant2.qweight.shape == (8, 64, 16)
    layouts = {getattr(w.layout, "kernel", None) for w in weights}
    assert layouts == {"native" if kernels == "native" else "torch" if kernels == "torch" else None}
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _hf_greedy(gpt_oss_mxfp4)


@pytest.mark.slow
def test_gpt_oss_mxfp4_alone_and_chunked(gpt_oss_mxfp4: Path) -> None:
    want = _hf_greedy(gpt_oss_mxfp4)
    assert [_greedy(gpt_oss_mxfp4, [p])[0] for p in PROMPTS] == want
    assert _greedy(gpt_oss_mxfp4, max_num_batched_tokens=8, enable_chunked_prefill=True) == want


@pytest.mark.slow
def test_gpt_oss_mxfp4_preemption_and_prefix_cache_hits(gpt_oss_mxfp4: Path) -> None:
    """Prompts sharing 16 tokens (twice the sliding window) in a pool of 16 blocks of 4 with a
    10-token budget: later prompts hit the cached prefix, some sequences are preempted and
    recomputed, and every one still gives transformers' tokens."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(1, 300, (16,), generator=gen).tolist()
    prompts = [shared + torch.randint(1, 300, (n,), generator=gen).tolist() for n in (4, 10, 15, 8, 12)]
    llm = LLM(model=str(gpt_oss_mxfp4), **{**ENGINE, "block_size": 4, "num_kv_blocks": 16, "max_num_batched_tokens": 10,
                                           "max_model_len": 64})
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 16 and stats.num_preemptions > 0, stats
    assert [list(o.outputs[0].token_ids) for o in first + rest] == _hf_greedy(gpt_oss_mxfp4, prompts)


@pytest.mark.slow
def test_gpt_oss_mxfp4_wider_experts_and_tensor_parallel(tmp_path: Path) -> None:
    """16 experts of 64 (top-4), hidden 96: two ranks each take 32 intermediate rows of gate and
    up (de-interleaved) and one block of down's columns."""
    src = make_tiny_gpt_oss(tmp_path / "gpt-oss", hidden_size=96, intermediate_size=64, num_local_experts=16,
                            num_experts_per_tok=4, head_dim=24)
    q = write_mxfp4_experts(src, tmp_path / "gpt-oss-mxfp4")
    want = _hf_greedy(q)
    assert _greedy(q) == want
    assert _greedy(q, tensor_parallel_size=2) == want


def test_tensor_parallel_cutting_a_block_is_refused(gpt_oss_mxfp4: Path) -> None:
    """Intermediate 32 over two ranks is 16 columns of down_proj per rank: half a block."""
    with pytest.raises(Exception, match="whole blocks of 32"):
        LLM(model=str(gpt_oss_mxfp4), **{**ENGINE, "tensor_parallel_size": 2})


def test_bad_blocks_name_the_tensor(gpt_oss_mxfp4: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(gpt_oss_mxfp4, bad)
    t = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    t[name] = t[name].float()
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}.*expected uint8"):
        LLM(model=str(bad), **ENGINE)


# ---- kernels against the reference ---------------------------------------------------------------

SHAPES = [(1, 64, 64), (4, 256, 100), (9, 96, 130), (33, 320, 72)]


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_match_reference(path: str, dtype: torch.dtype) -> None:
    from portside.backends.cpu import block_quant, native_ops

    if path == "native" and native_ops.unavailable_reason() is not None:
        pytest.skip(f"native cpu kernels: {native_ops.unavailable_reason()}")
    gen = torch.Generator().manual_seed(4)
    for t, k, n in SHAPES:
        w = mxfp4_weight(torch.randn(n, k, generator=gen) * k**-0.5)
        x = torch.randn(t, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        want = quantized_linear(x, w, bias)
        block_quant.prepare(w, native=path == "native")
        assert w.layout.kernel == path
        got = block_quant.linear(x, w, w.qweight, w.scales, bias)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=f"{path} {t}x{k}x{n} {dtype}")


# ---- resident memory -----------------------------------------------------------------------------


@pytest.mark.slow
def test_resident_memory_stays_within_the_checkpoint(tmp_path: Path) -> None:
    """A fresh process loads an MXFP4 gpt-oss folder whose experts are most of its bytes (32
    experts of 256 over hidden 512, 4 layers) and generates: what grows with the model stays
    under 1.3x the checkpoint's tensor bytes (no dequantized copy of any expert)."""
    from portside.testing.resident import measure, resident_ratio

    shape = dict(hidden_size=512, intermediate_size=512, num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    q = write_mxfp4_experts(make_tiny_gpt_oss(tmp_path / "hf", **shape), tmp_path / "mxfp4")
    control_shape = {**shape, "intermediate_size": 32, "num_local_experts": 2, "num_experts_per_tok": 2}
    control = write_mxfp4_experts(make_tiny_gpt_oss(tmp_path / "hf-control", **control_shape), tmp_path / "control")
    # dtype bfloat16, the checkpoint's: on a CPU without native bf16 `auto` serves the dense tensors in fp32
    kw: dict[str, Any] = dict(prompt_len=256, max_tokens=32, llm_kwargs={"dtype": "bfloat16"})
    run, base = measure(q, **kw), measure(control, **kw)
    r = resident_ratio(run, tensor_bytes(q), base, tensor_bytes(control))
    assert run["kv_mib"] == base["kv_mib"], r
    assert run["weights_mib"] < 1.02 * r["tensor_mib"], r
    assert r["ratio"] < 1.3 and r["ratio_at_return"] < 1.3, r
