"""How each GGUF architecture maps onto a Hugging Face one: llama.cpp's tensor names, the
architecture table, and the q/k row permutation llama.cpp's converter applies (and its inverse).

`portside.model.gguf_loader` undoes the converter with these; `portside.testing.tiny_gguf`
redoes it to write test files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ARCHS",
    "GGUF_ARCHITECTURES",
    "NORM_TOPK",
    "GgufArch",
    "arch_key",
    "hf_name",
    "permute_qk",
    "unpermute_qk",
]

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
class GgufArch:
    """How one GGUF architecture maps onto a Hugging Face one."""

    hf: str  # config.json "architectures"
    model_type: str
    block: dict[str, str]
    permuted: bool = False  # q/k rows in llama.cpp's interleaved rotary order
    norm_shift: float = 0.0  # what the converter added to every norm weight


ARCHS = {
    "llama": GgufArch("LlamaForCausalLM", "llama", _BLOCK, permuted=True),
    "qwen2": GgufArch("Qwen2ForCausalLM", "qwen2", _BLOCK),
    "qwen3": GgufArch("Qwen3ForCausalLM", "qwen3", _BLOCK | _QK_NORM),
    "qwen2moe": GgufArch("Qwen2MoeForCausalLM", "qwen2_moe", _BLOCK | _EXPERTS | _SHARED_EXPERT),
    "qwen3moe": GgufArch("Qwen3MoeForCausalLM", "qwen3_moe", _BLOCK | _QK_NORM | _EXPERTS),
    "olmoe": GgufArch("OlmoeForCausalLM", "olmoe", _BLOCK | _QK_NORM | _EXPERTS),
    "gemma2": GgufArch("Gemma2ForCausalLM", "gemma2", _BLOCK | _GEMMA, norm_shift=1.0),
    "gemma3": GgufArch("Gemma3ForCausalLM", "gemma3_text", _BLOCK | _QK_NORM | _GEMMA, norm_shift=1.0),
    "phi3": GgufArch("Phi3ForCausalLM", "phi3", _BLOCK | _PHI3),
}
GGUF_ARCHITECTURES = tuple(ARCHS)  # general.architecture values portside converts
ARCHS["mixtral"] = GgufArch("MixtralForCausalLM", "mixtral", _BLOCK | _MIXTRAL, permuted=True)  # llama + experts
# router renormalises its top-k weights: llama.cpp's fixed choice where the file does not say
NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "olmoe": False}


def arch_key(meta: dict[str, Any]) -> str:
    """The `ARCHS` key of a GGUF file's architecture ("mixtral" for llama with experts)."""
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
    block = ARCHS[arch].block
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
