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

The architecture table and tensor names are `portside.model.gguf_arch`, the metadata ->
config.json mapping `portside.model.gguf_config`; this module reads the file, converts the
tensors, saves the folder and caches conversions.
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

from portside.model.gguf_arch import ARCHS, GGUF_ARCHITECTURES, arch_key, hf_name, permute_qk, unpermute_qk
from portside.model.gguf_config import hf_config, metadata

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

_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3 longrope: into the config
_SKIP = {"rope_freqs.weight", *_ROPE_FACTORS}  # rope factors: llama3's recomputed from the config, Phi-3's in it
_CONVERTED_MARK = "portside-converted.json"
_CONVERSION_FORMAT = "2: quantized tensors kept in blocks"  # 1: everything dequantized to fp32


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


def readable_types() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the GGML types served in their blocks, the others dequantized to float at load: those the
    `gguf` package decodes)."""
    import gguf.quants

    from portside.quant.gguf_blocks import GGML_TYPES

    decoded = getattr(gguf.quants, "_type_traits", {})
    return GGML_TYPES, tuple(t.name for t in decoded if t.name not in GGML_TYPES)


def _check_types(reader: Any) -> None:
    """ValueError naming the first tensor whose type portside cannot read (and how many more),
    listing the types it reads, before anything is converted."""
    blocks, dequantized = readable_types()
    bad = [t for t in reader.tensors if t.name not in _SKIP and t.tensor_type.name not in (*blocks, *dequantized)]
    if bad:
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise ValueError(f"GGUF tensor {bad[0].name!r} has type {bad[0].tensor_type.name}, which portside cannot read{more}; "
                         f"supported types: {', '.join(blocks)} (served in their blocks) and {', '.join(dequantized)} "
                         "(dequantized to float at load)")


def _read_tensors(
    reader: Any, key: str, n_head: int, n_head_kv: int, dtype: torch.dtype, dequantize: bool
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(HF name -> tensor, HF name -> {"type", "shape"} of those kept in blocks as uint8 rows;
    expert tensors are listed once, with "{e}" for the expert)."""
    from gguf.quants import dequantize as gguf_dequantize
    from tqdm import tqdm

    from portside.quant.gguf_blocks import GGML_TYPES, is_float_type

    spec = ARCHS[key]
    _check_types(reader)
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
    meta = metadata(reader)
    key = arch_key(meta)
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = int(embd.shape[-1])  # GGUF shapes are [cols, rows]
    factors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors if t.name in _ROPE_FACTORS}
    config = hf_config(meta, key, vocab_size, names, factors, dtype)
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
