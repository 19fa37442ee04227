"""Block-FP8 and MXFP4 checkpoints written from tiny HF folders by transformers' own quantizers.

- `write_fp8_block(src, dst, block=(bn, bk))`: every decoder linear of `src` (q/k/v/o, gate/up/down,
  the experts' projections) quantized by transformers' `Fp8Quantize` (the conversion transformers
  runs when it saves a ``FineGrainedFP8Config`` model: e4m3 weights and ``weight_scale_inv`` fp32
  [ceil(N/bn), ceil(K/bk)], one scale per bn x bk block), and the config's
  ``quantization_config`` from ``FineGrainedFP8Config(weight_block_size=...)``: the format
  DeepSeek-V3/R1 and Qwen3-FP8 ship. transformers runs it on cpu by dequantizing every block
  (``dequantize``), which is the oracle (`fp8_oracle`).
- `write_ct_fp8_block(src, dst, block, act_group)`: the same weights as llm-compressor's FP8_BLOCK
  scheme stores them (compressed-tensors ``float-quantized``, ``weight_scale`` per block,
  activations rounded to fp8 per token group), with a dense oracle folder.
- `write_mxfp4_experts(src, dst)`: a gpt-oss folder whose experts (``mlp.experts.gate_up_proj``
  [E, hidden, 2I], ``down_proj`` [E, I, hidden]) are stored as OpenAI's checkpoints store them,
  ``*_blocks`` uint8 [E, N, K/32, 16] (two e2m1 codes a byte, the even column in the low nibble)
  and ``*_scales`` uint8 [E, N, K/32] (e8m0: 2^(s - 127)), with ``Mxfp4Config``'s
  ``quantization_config``; transformers dequantizes them on cpu (``Mxfp4Config(dequantize=True)``,
  `mxfp4_oracle`). The codes are `portside.quant.mxfp4.quantize_mxfp4`'s (round to nearest).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from portside.quant.mxfp4 import quantize_mxfp4
from portside.quant.weight import FP4_VALUES

__all__ = ["write_fp8_block", "write_ct_fp8_block", "write_mxfp4_experts", "fp8_oracle", "mxfp4_oracle", "oracle_greedy", "FP4_VALUES", "quantize_mxfp4", "tensor_bytes"]

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tensor_bytes(path: str | Path) -> int:
    """Bytes of every tensor in a folder's safetensors files (the checkpoint's tensor bytes)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = st.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * {"F8_E4M3": 1, "U8": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}[t.get_dtype()]
    return total


def _copy_folder(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))


