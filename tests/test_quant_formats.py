"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8) written from tiny random models with
the real tools' packing (`portside.testing.quant_checkpoints`), and ``--quantization int8|fp8`` at
load: portside's greedy tokens equal transformers' on the dequantized weights, batched and
across KV block boundaries; formats that also quantize activations are checked against
transformers with the same per-token rounding hooked into every quantized linear's input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from portside import LLM, SamplingParams
from portside.quant.config import QuantConfig
from portside.quant.weight import QuantParts, QuantWeight
from portside.testing.quant_checkpoints import FP8_MAX, write_quantized
from portside.testing.tiny import hf_greedy, make_tiny_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64)
PROMPTS = [[1, 5, 9, 33, 70], list(range(3, 23)), [7, 8, 9]]  # short, across a block boundary, tiny


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


@pytest.fixture(scope="module")
def qwen2_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:  # q/k/v biases, tied embeddings
    return make_tiny_model(tmp_path_factory.mktemp("qwen2") / "m", "qwen2", tie_word_embeddings=True)


def _greedy(path: Path, **kwargs) -> list[list[int]]:
    llm = LLM(model=str(path), **ENGINE, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


WEIGHT_ONLY = [
    ("gptq", dict(bits=4, group_size=32)),
    ("gptq", dict(bits=4, group_size=-1, sym=False)),
    ("gptq", dict(bits=8, group_size=16, desc_act=True, sym=False)),
    ("gptq", dict(bits=4, group_size=64, desc_act=True)),
    ("awq", dict(group_size=32, sym=False)),
    ("awq", dict(group_size=64)),
    ("ct-w4a16", dict(group_size=32)),
    ("ct-w4a16", dict(group_size=16, sym=False, desc_act=True)),
    ("ct-w8a16", dict(group_size=-1)),
]


@pytest.mark.parametrize(("fmt", "kw"), WEIGHT_ONLY, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for f, kw in WEIGHT_ONLY])
@pytest.mark.slow
def test_weight_only_formats_match_transformers_on_dequantized_weights(llama: Path, tmp_path: Path, fmt: str, kw: dict) -> None:
    q, oracle = write_quantized(llama, tmp_path / fmt, fmt, **kw)
    assert _greedy(q) == [hf_greedy(oracle, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.slow
def test_gptq_with_biases_and_tied_embeddings(qwen2_tied: Path, tmp_path: Path) -> None:
    q, oracle = write_quantized(qwen2_tied, tmp_path / "gptq", "gptq", bits=4, group_size=32, desc_act=True)
    assert _greedy(q) == [hf_greedy(oracle, p, MAX_TOKENS) for p in PROMPTS]


# ---- act order: every projection its own g_idx ------------------------------------------------------


@pytest.fixture(scope="module")
def llama_wide(tmp_path_factory: pytest.TempPathFactory) -> Path:  # hidden 128: 4 groups of 32 over q/k/v's input
    return make_tiny_model(tmp_path_factory.mktemp("llama_wide") / "m", "llama", hidden_size=128, intermediate_size=256)


_FUSED = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))


def _check_fused_act_order(llm: LLM, q: Path, apart: bool) -> list[QuantWeight]:
    """Each fused layer is one QuantWeight (`apart` False) or its parts (True), every part with
    its projection's g_idx and rows from the checkpoint and its codes still packed; returns the
    weights seen."""
    from safetensors.torch import load_file

    ckpt = load_file(str(q / "model.safetensors"))
    seen = []
    for i, layer in enumerate(llm.engine.executor.runner.model.model.layers):
        for fused, names in _FUSED:
            quant = layer.get_submodule(fused).quant
            parts = [f"model.layers.{i}.{n}" for n in names]
            if not apart:
                assert isinstance(quant, QuantWeight) and torch.equal(quant.g_idx, ckpt[f"{parts[0]}.g_idx"])
                seen.append(quant)
                continue
            assert isinstance(quant, QuantParts) and len(quant) == len(parts), f"layer {i} {fused}: {type(quant).__name__}"
            for w, name in zip(quant, parts, strict=True):
                assert torch.equal(w.g_idx, ckpt[f"{name}.g_idx"]), name
                assert w.out_features == ckpt[f"{name}.scales"].shape[1] and w.qweight.dtype == torch.uint8
                seen.append(w)
    return seen


