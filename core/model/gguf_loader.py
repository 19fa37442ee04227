"""GGUF checkpoints (llama.cpp): convert a .gguf file into a Hugging Face folder (config.json,
safetensors, tokenizer) that the ordinary loader reads. The folder `resolve_model_path` caches
keeps quantized weights in their blocks (raw uint8 rows, served by `portside.quant.gguf`);
`convert_gguf` dequantizes them unless told not to (the embedded default model, transformers).

Architectures, as llama.cpp's converter (convert_hf_to_gguf.py) writes them: llama (Llama,
Mistral, and Mixtral: llama with stacked experts), qwen2, qwen3, qwen2moe, qwen3moe, olmoe,
gemma2, gemma3 and phi3. `convert_gguf` undoes what the converter changed, so the folder is what
Hugging Face would have shipped (up to quantization):

- llama's q and k rows are permuted (llama.cpp pairs rotary dimensions as interleaved
  neighbours, Hugging Face pairs the first half with the second); the others are not;
- each layer's experts are stacked into one [E, rows, cols] tensor per projection: split again;
- Gemma's norm weights are stored as 1 + w (Hugging Face keeps the offset w);
- hyper-parameters the converter leaves out are llama.cpp's: Gemma's attention scale and
  sliding-window layer pattern, the routers' top-k renormalisation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "GGUF_ARCHITECTURES",
    "convert_gguf",
    "resolve_model_path",
    "hf_name",
    "permute_qk",
    "unpermute_qk",
    "gguf_cache_dir",
]

log = logging.getLogger(__name__)

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# GGUF block tensor -> HF name under model.layers.{i}; "{e}": one tensor per expert (axis 0)
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_SHARED_EXPERT = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_MIXTRAL = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
}
_GEMMA = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3 = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # both fused, as in HF


@dataclass(frozen=True)
class _Arch:
    """How one GGUF architecture maps onto a Hugging Face one."""

    hf: str  # config.json "architectures"
    model_type: str
    block: dict[str, str]
    permuted: bool = False  # q/k rows in llama.cpp's interleaved rotary order
    norm_shift: float = 0.0  # what the converter added to every norm weight


_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", _BLOCK, permuted=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", _BLOCK),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", _BLOCK | _QK_NORM),
    "qwen2moe": _Arch("Qwen2MoeForCausalLM", "qwen2_moe", _BLOCK | _EXPERTS | _SHARED_EXPERT),
    "qwen3moe": _Arch("Qwen3MoeForCausalLM", "qwen3_moe", _BLOCK | _QK_NORM | _EXPERTS),
    "olmoe": _Arch("OlmoeForCausalLM", "olmoe", _BLOCK | _QK_NORM | _EXPERTS),
    "gemma2": _Arch("Gemma2ForCausalLM", "gemma2", _BLOCK | _GEMMA, norm_shift=1.0),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", _BLOCK | _QK_NORM | _GEMMA, norm_shift=1.0),
    "phi3": _Arch("Phi3ForCausalLM", "phi3", _BLOCK | _PHI3),
}
GGUF_ARCHITECTURES = tuple(_ARCHS)  # general.architecture values portside converts
_ARCHS["mixtral"] = _Arch("MixtralForCausalLM", "mixtral", _BLOCK | _MIXTRAL, permuted=True)  # llama + experts
# router renormalises its top-k weights: llama.cpp's fixed choice where the file does not say
_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "olmoe": False}
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3 longrope: into the config
_SKIP = {"rope_freqs.weight", *_ROPE_FACTORS}  # rope factors: llama3's recomputed from the config, Phi-3's in it
_CONVERTED_MARK = "portside-converted.json"
_CONVERSION_FORMAT = "2: quantized tensors kept in blocks"  # 1: everything dequantized to fp32


def _arch(meta: dict[str, Any]) -> str:
    """The `_ARCHS` key of a GGUF file's architecture ("mixtral" for llama with experts)."""
    name = meta.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported; portside converts {', '.join(GGUF_ARCHITECTURES)}"
        )
    return "mixtral" if name == "llama" and meta.get("llama.expert_count") else name


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """llama.cpp tensor name -> Hugging Face name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``) for GGUF architecture `arch` ("mixtral": llama
    with experts). Stacked experts keep an ``{e}`` for the expert. Raises ValueError for names
    it does not know."""
    block = _ARCHS[arch].block
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r} for the {arch} architecture")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: within each head, row pairs (i, i + D/2)
    become neighbours (2i, 2i + 1). w: [n_head * D, ...] (a weight or a bias)."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: back to the Hugging Face rotate-half row order."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _fields(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.model",
        ):
            continue  # large token tables: the tokenizer is built by transformers
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - unreadable extra metadata is not needed
            continue
    return out


