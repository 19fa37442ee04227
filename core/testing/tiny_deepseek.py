"""DeepSeek-V2/V3 test models: tiny random-weight folders (transformers' own config classes and
modeling code draw the weights, `make_tiny_hybrid` widens and saves them), and the config of a
DeepSeek-V2-Lite-shaped model without weights (for the KV budget report).

`make_tiny_deepseek(path, "v3", q_lora_rank=24, kv_lora_rank=32, ...)`: the keyword arguments
override `TINY` (a dense two-layer model with 4 heads); pass ``first_k_dense_replace`` below
``num_hidden_layers`` for expert layers. `write_deepseek_fp8_block` stores a dense one's linear
layers (MLA's projections, kv_b_proj included, and the MLPs) as DeepSeek-V3 ships them: block-wise
FP8 by transformers' own quantizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from portside.testing.tiny_hybrid import make_tiny_hybrid

__all__ = ["TINY", "V2_LITE", "make_tiny_deepseek", "write_deepseek_fp8_block", "write_deepseek_v2_lite_config"]

TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32,
    q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=512,
    first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
)

# DeepSeek-V2-Lite's shapes: 27 layers, hidden 2048, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128
V2_LITE: dict[str, Any] = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, max_position_embeddings=163840, first_k_dense_replace=1, n_routed_experts=64,
    num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2,
)

_CONFIGS = {"v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"), "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}


def _spread_router(model: torch.nn.Module) -> None:
    """V3's router correction bias small and uneven (`widen_init` leaves buffers at zero)."""
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("e_score_correction_bias"):
            p.copy_(torch.linspace(-0.2, 0.3, p.numel()))


def make_tiny_deepseek(path: str | os.PathLike, version: str = "v2", seed: int = 0, **overrides: Any) -> Path:
    """A tiny DeepSeek-V2 ("v2") or -V3 ("v3") folder: `TINY` with `overrides`."""
    config_class, architecture = _CONFIGS[version]
    return make_tiny_hybrid(path, config_class, architecture, seed=seed, post_init=_spread_router, **{**TINY, **overrides})


def write_deepseek_v2_lite_config(path: str | os.PathLike) -> Path:
    """config.json of a DeepSeek-V2-Lite-shaped model (`V2_LITE`), no weights."""
    import transformers

    config = transformers.DeepseekV2Config(**V2_LITE)
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.save_pretrained(str(path))
    return Path(path)


def write_deepseek_fp8_block(src: str | os.PathLike, dst: str | os.PathLike, block: tuple[int, int] = (16, 16)) -> Path:
    """`src` (a dense tiny DeepSeek folder) with every ``*_proj`` weight in transformers' block-FP8
    format (`Fp8Quantize`: e4m3 weights, ``weight_scale_inv`` per `block`), the rest in bf16, and
    ``FineGrainedFP8Config``'s quantization_config. Every such weight must be whole blocks."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    qc = FineGrainedFP8Config(weight_block_size=list(block))
    quantize = Fp8Quantize(type("Quantizer", (), {"quantization_config": qc})())
    out: dict[str, torch.Tensor] = {}
    for name, w in sorted(load_file(str(src / "model.safetensors")).items()):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2].endswith(("_proj", "_proj_with_mqa")):
            if w.shape[0] % block[0] or w.shape[1] % block[1]:
                raise ValueError(f"{name} {tuple(w.shape)} is not whole {block} blocks")
            out |= quantize.convert({name: w})
        else:
            out[name] = w.to(torch.bfloat16) if w.is_floating_point() else w
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {k: (v.value if hasattr(v, "value") else v) for k, v in qc.to_dict().items()}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