@pytest.mark.parametrize("kernels", ["platform", "reference"])
def test_gptq_act_order_projections_with_their_own_g_idx(llama_wide: Path, tmp_path: Path, monkeypatch, kernels: str) -> None:
    """A 4-bit, group 32, desc_act checkpoint whose q/k/v and gate/up projections have different
    column orders (each projection's own random permutation, as nothing in the format ties them)
    loads with every fused part kept apart with its own g_idx, and gives transformers' greedy
    tokens on the dequantized weights: through the cpu platform's kernels (native, act order
    sorted per part), and with every layer on core's reference."""
    from portside.backends.cpu import native_ops
    from portside.backends.cpu import quant as cpu_quant

    if kernels == "reference":
        monkeypatch.setattr(cpu_quant, "isa", lambda: "")  # prepare_quantized leaves every layer on the reference
    q, oracle = write_quantized(llama_wide, tmp_path / "gptq", "gptq", bits=4, group_size=32, desc_act=True)
    llm = LLM(model=str(q), **ENGINE)
    parts = _check_fused_act_order(llm, q, apart=True)
    layouts = {getattr(w.layout, "kernel", None) for w in parts}
    if kernels == "platform" and native_ops.unavailable_reason() is None and cpu_quant.isa():
        assert layouts == {"int4"} and all(w.layout.permuted for w in parts)
    elif kernels == "reference":
        assert layouts == {None}
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(oracle, p, MAX_TOKENS) for p in PROMPTS]


ACT_ORDER = [
    ("gptq", dict(bits=4, group_size=64)),
    ("gptq", dict(bits=8, group_size=32, sym=False)),
    ("gptq", dict(bits=4, group_size=16)),
    ("gptq", dict(bits=4, group_size=32, shared_act_order=True)),  # the parts agree: one fused weight
    ("ct-w4a16", dict(group_size=32)),
]


@pytest.mark.parametrize(("fmt", "kw"), ACT_ORDER, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for f, kw in ACT_ORDER])
@pytest.mark.slow
def test_act_order_checkpoints_match_transformers(llama_wide: Path, tmp_path: Path, fmt: str, kw: dict) -> None:
    q, oracle = write_quantized(llama_wide, tmp_path / fmt, fmt, desc_act=True, **kw)
    llm = LLM(model=str(q), **ENGINE)
    if fmt == "gptq":
        _check_fused_act_order(llm, q, apart=not kw.get("shared_act_order", False))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(oracle, p, MAX_TOKENS) for p in PROMPTS]


# ---- activations quantized per token ------------------------------------------------------------


def _round_activations(x: torch.Tensor, mode: str, static_scale: float | None) -> torch.Tensor:
    """What an int8 / fp8 kernel sees of x (written independently of portside's reference)."""
    qmax = 127.0 if mode == "int8" else FP8_MAX
    scale = torch.tensor(static_scale) if static_scale is not None else x.abs().amax(-1, keepdim=True).clamp(min=1e-12 * qmax) / qmax
    y = (x / scale).clamp(-qmax, qmax)
    y = y.round() if mode == "int8" else y.to(torch.float8_e4m3fn).float()
    return y * scale


