"""GGUF checkpoints (llama.cpp): convert a llama-architecture .gguf file into a Hugging Face
folder (config.json, safetensors, tokenizer) that the ordinary loader reads.

llama.cpp's converter permutes the rows of the q and k projections (it pairs rotary dimensions
as interleaved neighbours, Hugging Face pairs the first half with the second); `convert_gguf`
undoes that, so the folder is exactly what Hugging Face would have shipped (up to quantization).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["convert_gguf", "resolve_model_path", "hf_name", "permute_qk", "unpermute_qk", "gguf_cache_dir"]

log = logging.getLogger(__name__)

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
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
_SKIP = {"rope_freqs.weight"}  # llama3 rope factors: recomputed from the config instead
_CONVERTED_MARK = "portside-converted.json"


def hf_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> Hugging Face name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``). Raises ValueError for names it does not know."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r} for the llama architecture")


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


def _hf_config(meta: dict[str, Any], vocab_size: int, tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; portside converts 'llama' GGUF files")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    theta = _f32_to_decimal(get("rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if get("rope.scaling.type") == "linear":
        rope = {"rope_type": "linear", "rope_theta": theta, "factor": float(get("rope.scaling.factor", 1.0))}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": _f32_to_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,  # transformers 4.x
        "rope_scaling": None if rope["rope_type"] == "default" else rope,  # transformers 4.x
        "rope_parameters": rope,  # transformers 5.x
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _read_tensors(reader: Any, n_head: int, n_head_kv: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize
    from tqdm import tqdm

    out: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not sys.stderr.isatty(), leave=False):
        if t.name in _SKIP:
            continue
        name = hf_name(t.name)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)  # [rows, cols] (HF order)
        if ".q_proj." in name:
            w = unpermute_qk(w, n_head)
        elif ".k_proj." in name:
            w = unpermute_qk(w, n_head_kv)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)  # copy: the reader is read-only
    return out


def _save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Convert a llama-architecture GGUF file into a HF folder at `out_dir` (config.json,
    generation_config.json, model.safetensors in `dtype`, tokenizer files); returns `out_dir`.

    Quantized tensors (Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantized with `gguf.quants`.
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    meta = _fields(reader)
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = int(embd.shape[-1])  # GGUF shapes are [cols, rows]
    config = _hf_config(meta, vocab_size, tied="output.weight" not in names, dtype=dtype)
    tensors = _read_tensors(reader, config["num_attention_heads"], config["num_key_value_heads"], dtype)

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _save_tokenizer(gguf_path, out_dir, meta.get("tokenizer.chat_template"))
    return out_dir


def _fingerprint(path: Path) -> str:
    """sha256 of the file's first MiB and its size: cheap, and changes when the file does."""
    h = hashlib.sha256()
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
        convert_gguf(path, tmp)
        (tmp / _CONVERTED_MARK).write_text(json.dumps({"source": str(path), "size": path.stat().st_size}))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