def _load_all(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def write_fp8_block(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.bfloat16) -> Path:
    """`src`'s checkpoint in transformers' FP8 format with `block` (bn, bk) scales; the tensors
    left full precision (embeddings, norms, lm_head, routers) are stored in `dtype`. Every
    quantized weight's shape must be whole blocks (transformers' quantizer leaves the others
    unquantized, and its dequantizer refuses partial blocks)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    src, dst = Path(src), Path(dst)
    _copy_folder(src, dst)
    qc = FineGrainedFP8Config(weight_block_size=list(block))
    quantize = Fp8Quantize(type("Quantizer", (), {"quantization_config": qc})())
    out: dict[str, torch.Tensor] = {}
    for name, w in sorted(_load_all(src).items()):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in _LINEARS:
            if w.shape[0] % block[0] or w.shape[1] % block[1]:
                raise ValueError(f"{name} {tuple(w.shape)} is not whole {block} blocks; pick a smaller block")
            out |= quantize.convert({name: w})
        else:
            out[name] = w.to(dtype) if w.is_floating_point() else w
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {k: (v.value if hasattr(v, "value") else v) for k, v in qc.to_dict().items()}
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def write_ct_fp8_block(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128), act_group: int = 128,
                       dtype: torch.dtype = torch.bfloat16) -> tuple[Path, Path]:
    """`src`'s checkpoint as llm-compressor writes its FP8_BLOCK scheme (compressed-tensors
    ``float-quantized``: e4m3 ``weight`` and ``weight_scale`` [N/bn, K/bk] in `dtype` per decoder
    linear; the config group is compressed-tensors' own ``FP8_BLOCK`` preset with `block` and
    activations rounded to fp8 per token and `act_group` columns), and the dense oracle folder
    (``<dst>-oracle``: every weight its dequantized value, fp32) for transformers to run with the
    activation rounding hooked in; returns both."""
    from compressed_tensors.quantization import preset_name_to_scheme

    from portside.quant.fp8_block import quantize_fp8_block
    from portside.quant.weight import dequantize

    src, dst = Path(src), Path(dst)
    oracle = dst.parent / f"{dst.name}-oracle"
    _copy_folder(src, dst)
    _copy_folder(src, oracle)
    out: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, w in sorted(_load_all(src).items()):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in _LINEARS:
            qw = quantize_fp8_block(w, block)
            scale = qw.scales.to(dtype)
            out[name], out[f"{module}.weight_scale"] = qw.qweight, scale
            qw.scales = scale.float()  # the oracle's weights are the stored scales' values
            dense[name] = dequantize(qw)
        else:
            out[name] = w.to(dtype) if w.is_floating_point() else w
            dense[name] = out[name].float() if w.is_floating_point() else w  # the stored (rounded) values
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).model_dump()
    scheme["weights"]["block_structure"] = list(block)
    scheme["input_activations"]["group_size"] = act_group
    cfg: dict[str, Any] = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "quantization_status": "compressed", "config_groups": {"group_0": scheme},
                                  "ignore": ["lm_head"], "kv_cache_scheme": None}
    (oracle / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}
                                                   | {"dtype": "float32"}, indent=2))
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, oracle


def write_mxfp4_experts(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A gpt-oss folder `src` (transformers' ``GptOssForCausalLM`` layout) with its experts'
    ``gate_up_proj`` / ``down_proj`` stored in MXFP4 blocks and scales as OpenAI ships them; the
    rest (attention, router, biases, sinks, embeddings) in `dtype`."""
    from transformers import Mxfp4Config

    src, dst = Path(src), Path(dst)
    _copy_folder(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, w in sorted(_load_all(src).items()):
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            # transformers keeps [E, K, N] (x @ W); the checkpoint stores rows of N
            blocks, scales = quantize_mxfp4(w.transpose(-1, -2))
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
        else:
            out[name] = w.to(dtype) if w.is_floating_point() else w
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg: dict[str, Any] = json.loads((src / "config.json").read_text())
    qc = Mxfp4Config(modules_to_not_convert=["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                             "model.embed_tokens", "lm_head"])
    cfg["quantization_config"] = {k: (v.value if hasattr(v, "value") else v) for k, v in qc.to_dict().items()}
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def fp8_oracle(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of a block-FP8 folder on cpu: ``FineGrainedFP8Config(dequantize=True)``
    (each weight times its blocks' scales, as transformers' `Fp8Dequantize` does), in `dtype`;
    its generation ignores EOS."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    cfg = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    qc = FineGrainedFP8Config(weight_block_size=cfg["weight_block_size"], dequantize=True)
    return _no_eos(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, quantization_config=qc).eval())


def _no_eos(model: Any) -> Any:
    """Greedy generation runs to max_new_tokens (as portside's ignore_eos), whatever the folder's
    generation_config says."""
    model.generation_config.eos_token_id = None
    return model


def mxfp4_oracle(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of an MXFP4 gpt-oss folder on cpu: ``Mxfp4Config(dequantize=True)``;
    its generation ignores EOS."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return _no_eos(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, quantization_config=Mxfp4Config(dequantize=True)).eval())


@torch.no_grad()
def oracle_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """An oracle model's (`fp8_oracle`, `mxfp4_oracle`) greedy continuation of each prompt, new
    tokens only, one prompt at a time."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, temperature=None, top_p=None, top_k=None)  # fmt: skip
        outs.append(out[0, len(p):].tolist())
    return outs
