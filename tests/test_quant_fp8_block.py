"""Block-wise FP8 checkpoints (``quant_method: fp8``, ``weight_block_size``: DeepSeek-V3/R1,
Qwen3-FP8), written by transformers' own quantizer (`Fp8Quantize`, `FineGrainedFP8Config`) from
tiny random models (`portside.testing.fp8_mxfp4_checkpoints`), kept in their e4m3 codes and
block scales: greedy tokens equal transformers' run of the same folder on cpu (which dequantizes
every block: ``FineGrainedFP8Config(dequantize=True)``), alone and batched, through the cpu
backend's native kernel, its tiled torch path and core's reference; two tensor-parallel ranks;
shards that cut a block refused; the kernels against the reference; resident memory after load
and generation within 1.3x the checkpoint's tensor bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from portside import LLM, SamplingParams
from portside.quant.config import QuantConfig
from portside.quant.fp8_block import quantize_fp8_block
from portside.quant.weight import QuantWeight, dequantize, quantized_linear
from portside.testing.fp8_mxfp4_checkpoints import fp8_oracle, oracle_greedy, tensor_bytes, write_fp8_block
from portside.testing.tiny import make_tiny_model

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64, dtype="float32")
PROMPTS = [[1, 5, 9, 33, 70], list(range(3, 23)), [7, 8, 9]]


def _greedy(path: Path, prompts: list[list[int]] = PROMPTS, **kwargs) -> list[list[int]]:
    llm = LLM(model=str(path), **{**ENGINE, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


_ORACLES: dict[str, list[list[int]]] = {}


def _hf_greedy(path: Path, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """transformers' greedy tokens for the FP8 folder (its cpu dequantized run), in fp32."""
    key = f"{path}:{prompts}"
    if key not in _ORACLES:
        _ORACLES[key] = oracle_greedy(fp8_oracle(path), prompts, MAX_TOKENS)
    return _ORACLES[key]


@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    return write_fp8_block(make_tiny_model(root / "llama", "llama"), root / "llama-fp8", (32, 32))


# ---- configuration -------------------------------------------------------------------------------


def test_block_config_is_parsed_and_bad_ones_name_the_fix() -> None:
    qc = QuantConfig.resolve({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                              "fmt": "e4m3"}, None)  # DeepSeek-V3's quantization_config
    assert qc is not None and qc.block == (128, 128) and qc.act is None and "128x128 blocks" in qc.describe()
    for bad, needle in [({"weight_block_size": [128]}, "two positive integers"),
                        ({"weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme static"),
                        ({"weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt"),
                        ({"weight_block_size": [128, 128], "fmt": "e5m2"}, "e4m3 weights only"),
                        ({"weight_block_size": [128, 128], "modules_to_convert": ["embed_tokens"]}, "modules_to_convert")]:
        with pytest.raises(ValueError, match=needle):
            QuantConfig.resolve({"quant_method": "fp8", **bad}, None)


# ---- greedy parity with transformers -------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["native", "torch", "reference"])
def test_llama_block_fp8_matches_transformers(llama_fp8: Path, monkeypatch, kernels: str) -> None:
    """32x32 blocks over every projection (q/k/v and gate/up fused: each part whole blocks), the
    codes and scales kept as stored; through each cpu path."""
    from portside.backends.cpu import block_quant, native_ops
    from portside.backends.cpu import quant as cpu_quant

    if kernels == "native" and native_ops.unavailable_reason() is not None:
        pytest.skip(f"native cpu kernels: {native_ops.unavailable_reason()}")
    if kernels == "torch":
        prepare = block_quant.prepare
        monkeypatch.setattr(block_quant, "prepare", lambda w, native: prepare(w, False))
    if kernels == "reference":
        monkeypatch.setattr(cpu_quant.CpuQuantOps, "prepare_quantized", lambda self, w: w)
        monkeypatch.setattr(cpu_quant.CpuQuantOps, "quantized_linear",
                            lambda self, x, w, bias=None: quantized_linear(x, w, bias))
    llm = LLM(model=str(llama_fp8), **ENGINE)
    weights = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, QuantWeight)]
    assert len(weights) == 2 * 4 and all(w.kind == "fp8" and w.block == (32, 32) for w in weights)
    assert all(w.qweight.dtype == torch.float8_e4m3fn and w.scales.shape == (-(-w.shape[0] // 32), -(-w.shape[1] // 32))
               for w in weights)
    layouts = {getattr(w.layout, "kernel", None) for w in weights}
    assert layouts == {"native" if kernels == "native" else "torch" if kernels == "torch" else None}
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _hf_greedy(llama_fp8)


def test_fused_parts_are_loaded_block_for_block(llama_fp8: Path) -> None:
    """qkv_proj's scales are q's, k's and v's block rows one after the other, its codes theirs."""
    from safetensors.torch import load_file

    ckpt = load_file(str(llama_fp8 / "model.safetensors"))
    llm = LLM(model=str(llama_fp8), **ENGINE)
    qkv = llm.engine.executor.runner.model.model.layers[1].self_attn.qkv_proj.quant
    parts = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert torch.equal(qkv.scales, torch.cat([ckpt[f"{p}.weight_scale_inv"] for p in parts]))
    assert torch.equal(qkv.qweight.view(torch.uint8), torch.cat([ckpt[f"{p}.weight"] for p in parts]).view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "block", "shape"), [
    ("qwen3", (64, 32), dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)),
    ("llama", (128, 128), dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)),
    ("qwen3_moe", (32, 32), dict()),
], ids=["qwen3-64x32", "llama-128x128", "qwen3_moe-32x32"])
def test_block_fp8_shapes_match_transformers(tmp_path: Path, arch: str, block: tuple[int, int], shape: dict) -> None:
    """Other shapes and blocks, rectangular ones included (Qwen3's q/k norms; 128x128 as DeepSeek
    ships; a mixture of experts whose every expert is stored per block, the router dense), alone
    and batched (chunked prefill of a long prompt beside short ones)."""
    src = make_tiny_model(tmp_path / arch, arch, **shape)
    q = write_fp8_block(src, tmp_path / f"{arch}-fp8", block)
    want = _hf_greedy(q)
    assert _greedy(q) == want
    assert [_greedy(q, [p])[0] for p in PROMPTS] == want
    assert _greedy(q, max_num_batched_tokens=8, enable_chunked_prefill=True) == want


