"""GGUF files of every architecture llama.cpp's converter writes, against transformers: a tiny HF
model -> `make_tiny_gguf` (the file convert_hf_to_gguf.py would write) -> portside's greedy
tokens on the .gguf equal transformers' on the original folder (exactly, in F32), and the
converted folder is one transformers itself loads. Quantized files: portside on the .gguf equals
transformers on the dequantized folder, whose weights are close to the originals.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.torch import load_file

from portside import LLM, SamplingParams
from portside.model.gguf_loader import convert_gguf, resolve_model_path
from portside.testing.tiny import hf_greedy, make_tiny_gguf, make_tiny_model

PROMPT = [12, 250, 31, 99, 8, 120, 64, 300, 45, 77, 390, 6, 7]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

# case -> (tiny arch, config overrides, the GGUF architecture it is written as). The overrides set
# what a GGUF file does not carry to what llama.cpp assumes (make_tiny_gguf refuses the rest).
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {}, "llama"),
    "mistral": ("mistral", {}, "llama"),
    "qwen2": ("qwen2", {}, "qwen2"),  # qkv bias
    "qwen3": ("qwen3", {}, "qwen3"),  # head_dim 32 != hidden / heads, q/k norms
    "qwen3_moe": ("qwen3_moe", {}, "qwen3moe"),
    "qwen2_moe": ("qwen2_moe", {}, "qwen2moe"),  # shared expert and its gate
    "mixtral": ("mixtral", {}, "llama"),  # llama + ffn_*_exps
    "olmoe": ("olmoe", {"rms_norm_eps": 1e-5, "clip_qkv": None}, "olmoe"),  # full-width q/k norms
    # soft-caps, window 8 on every other layer, tied embeddings (the converter drops lm_head)
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 24, "tie_word_embeddings": True}, "gemma2"),
    # every 6th layer global with its own rope base, q/k norms
    "gemma3": ("gemma3", {"num_hidden_layers": 6, "layer_types": None}, "gemma3"),
    "gemma3-linear-global": ("gemma3", {"num_hidden_layers": 6, "layer_types": None, "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100000.0}}}, "gemma3"),
    "qwen3-yarn": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 128}}, "qwen3"),
    "phi3": ("phi3", {}, "phi3"),  # fused qkv and gate_up
    "phi3-longrope-partial": ("phi3", {"max_position_embeddings": 2048, "original_max_position_embeddings": 512,
                                       "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 512, "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [2.0 + 0.5 * i for i in range(6)]}}, "phi3"),
}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTSIDE_CACHE", str(tmp_path / "cache"))


def _tiny(case: str, tmp_path: Path) -> Path:
    arch, overrides, _ = CASES[case]
    return make_tiny_model(tmp_path / case, arch, seed=5, **overrides)


def _portside_greedy(gguf_path: Path) -> list[int]:
    # max_model_len within Phi-3's original context: longrope's short factors, as transformers at this length
    llm = LLM(model=str(gguf_path), device="cpu", max_model_len=128, platform_options={"cpu_fused_decode": "off"})
    return llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _gguf_tensors(path: Path) -> tuple[str, dict[str, Any]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return reader.fields["general.architecture"].contents(), {t.name: t for t in reader.tensors}


# gemma3 (6 layers) under -m slow (CI): 6-8 s each on 2 cores
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("gemma3") else c for c in sorted(CASES)])
def test_f32_gguf_matches_transformers(case: str, tmp_path: Path) -> None:
    hf = _tiny(case, tmp_path)
    gguf_path = make_tiny_gguf(hf, tmp_path / f"{case}.gguf")
    arch, _ = _gguf_tensors(gguf_path)
    assert arch == CASES[case][2]
    expected = hf_greedy(hf, PROMPT, 12)
    assert _portside_greedy(gguf_path) == expected
    assert hf_greedy(resolve_model_path(gguf_path), PROMPT, 12) == expected  # a folder transformers loads


def test_files_are_laid_out_as_llama_cpp_reads_them(tmp_path: Path) -> None:
    """Tensor names of llama.cpp's tables, experts stacked [E, rows, cols] (GGUF order reversed),
    Gemma's norms as 1 + w, llama's q rows permuted, Phi-3's qkv and gate_up kept fused."""
    import gguf

    for case in ("mixtral", "qwen2_moe", "gemma3", "phi3-longrope-partial"):
        hf = _tiny(case, tmp_path)
        original = load_file(str(hf / "model.safetensors"))
        arch, tensors = _gguf_tensors(make_tiny_gguf(hf, tmp_path / f"{case}.gguf"))
        known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]}
        for name in tensors:
            assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.rsplit(".", 1)[0]) in known, name
        if case == "mixtral":
            gate = tensors["blk.1.ffn_gate_exps.weight"]
            assert list(gate.shape) == [64, 128, 4]  # ne: [hidden, intermediate, experts]
            w1 = original["model.layers.1.block_sparse_moe.experts.2.w1.weight"].numpy()
            np.testing.assert_array_equal(gate.data[2], w1)
            q = original["model.layers.0.self_attn.q_proj.weight"].numpy()
            assert not np.array_equal(tensors["blk.0.attn_q.weight"].data, q)
        elif case == "qwen2_moe":
            assert list(tensors["blk.0.ffn_down_exps.weight"].shape) == [64, 64, 4]
            assert {"blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_up_shexp.weight"} <= set(tensors)
        elif case == "gemma3":
            norm = original["model.layers.0.self_attn.q_norm.weight"].numpy()
            np.testing.assert_allclose(tensors["blk.0.attn_q_norm.weight"].data, norm + 1, rtol=0, atol=1e-6)
        else:
            assert list(tensors["blk.0.attn_qkv.weight"].shape) == [64, 128]
            assert list(tensors["blk.0.ffn_up.weight"].shape) == [64, 256] and "blk.0.ffn_gate.weight" not in tensors
            assert list(tensors["rope_factors_long.weight"].shape) == [6]


@pytest.mark.parametrize("case", ["qwen3_moe", "gemma2"])
def test_q8_0_gguf_is_dequantized_faithfully(case: str, tmp_path: Path) -> None:
    hf = _tiny(case, tmp_path)
    gguf_path = make_tiny_gguf(hf, tmp_path / f"{case}-q8.gguf", "Q8_0")
    _, tensors = _gguf_tensors(gguf_path)
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    folder = convert_gguf(gguf_path, tmp_path / "dequantized")  # what transformers loads (portside keeps the blocks)
    original, converted = load_file(str(hf / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        err = (converted[name] - tensor).abs().max().item()
        assert err <= 0.02 * tensor.abs().max().item(), (name, err)
    assert _portside_greedy(gguf_path) == hf_greedy(folder, PROMPT, 12)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'rwkv6' is not supported; portside converts llama, qwen2, .*phi3"):
        convert_gguf(path, tmp_path / "out")


def test_what_a_gguf_file_cannot_carry_is_refused(tmp_path: Path) -> None:
    hf = make_tiny_model(tmp_path / "gemma2", "gemma2")  # query_pre_attn_scalar 20 != head_dim 24, untied
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar 20 \(llama.cpp: 24\).*untied lm_head"):
        make_tiny_gguf(hf, tmp_path / "gemma2.gguf")