@torch.no_grad()
def _hf_greedy_rounded(oracle: Path, prompt: list[int], mode: str) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32).eval()
    static = json.loads((oracle / "input_scales.json").read_text()) if (oracle / "input_scales.json").exists() else {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            # portside fuses q/k/v and gate/up: a static scale is the max over the fused parts (as vLLM)
            fused = [name.replace(name.rpartition(".")[2], p) for p in _fused_with(name.rpartition(".")[2])]
            scale = max((static[f] for f in fused if f in static), default=None)
            module.register_forward_pre_hook(lambda m, args, s=scale: (_round_activations(args[0], mode, s),))
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                         pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


def _fused_with(part: str) -> tuple[str, ...]:
    if part in ("q_proj", "k_proj", "v_proj"):
        return ("q_proj", "k_proj", "v_proj")
    if part in ("gate_proj", "up_proj"):
        return ("gate_proj", "up_proj")
    return (part,)


ACT_QUANT = [
    ("ct-w8a8", dict(), "int8"),
    ("ct-fp8", dict(), "fp8"),
    ("ct-fp8", dict(static=True), "fp8"),
    ("fp8", dict(), "fp8"),
    ("fp8", dict(static=True), "fp8"),
]


@pytest.mark.parametrize(("fmt", "kw", "mode"), ACT_QUANT, ids=[f"{f}{'-static' if kw else ''}" for f, kw, _ in ACT_QUANT])
@pytest.mark.slow
def test_activation_quantized_formats(llama: Path, tmp_path: Path, fmt: str, kw: dict, mode: str) -> None:
    q, oracle = write_quantized(llama, tmp_path / fmt, fmt, **kw)
    assert _greedy(q) == [_hf_greedy_rounded(oracle, p, mode) for p in PROMPTS]


# ---- quantized while loading ----------------------------------------------------------------------


def _write_online_oracle(src: Path, dst: Path, method: str) -> Path:
    """`src` with every decoder linear rounded per output channel the way --quantization does."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in tensors.items():
        if name.endswith("proj.weight") or ".experts." in name:
            qmax = FP8_MAX if method == "fp8" else 127.0
            scale = (w.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-12)
            q = (w / scale).to(torch.float8_e4m3fn).float() if method == "fp8" else (w / scale).round().clamp(-127, 127)
            tensors[name] = q * scale
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_online_int8_weight_only(llama: Path, tmp_path: Path) -> None:
    oracle = _write_online_oracle(llama, tmp_path / "oracle", "int8")
    assert _greedy(llama, quantization="int8") == [hf_greedy(oracle, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_online_with_quantized_activations(llama: Path, tmp_path: Path, method: str) -> None:
    oracle = _write_online_oracle(llama, tmp_path / "oracle", method)
    kwargs = dict(quantization=method, quantized_activations=method) if method == "int8" else dict(quantization="fp8")
    assert _greedy(llama, **kwargs) == [_hf_greedy_rounded(oracle, p, method) for p in PROMPTS]


@pytest.mark.slow
def test_online_int8_moe_experts(tmp_path: Path) -> None:
    moe = make_tiny_model(tmp_path / "moe", "qwen3_moe")
    oracle = _write_online_oracle(moe, tmp_path / "oracle", "int8")
    assert _greedy(moe, quantization="int8") == [hf_greedy(oracle, p, MAX_TOKENS) for p in PROMPTS]


def test_quantized_weights_take_less_memory(llama: Path, tmp_path: Path) -> None:
    q, _ = write_quantized(llama, tmp_path / "gptq", "gptq", bits=4, group_size=32)
    dense = LLM(model=str(llama), **ENGINE).engine.weight_bytes
    int4 = LLM(model=str(q), **ENGINE).engine.weight_bytes
    int8 = LLM(model=str(llama), quantization="int8", **ENGINE).engine.weight_bytes
    # the tiny model's embeddings and LM head (2 x 400 x 64 fp32) stay dense: compare the linears
    linears = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128) * 4  # q, o, k, v; gate, up, down; fp32 bytes
    assert dense - int8 >= 0.70 * linears  # int8: a quarter of fp32, plus per-channel scales
    assert dense - int4 >= 0.80 * linears  # int4: an eighth, plus per-group scales and zeros


# ---- configuration errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hf", "requested", "needle"),
    [
        (None, "gptq", "--quantization int8 or fp8"),
        ({"quant_method": "bitsandbytes"}, None, "not supported"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, None, "GEMM"),
        ({"quant_method": "gptq", "bits": 3}, None, "3 bits"),
        ({"quant_method": "gptq", "bits": 4}, "awq", "drop --quantization"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, None, "block-wise"),
        (None, "nf4", "not supported"),
    ],
)
def test_quantization_config_errors_name_the_fix(hf, requested, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        QuantConfig.resolve(hf, requested)


MOE = [("qwen3_moe", "gptq", dict(bits=4, group_size=16, desc_act=True)), ("mixtral", "awq", dict(group_size=16)),
       ("qwen2_moe", "ct-w4a16", dict(group_size=32, sym=False)), ("olmoe", "ct-w8a16", dict(group_size=-1))]


@pytest.mark.parametrize(("arch", "fmt", "kw"), MOE, ids=[f"{a}-{f}" for a, f, _ in MOE])
@pytest.mark.slow
def test_quantized_mixture_of_experts_checkpoints(tmp_path: Path, arch: str, fmt: str, kw: dict) -> None:
    """Every expert's gate/up/down quantized (as GPTQModel, AutoAWQ and llm-compressor write MoE
    models), the routers left in full precision: stacked quantized experts give transformers'
    tokens on the dequantized weights."""
    moe = make_tiny_model(tmp_path / "moe", arch)
    q, oracle = write_quantized(moe, tmp_path / fmt, fmt, **kw)
    assert _greedy(q) == [hf_greedy(oracle, p, MAX_TOKENS) for p in PROMPTS]


# ---- broken quantized tensors ---------------------------------------------------------------------


def _edit(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


BROKEN = [
    ("gptq", "truncated-qweight", lambda t: t.update({"model.layers.1.self_attn.o_proj.qweight": t["model.layers.1.self_attn.o_proj.qweight"][:-1]}),
     "model.layers.1.self_attn.o_proj.qweight"),
    ("gptq", "scales-of-another-group-size", lambda t: t.update({"model.layers.0.mlp.down_proj.scales": t["model.layers.0.mlp.down_proj.scales"].repeat(2, 1)}),
     "model.layers.0.mlp.down_proj.scales"),
    ("gptq", "qweight-not-int32", lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": t["model.layers.0.mlp.up_proj.qweight"].float()}),
     "model.layers.0.mlp.up_proj.qweight"),
    ("awq", "qzeros-wrong-packing", lambda t: t.update({"model.layers.0.self_attn.k_proj.qzeros": t["model.layers.0.self_attn.k_proj.qzeros"].repeat(1, 2)}),
     "model.layers.0.self_attn.k_proj.qzeros"),
    ("ct-w4a16", "missing-scale", lambda t: t.pop("model.layers.1.mlp.gate_proj.weight_scale"),
     "model.layers.1.mlp.gate_proj.weight_scale"),
]


@pytest.mark.parametrize(("fmt", "what", "edit", "tensor"), BROKEN, ids=[b[1] for b in BROKEN])
def test_broken_quantized_tensor_fails_at_load_naming_it(llama: Path, tmp_path: Path, fmt: str, what: str, edit, tensor: str) -> None:
    q, _ = write_quantized(llama, tmp_path / fmt, fmt, group_size=32)
    _edit(q, edit)
    with pytest.raises(ValueError, match=tensor.replace(".", r"\.")):
        LLM(model=str(q), **ENGINE)


@pytest.mark.slow
def test_broken_quantized_checkpoint_exits_2_from_the_cli(llama: Path, tmp_path: Path, capsys) -> None:
    import subprocess
    import sys

    from portside.cli import main

    q, _ = write_quantized(llama, tmp_path / "gptq", "gptq", group_size=32)
    _edit(q, BROKEN[1][2])
    proc = subprocess.run(
        [sys.executable, "-m", "portside.cli", "generate", "hi", "--raw", "--model", str(q), "--device", "cpu", "--max-tokens", "2"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "model.layers.0.mlp.down_proj.scales" in proc.stderr
    # the same entry point in this process (another interpreter costs ~10 s of imports on CI's 2 cores)
    code = main(["generate", "hi", "--raw", "--model", str(llama), "--device", "cpu", "--quantization", "gptq"])
    err = capsys.readouterr().err
    assert code == 2 and "--quantization int8 or fp8" in err, err[-2000:]


# ---- tensor parallelism ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "kw"), [("gptq", dict(bits=4, group_size=16, desc_act=True, sym=False)),
                                         ("awq", dict(group_size=16)), ("ct-fp8", dict(static=True))])
def test_tensor_parallel_quantized(llama: Path, tmp_path: Path, fmt: str, kw: dict) -> None:
    """Two ranks (gloo): column-parallel layers split packed output rows, row-parallel ones split
    packed input columns and their groups (act order: every group kept), fp8 per-part scales."""
    q, oracle = write_quantized(llama, tmp_path / fmt, fmt, **kw)
    want = _greedy(q)
    assert _greedy(q, tensor_parallel_size=2) == want
    if fmt != "ct-fp8":
        assert want == [hf_greedy(oracle, p, MAX_TOKENS) for p in PROMPTS]