def _f32_to_decimal(x: Any) -> float:
    """GGUF stores these as float32 (1e-5 reads back as 9.99999974e-06): restore the short form."""
    return float(f"{float(x):.7g}")


def _hf_config(
    meta: dict[str, Any], key: str, vocab_size: int, names: set[str], factors: dict[str, np.ndarray], dtype: torch.dtype
) -> dict[str, Any]:
    arch, spec = meta["general.architecture"], _ARCHS[key]

    def get(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    theta = _f32_to_decimal(get("rope.freq_base", 10000.0))
    rope = _rope(get, theta)
    cfg: dict[str, Any] = {
        "architectures": [spec.hf],
        "model_type": spec.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": _f32_to_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_output.bias" in names,
        "mlp_bias": "blk.0.ffn_down.bias" in names,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if get("expert_count"):
        cfg.update(_experts_config(key, get, cfg["intermediate_size"]))
    if get("attention.clamp_kqv"):
        cfg["clip_qkv"] = _f32_to_decimal(get("attention.clamp_kqv"))
    if key == "phi3":
        rope = _phi3_config(cfg, get, rope, factors)
    cfg["rope_theta"] = theta  # transformers 4.x
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope  # transformers 4.x
    cfg["rope_parameters"] = rope  # transformers 5.x
    if key in ("gemma2", "gemma3"):
        cfg.update(_gemma_config(key, get, cfg, rope))
    return cfg


def _rope(get: Any, theta: float) -> dict[str, Any]:
    """HF rope parameters from the rope.scaling.* keys (longrope: Phi-3's factors are tensors)."""
    kind = get("rope.scaling.type") or "none"
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if kind in ("linear", "yarn"):
        rope.update(rope_type=kind, factor=_f32_to_decimal(get("rope.scaling.factor", 1.0)))
    if kind == "yarn":
        rope["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
        for gguf_key, hf_key in (("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"), ("attn_factor", "attention_factor")):
            if get(f"rope.scaling.yarn_{gguf_key}") is not None:
                rope[hf_key] = _f32_to_decimal(get(f"rope.scaling.yarn_{gguf_key}"))
    elif kind not in ("none", "linear", "longrope"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (portside: none, linear, yarn, longrope)")
    return rope


def _experts_config(key: str, get: Any, ffn: int) -> dict[str, Any]:
    experts, top_k = int(get("expert_count")), int(get("expert_used_count"))
    if key == "mixtral":  # experts as wide as intermediate_size; the router always renormalises
        return {"num_local_experts": experts, "num_experts_per_tok": top_k, "sliding_window": None}
    width = int(get("expert_feed_forward_length", ffn))
    out: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": width,
        "norm_topk_prob": bool(get("expert_weights_norm", _NORM_TOPK[key])),
    }
    if key != "olmoe":  # Qwen-MoE: llama.cpp has experts in every layer (OLMoE's are intermediate_size wide)
        out.update(decoder_sparse_step=1, mlp_only_layers=[])
    if get("expert_shared_feed_forward_length"):
        out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    return out


def _gemma_config(key: str, get: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp reads (or assumes) for Gemma 2 / 3: sliding windows on all layers but every
    2nd / 6th, attention scaled by head_dim (hidden / heads for the 27B models), soft-caps."""
    layers = cfg["num_hidden_layers"]
    window = int(get("attention.sliding_window", 4096 if key == "gemma2" else 0)) or None
    pattern = get("attention.sliding_window_pattern", 2 if key == "gemma2" else 6)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    scale = get("attention.scale")
    if scale:
        scalar: float = _f32_to_decimal(scale) ** -2
    elif layers == {"gemma2": 46, "gemma3": 62}[key]:  # llama.cpp: the 27B models
        scalar = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        scalar = cfg["head_dim"]
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": window,
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in sliding],
        "attn_logit_softcapping": _optional(get("attn_logit_softcapping")),
        "final_logit_softcapping": _optional(get("final_logit_softcapping")),
    }
    if key == "gemma3":  # the sliding layers rotate with a base of their own, unscaled
        local = _f32_to_decimal(get("rope.freq_base_swa", 10000.0))
        out["rope_local_base_freq"] = local  # transformers 4.x
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return out


def _phi3_config(cfg: dict[str, Any], get: Any, rope: dict[str, Any], factors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Phi-3's window (0: none), partial rotary and longrope (factors stored as tensors); returns its rope."""
    head_dim = cfg["head_dim"]
    partial = int(get("rope.dimension_count", head_dim)) / head_dim
    original = get("rope.scaling.original_context_length")
    cfg.update(sliding_window=int(get("attention.sliding_window", 0)) or None, partial_rotary_factor=partial)
    if original:
        cfg["original_max_position_embeddings"] = int(original)
    rope = dict(rope, partial_rotary_factor=partial)
    if factors:
        rope.update(
            rope_type="longrope",
            long_factor=[float(f) for f in factors["rope_factors_long.weight"]],
            short_factor=[float(f) for f in factors["rope_factors_short.weight"]],
        )
        attn = get("rope.scaling.attn_factor")
        scale = cfg["max_position_embeddings"] / int(original)
        derived = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
        if attn is not None and abs(float(attn) - derived) > 1e-6:  # transformers derives the same by default
            rope["attention_factor"] = _f32_to_decimal(attn)
    return rope


def _optional(value: Any) -> float | None:
    return _f32_to_decimal(value) if value else None


# HF tensors that may stay in llama.cpp's blocks (the linear layers, experts, embedding, LM head);
# routers and anything else are dequantized
_KEEP_QUANTIZED = re.compile(r".*(_proj|\.w[123]|embed_tokens|lm_head)\.weight")


def _raw_rows(t: Any) -> np.ndarray:
    """A quantized GGUF tensor's bytes as uint8 [.., rows, row_bytes], checked against its type
    and shape (ValueError naming the tensor when the file is truncated or inconsistent)."""
    from portside.quant.gguf_blocks import row_bytes

    cols, lead = int(t.shape[0]), [int(d) for d in reversed(t.shape[1:])]  # GGUF shapes are [cols, rows, ..]
    try:
        width = row_bytes(int(t.tensor_type), cols)
    except ValueError as e:
        raise ValueError(f"GGUF tensor {t.name!r} ({t.tensor_type.name}, shape {list(t.shape)}): {e}") from None
    data = np.asarray(t.data)
    if data.dtype != np.uint8 or data.size != int(np.prod(lead)) * width or int(t.n_bytes) != data.size:
        raise ValueError(f"GGUF tensor {t.name!r} ({t.tensor_type.name}, shape {list(t.shape)}) has {data.nbytes} bytes, "
                         f"expected {int(np.prod(lead)) * width} (a truncated or inconsistent file)")
    return data.reshape(*lead, width)


def _read_tensors(
    reader: Any, key: str, n_head: int, n_head_kv: int, dtype: torch.dtype, dequantize: bool
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(HF name -> tensor, HF name -> {"type", "shape"} of those kept in blocks as uint8 rows;
    expert tensors are listed once, with "{e}" for the expert)."""
    from gguf.quants import dequantize as gguf_dequantize
    from tqdm import tqdm

    from portside.quant.gguf_blocks import GGML_TYPES, is_float_type

    spec = _ARCHS[key]
    out: dict[str, torch.Tensor] = {}
    kept: dict[str, dict[str, Any]] = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not sys.stderr.isatty(), leave=False):
        if t.name in _SKIP:
            continue
        name = hf_name(t.name, key)
        raw = not dequantize and t.tensor_type.name in GGML_TYPES and not is_float_type(int(t.tensor_type))
        raw = raw and len(t.shape) >= 2 and _KEEP_QUANTIZED.fullmatch(name) is not None
        if raw:
            w = _raw_rows(t)  # [.., rows, row_bytes]: row permutations work on whole rows
            kept[name] = {"type": t.tensor_type.name, "shape": [int(t.shape[1]), int(t.shape[0])]}
        else:
            try:
                w = np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32)  # [rows, cols] (HF order)
            except (ValueError, NotImplementedError) as e:
                raise ValueError(f"GGUF tensor {t.name!r} ({t.tensor_type.name}, shape {list(t.shape)}): {e}") from None
        if spec.permuted and ".q_proj." in name:
            w = unpermute_qk(w, n_head)
        elif spec.permuted and ".k_proj." in name:
            w = unpermute_qk(w, n_head_kv)
        if spec.norm_shift and t.name.endswith("norm.weight"):
            w = w - np.float32(spec.norm_shift)
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # HF's [1, hidden]
        parts = [(name.format(e=e), w[e]) for e in range(w.shape[0])] if "{e}" in name else [(name, w)]
        for part_name, part in parts:  # copy: the reader is read-only
            if raw:
                out[part_name] = torch.from_numpy(np.array(part, dtype=np.uint8))
            else:
                out[part_name] = torch.from_numpy(np.array(part, dtype=np.float32)).to(dtype)
    return out, kept


def _open(path: Path) -> Any:
    """A `gguf.GGUFReader` of `path`; a tensor whose data runs past the end of the file or whose
    shape is no whole number of its type's blocks raises ValueError naming it."""
    from gguf import GGUFReader

    class Reader(GGUFReader):  # builds the tensors one at a time, to name the one that fails
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            tensors: list[Any] = []
            for field in fields:
                try:
                    super()._build_tensors(start_offs, [field])
                except ValueError as e:
                    name = bytes(field.parts[1]).decode(errors="replace")
                    raise ValueError(f"GGUF tensor {name!r}: {e} (a truncated or inconsistent file)") from None
                tensors += self.tensors
            if len({t.name for t in tensors}) != len(tensors):
                raise ValueError("GGUF file names a tensor twice")
            self.tensors = tensors

    try:
        return Reader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def _save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError:  # transformers reads no config from this architecture (OLMoE): the generic class
        tok = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32, dequantize: bool = True
) -> Path:
    """Convert a GGUF file (an architecture of `GGUF_ARCHITECTURES`) into a HF folder at
    `out_dir` (config.json, generation_config.json, model.safetensors in `dtype`, tokenizer
    files); returns `out_dir`. Raises ValueError for any other architecture, and for a quantized
    tensor whose bytes do not fit its type and shape (naming it).

    `dequantize` (the default: a folder transformers loads as it is): quantized tensors (Q4_0,
    Q8_0, K-quants, ...) become `dtype`, through `gguf.quants`. Otherwise the linear layers',
    experts', embedding's and LM head's tensors in a block type portside reads
    (`portside.quant.gguf_blocks.GGML_TYPES`) stay as their raw uint8 rows [rows, row_bytes],
    listed in config.json's ``quantization_config`` (``quant_method: gguf``, ``tensors``: each
    one's type and [rows, cols]), which `portside.quant.gguf` serves without dequantizing.
    """
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open(gguf_path)
    meta = _fields(reader)
    key = _arch(meta)
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = int(embd.shape[-1])  # GGUF shapes are [cols, rows]
    factors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors if t.name in _ROPE_FACTORS}
    config = _hf_config(meta, key, vocab_size, names, factors, dtype)
    tensors, kept = _read_tensors(reader, key, config["num_attention_heads"], config["num_key_value_heads"], dtype, dequantize)
    if kept:
        config["quantization_config"] = {"quant_method": "gguf", "tensors": dict(sorted(kept.items()))}

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _save_tokenizer(gguf_path, out_dir, meta.get("tokenizer.chat_template"))
    return out_dir


def _fingerprint(path: Path) -> str:
    """sha256 of the file's first MiB and its size (cheap, and changes when the file does), and
    of the conversion's format (a new format never reuses an old conversion)."""
    h = hashlib.sha256(_CONVERSION_FORMAT.encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
    h.update(str(path.stat().st_size).encode())
    return h.hexdigest()[:16]


def gguf_cache_dir() -> Path:
    """Where converted GGUF folders live: ``$PORTSIDE_CACHE/converted`` or
    ``~/.cache/portside/converted``."""
    root = os.environ.get("PORTSIDE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "portside") / "converted"


def resolve_model_path(path: str | Path) -> Path:
    """A HF folder for `path`: the folder itself, or, for a .gguf file, its converted copy in
    the cache (converted on first use, reused afterwards)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return path
    if not path.is_file():
        raise FileNotFoundError(f"model path {path} does not exist (expected a HF folder or a .gguf file)")
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"model path {path} is a file but not a .gguf; pass a HF folder or a .gguf file")
    target = gguf_cache_dir() / f"{path.stem}-{_fingerprint(path)}"
    if (target / _CONVERTED_MARK).is_file():
        return target
    log.info("converting %s to a Hugging Face folder in %s (once)", path, target)
    print(f"portside: converting {path.name} (first use; cached in {target})", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        convert_gguf(path, tmp, dequantize=False)
        (tmp / _CONVERTED_MARK).write_text(json.dumps({"source": str(path), "size": path.stat().st_size,
                                                       "format": _CONVERSION_FORMAT}))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
