"""GGUF files from tiny HF folders, written the way llama.cpp's converter (convert_hf_to_gguf.py)
writes them (`make_tiny_gguf`), so the GGUF loader is tested against what it will read."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from portside.model.gguf_arch import NORM_TOPK, permute_qk
from portside.testing.gguf_quants import K_QUANTS, quantize_k

__all__ = ["make_tiny_gguf"]

# HF architecture -> the GGUF architecture llama.cpp's converter writes it as
_GGUF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "OlmoeForCausalLM": "olmoe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}


def make_tiny_gguf(
    hf_dir: str | os.PathLike, out_path: str | os.PathLike, qtype: str = "F32",
    tensor_types: dict[str, str] | None = None,
) -> Path:
    """Write a GGUF file from a tiny HF folder the way llama.cpp's converter (convert_hf_to_gguf.py)
    does, for every architecture it writes (Mistral and Mixtral as "llama"); returns `out_path`.

    As the converter: llama.cpp tensor names (gguf's own name map), llama's q/k rows permuted for
    its rotary layout, each layer's experts stacked into one [E, rows, cols] tensor per
    projection, Gemma's norm weights stored as 1 + w, Phi-3's longrope factors as tensors, its
    metadata keys; 2-D+ weights as `qtype` ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", and the K-quants
    "Q4_K", "Q5_K", "Q6_K" through `portside.testing.gguf_quants`; norms, biases and routers stay
    F32; rows that are no whole number of blocks fall back to F16 as in the converter).
    `tensor_types` overrides the type per GGUF tensor kind, as llama.cpp's mixes do (Q4_K_M keeps
    ``{"attn_v": "Q6_K", "ffn_down": "Q6_K"}``). The tokenizer is written as "gpt2" (byte-level BPE) with the chat
    template. Raises ValueError for a config the file could not carry (what the converter drops
    and llama.cpp assumes otherwise, e.g. Gemma's query_pre_attn_scalar).
    """
    import gguf
    from safetensors.torch import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCHS.get(cfg["architectures"][0])
    if arch is None:
        raise ValueError(f"make_tiny_gguf writes {sorted(_GGUF_ARCHS)}, not {cfg['architectures'][0]!r}")
    dropped = _gguf_drops(cfg, arch)
    if dropped:
        raise ValueError(f"a {arch} GGUF file cannot carry {'; '.join(dropped)}")
    writer = gguf.GGUFWriter(str(out_path), arch)
    _write_gguf_params(writer, cfg, arch, qtype)
    _write_gguf_vocab(writer, hf_dir)
    for name, w in _gguf_tensors(cfg, arch, load_file(str(hf_dir / "model.safetensors"))):
        keep_f32 = w.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or "ffn_gate_inp" in name
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        wanted = "F32" if keep_f32 else (tensor_types or {}).get(kind, qtype)
        dtype = getattr(gguf.GGMLQuantizationType, wanted)
        try:
            if wanted in K_QUANTS:
                if w.shape[-1] % 256:
                    raise gguf.QuantError(f"{name}: {w.shape[-1]} columns")
                data = quantize_k(w, wanted)
            else:
                data = gguf.quants.quantize(w, dtype)
        except gguf.QuantError:  # rows not a multiple of the block: the converter falls back to F16
            dtype = gguf.GGMLQuantizationType.F16
            data = gguf.quants.quantize(w, dtype)
        writer.add_tensor(name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _gguf_drops(cfg: dict[str, Any], arch: str) -> list[str]:
    """What of `cfg` a GGUF file of `arch` does not carry, where llama.cpp assumes otherwise."""
    out = []
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    if arch in ("gemma2", "gemma3"):
        pattern, big = (2, layers == 46) if arch == "gemma2" else (6, layers == 62)
        scalar = hidden // heads if big else cfg["head_dim"]
        if cfg.get("query_pre_attn_scalar", scalar) != scalar:
            out.append(f"query_pre_attn_scalar {cfg['query_pre_attn_scalar']} (llama.cpp: {scalar})")
        types = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(layers)]
        if cfg.get("sliding_window") and cfg.get("layer_types", types) != types:
            out.append(f"layer_types {cfg['layer_types']} (llama.cpp: every {pattern}th layer global)")
    if arch == "gemma2" and not cfg.get("tie_word_embeddings"):
        out.append("an untied lm_head (the converter drops it)")
    if arch == "olmoe" and cfg["rms_norm_eps"] != 1e-5:
        out.append(f"rms_norm_eps {cfg['rms_norm_eps']} (the converter writes 1e-5)")
    if arch == "olmoe" and cfg.get("clip_qkv"):
        out.append(f"clip_qkv {cfg['clip_qkv']}")
    if arch in NORM_TOPK and bool(cfg.get("norm_topk_prob")) != NORM_TOPK[arch]:
        out.append(f"norm_topk_prob {cfg.get('norm_topk_prob')} (llama.cpp: {NORM_TOPK[arch]})")
    if arch == "llama" and cfg.get("sliding_window"):
        out.append(f"sliding_window {cfg['sliding_window']}")
    return out


def _write_gguf_params(writer: Any, cfg: dict[str, Any], arch: str, qtype: str) -> None:
    """The hyper-parameter keys the converter writes for `arch`."""
    import gguf

    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else cfg["rms_norm_eps"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if arch != "gemma2":
        writer.add_rope_freq_base(float(full.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    kind = full.get("rope_type")
    if kind in ("linear", "yarn") and arch not in ("gemma2", "phi3"):  # these two write their own keys
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(full["factor"])
    if kind == "yarn" and arch not in ("gemma2", "phi3"):
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        for key, add in (
            ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if full.get(key) is not None:
                add(full[key])
    if cfg.get("num_local_experts") or cfg.get("num_experts"):
        writer.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3" and cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        original = cfg.get("original_max_position_embeddings") or full["original_max_position_embeddings"]
        partial = full.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_dimension_count(int(partial * hidden) // heads)
        writer.add_sliding_window(cfg.get("sliding_window") or 0)  # 0: none
        if full.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    file_type = "ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}" + ("_M" if qtype in ("Q4_K", "Q5_K") else "")
    writer.add_file_type(gguf.LlamaFileType[file_type])


def _write_gguf_vocab(writer: Any, hf_dir: Path) -> None:
    import gguf

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template") or (
        (hf_dir / "chat_template.jinja").read_text() if (hf_dir / "chat_template.jinja").is_file() else None
    )
    if template:
        writer.add_chat_template(template)


_HF_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")


def _gguf_tensors(cfg: dict[str, Any], arch: str, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, Any]]:
    """(GGUF name, float32 array) for every tensor the converter writes, changed as it changes them."""
    import gguf
    import numpy as np

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg["num_hidden_layers"])

    def gguf_name(hf: str) -> str:
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf!r} in the {arch} architecture")
        return name

    experts: dict[str, dict[int, Any]] = {}
    for name, tensor in tensors.items():
        w = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            w = permute_qk(w, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            w = permute_qk(w, cfg["num_key_value_heads"])
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # llama.cpp's norm multiplies by the weight, Gemma's by 1 + weight
        m = _HF_EXPERT.fullmatch(name)
        if m:  # stacked once the layer's experts are all read: [E, rows, cols]
            experts.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = w
        else:
            yield gguf_name(name), w
    for name, parts in experts.items():
        yield gguf_name(name), np.stack([parts[e] for e in sorted(parts)])
    rope = cfg.get("rope_parameters") or {}
    if arch == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)