@pytest.mark.slow
def test_block_fp8_preemption_and_prefix_cache_hits(llama_fp8: Path) -> None:
    """Prompts sharing 16 tokens in a pool of 16 blocks of 4 with a 10-token budget: later
    prompts hit the cached prefix, some sequences are preempted and recomputed, and every one
    still gives transformers' tokens."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(1, 300, (16,), generator=gen).tolist()
    prompts = [shared + torch.randint(1, 300, (n,), generator=gen).tolist() for n in (4, 10, 15, 8, 12)]
    llm = LLM(model=str(llama_fp8), **{**ENGINE, "block_size": 4, "num_kv_blocks": 16, "max_num_batched_tokens": 10,
                                       "max_model_len": 64})
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 16 and stats.num_preemptions > 0, stats
    assert [list(o.outputs[0].token_ids) for o in first + rest] == _hf_greedy(llama_fp8, prompts)


# ---- tensor parallelism --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_tensor_parallel_block_fp8(tmp_path: Path, arch: str) -> None:
    """Two ranks: column-parallel layers take whole block rows, row-parallel ones whole block
    columns (16-row blocks: every rank's q, k, v, gate and up rows, and each expert's, are whole
    blocks)."""
    src = make_tiny_model(tmp_path / arch, arch)
    q = write_fp8_block(src, tmp_path / f"{arch}-fp8", (16, 32))
    assert _greedy(q, tensor_parallel_size=2) == _hf_greedy(q)


def test_tensor_parallel_shard_cutting_a_block_is_refused(llama_fp8: Path) -> None:
    """k_proj's 32 rows are one 32-row block; two ranks would each need half of it."""
    with pytest.raises(Exception, match="block boundaries"):
        LLM(model=str(llama_fp8), **{**ENGINE, "tensor_parallel_size": 2})


def test_bad_block_scales_name_the_tensor(llama_fp8: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(llama_fp8, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.0.mlp.down_proj.weight_scale_inv"] = t["model.layers.0.mlp.down_proj.weight_scale_inv"][:, :1].contiguous()
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_scale_inv.*one scale per 32x32 block"):
        LLM(model=str(bad), **ENGINE)


# ---- kernels against the reference ---------------------------------------------------------------

SHAPES = [(1, 96, 64, (32, 32)), (4, 256, 200, (128, 128)), (9, 192, 130, (64, 64)), (33, 384, 72, (128, 128)),
          (3, 128, 100, (48, 64))]


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_match_reference(path: str, dtype: torch.dtype) -> None:
    from portside.backends.cpu import block_quant, native_ops

    if path == "native" and native_ops.unavailable_reason() is not None:
        pytest.skip(f"native cpu kernels: {native_ops.unavailable_reason()}")
    gen = torch.Generator().manual_seed(3)
    for t, k, n, block in SHAPES:
        w = quantize_fp8_block(torch.randn(n, k, generator=gen) * k**-0.5, block)
        x = torch.randn(t, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        want = quantized_linear(x, w, bias)
        block_quant.prepare(w, native=path == "native")
        assert w.layout.kernel == path
        got = block_quant.linear(x, w, w.qweight, w.scales, bias)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=f"{path} {t}x{k}x{n} {block} {dtype}")


def test_reference_dequantizes_per_block() -> None:
    """W[n, k] = q[n, k] * scale[n // bn, k // bk], partial edge blocks included."""
    w = torch.randn(50, 70)
    qw = quantize_fp8_block(w, (16, 32))
    assert qw.scales.shape == (4, 3)
    dense = dequantize(qw)
    for n, k in [(0, 0), (17, 33), (49, 69), (31, 64)]:
        assert dense[n, k] == qw.qweight[n, k].float() * qw.scales[n // 16, k // 32]
    assert ((dense - w).abs() <= w.abs().amax() / 448 * 16).all()  # e4m3's step at the top of a block
    whole = quantize_fp8_block(torch.randn(3, 64, 96), (32, 32))  # whole blocks, stacked: the blockwise path
    scale = whole.scales.repeat_interleave(32, -2).repeat_interleave(32, -1)
    assert torch.equal(dequantize(whole), whole.qweight.float() * scale)


# ---- resident memory -----------------------------------------------------------------------------


@pytest.mark.slow
def test_resident_memory_stays_within_the_checkpoint(tmp_path: Path) -> None:
    """A fresh process loads a 128x128-block checkpoint (~20 MiB of tensors) and generates: what
    grows with the model (its rise, less the KV pool and the engine's fixed cost taken from a
    control model of the same architecture) stays under 1.3x the checkpoint's tensor bytes, the
    weights served as stored (no dequantized copy)."""
    from portside.testing.resident import measure, resident_ratio

    shape = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, max_position_embeddings=1024)
    q = write_fp8_block(make_tiny_model(tmp_path / "hf", "llama", **shape), tmp_path / "fp8", (128, 128))
    control_shape = {**shape, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4}
    control = write_fp8_block(make_tiny_model(tmp_path / "hf-control", "llama", **control_shape), tmp_path / "control", (128, 128))
    # dtype bfloat16, the checkpoint's: on a CPU without native bf16 `auto` serves the dense tensors in fp32
    kw: dict[str, Any] = dict(prompt_len=512, max_tokens=32, llm_kwargs={"dtype": "bfloat16"})
    run, base = measure(q, **kw), measure(control, **kw)
    r = resident_ratio(run, tensor_bytes(q), base, tensor_bytes(control))
    assert run["kv_mib"] == base["kv_mib"], r
    assert run["weights_mib"] < 1.02 * r["tensor_mib"], r  # served as stored
    assert r["ratio"] < 1.3 and r["ratio_at_return"] < 1.3, r


# ---- compressed-tensors FP8_BLOCK ----------------------------------------------------------------


def _round_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp8 e4m3 rounding of each token's groups of `group` columns (scale = the group's absolute
    maximum / 448), as compressed-tensors' dynamic group quantization of input activations."""
    g = x.float().unflatten(-1, (-1, group))
    scale = (g.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return ((g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).flatten(-2).to(x.dtype)


@torch.no_grad()
def _hf_greedy_group_rounded(oracle: Path, group: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # to max_new_tokens, as ignore_eos
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in (
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            module.register_forward_pre_hook(lambda m, args: (_round_groups(args[0], group),))
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=0, temperature=None, top_p=None, top_k=None)
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compressed_tensors_fp8_block(tmp_path: Path, arch: str) -> None:
    """llm-compressor's FP8_BLOCK layout (compressed-tensors' own preset, 32x32 blocks, activations
    rounded to fp8 per token and 32 columns): transformers on the dequantized weights with the same
    rounding hooked into every quantized linear's input gives the same greedy tokens. (Dense
    models: transformers 5's fused experts have no linear to hook the rounding into.)"""
    from portside.testing.fp8_mxfp4_checkpoints import write_ct_fp8_block

    q, oracle = write_ct_fp8_block(make_tiny_model(tmp_path / arch, arch), tmp_path / f"{arch}-ct", (32, 32), 32)
    llm = LLM(model=str(q), **ENGINE)
    weights = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, QuantWeight)]
    assert weights and all(w.block == (32, 32) and w.act == "fp8" and w.act_group == 32 for w in weights)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _hf_greedy_group_rounded(oracle, 32)
