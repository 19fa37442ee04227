"""Architecture name -> model class, and `load_model`, the one call the model runner makes."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from portside.config import ModelConfig
from portside.contract import Communicator, ModelOps, SingleRankCommunicator
from portside.model.args import ModelArgs
from portside.model.gguf_loader import resolve_model_path
from portside.model.interface import CausalLM
from portside.model.loader import load_checkpoint
from portside.model.pipeline import pipeline_stages
from portside.quant.apply import finalize_quantized, prepare_model_for_format

__all__ = ["Architecture", "SUPPORTED_ARCHITECTURES", "architecture_needs", "format_architectures", "CausalLM", "model_class", "read_model_args", "load_model"]

@dataclass(frozen=True)
class Architecture:
    """One row of the registry: where the model class lives and what it needs of a platform."""

    module: str
    cls: str
    needs: tuple[str, ...] = ()  # attention features (portside.contract.ATTENTION_FEATURES), "moe", "recurrent", "latent",
    # "bidirectional" (an encoder-only model: whole prompts in one step, no KV cache)
    may_need: tuple[str, ...] = ("sliding_window",)  # only where a checkpoint's config asks for it


_LLAMA = ("portside.model.llama", "LlamaForCausalLM")
_WINDOW = ("sliding_window",)

# config.json "architectures" entry -> its model; imported only when used.
SUPPORTED_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(*_LLAMA, may_need=()),
    "MistralForCausalLM": Architecture(*_LLAMA),
    "Qwen2ForCausalLM": Architecture(*_LLAMA),
    "Qwen3ForCausalLM": Architecture("portside.model.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": Architecture("portside.model.qwen3", "Qwen3ForCausalLM", ("moe",)),
    "Qwen2MoeForCausalLM": Architecture(*_LLAMA, ("moe",)),
    "MixtralForCausalLM": Architecture("portside.model.mixtral", "MixtralForCausalLM", ("moe",)),
    "OlmoeForCausalLM": Architecture("portside.model.olmoe", "OlmoeForCausalLM", ("moe",), may_need=()),
    # partial rotary, q/k norms, dense first layers, grouped sigmoid-routed experts with shared experts
    "Glm4MoeForCausalLM": Architecture("portside.model.glm4_moe", "Glm4MoeForCausalLM", ("moe",), may_need=()),
    "Gemma2ForCausalLM": Architecture("portside.model.gemma", "Gemma2ForCausalLM", (*_WINDOW, "logit_softcap"), ()),
    "Gemma3ForCausalLM": Architecture("portside.model.gemma", "Gemma3ForCausalLM", _WINDOW, ("logit_softcap",)),
    "Phi3ForCausalLM": Architecture("portside.model.phi3", "Phi3ForCausalLM"),
    # learned attention sinks, alternating sliding / full layers, biased experts with a clamped SwiGLU
    "GptOssForCausalLM": Architecture("portside.model.gpt_oss", "GptOssForCausalLM", ("sinks", *_WINDOW, "moe"), ()),
    # multi-head latent attention (a latent KV cache), dense first layers, experts with shared experts
    "DeepseekV2ForCausalLM": Architecture("portside.model.deepseek", "DeepseekV2ForCausalLM", ("latent", "moe"), ()),
    "DeepseekV3ForCausalLM": Architecture("portside.model.deepseek", "DeepseekV3ForCausalLM", ("latent", "moe"), ()),
    # hybrids: Gated DeltaNet linear attention beside gated full attention
    "Qwen3NextForCausalLM": Architecture("portside.model.qwen3_next", "Qwen3NextForCausalLM", ("recurrent", "moe"), ()),
    "Qwen3_5ForCausalLM": Architecture("portside.model.qwen3_next", "Qwen3_5ForCausalLM", ("recurrent",), ()),
    "Qwen3_5MoeForCausalLM": Architecture("portside.model.qwen3_next", "Qwen3_5MoeForCausalLM", ("recurrent", "moe"), ()),
    # hybrids: Mamba-2 layers alone (Mamba2), beside attention layers (Bamba, Granite 4.0-H), and beside MLP and
    # expert blocks (Nemotron-H)
    "Mamba2ForCausalLM": Architecture("portside.model.mamba2", "Mamba2ForCausalLM", ("recurrent",), ()),
    "BambaForCausalLM": Architecture("portside.model.bamba", "BambaForCausalLM", ("recurrent",), ()),
    "GraniteMoeHybridForCausalLM": Architecture("portside.model.granite_h", "GraniteMoeHybridForCausalLM",
                                                ("recurrent", "moe"), ()),
    "NemotronHForCausalLM": Architecture("portside.model.nemotron_h", "NemotronHForCausalLM", ("recurrent", "moe"), ()),
    # hybrids: Mamba-1 layers beside attention layers, experts every few layers (Jamba)
    "JambaForCausalLM": Architecture("portside.model.jamba", "JambaForCausalLM", ("recurrent", "moe"), ()),
    # hybrids: attention and a Mamba-2 mixer side by side in every layer (Falcon-H1)
    "FalconH1ForCausalLM": Architecture("portside.model.falcon_h1", "FalconH1ForCausalLM", ("recurrent",), ()),
    # hybrids: gated short convolutions beside attention
    "Lfm2ForCausalLM": Architecture("portside.model.lfm2", "Lfm2ForCausalLM", ("recurrent",), ()),
    "Lfm2MoeForCausalLM": Architecture("portside.model.lfm2", "Lfm2MoeForCausalLM", ("recurrent", "moe"), ()),
    # vision-language models (portside.multimodal)
    "LlavaForConditionalGeneration": Architecture("portside.model.llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": Architecture("portside.model.llava", "LlavaNextForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": Architecture("portside.model.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    # decoder pooling models (--runner pooling): bare decoders (sentence-transformers folders) and classifiers
    **{name: Architecture("portside.model.lm_pooling", name) for name in (
        "LlamaModel", "Qwen2Model", "Qwen3Model", "LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
        "Qwen3ForSequenceClassification")},
    # encoder-only (pooling) models: bidirectional attention, no KV cache (portside.model.bert_base)
    "BertModel": Architecture("portside.model.bert", "BertModel", ("bidirectional",), ()),
    "BertForSequenceClassification": Architecture("portside.model.bert", "BertForSequenceClassification", ("bidirectional",), ()),
    "XLMRobertaModel": Architecture("portside.model.bert", "XLMRobertaModel", ("bidirectional",), ()),
    "XLMRobertaForSequenceClassification": Architecture("portside.model.bert", "XLMRobertaForSequenceClassification",
                                                        ("bidirectional",), ()),
    "ModernBertModel": Architecture("portside.model.modernbert", "ModernBertModel", ("bidirectional",), ()),
    "ModernBertForSequenceClassification": Architecture("portside.model.modernbert", "ModernBertForSequenceClassification",
                                                        ("bidirectional",), ()),
    "NomicBertModel": Architecture("portside.model.nomic_bert", "NomicBertModel", ("bidirectional",), ()),
}


def format_architectures() -> str:
    """The `portside models` table: every architecture, its model module and what it needs of a
    platform (in brackets: only where a checkpoint's config asks for it)."""
    rows = [("architecture", "model", "needs")]
    for name, a in sorted(SUPPORTED_ARCHITECTURES.items()):
        needs = [*a.needs, *(f"[{f}]" for f in a.may_need)]
        rows.append((name, a.module.removeprefix("portside.model."), ", ".join(needs) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[2] for r in rows)


def architecture_needs(architecture: str) -> tuple[str, ...]:
    """What the architecture needs of a platform ("recurrent": layers with a per-sequence state)."""
    a = SUPPORTED_ARCHITECTURES.get(architecture)
    return () if a is None else a.needs


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    a = SUPPORTED_ARCHITECTURES[architecture]
    return getattr(importlib.import_module(a.module), a.cls)


def read_model_args(folder: str | Path, max_model_len: int | None = None) -> ModelArgs:
    """`ModelArgs` from a HF folder's config.json (and generation_config.json for eos ids)."""
    from transformers import AutoConfig

    from portside.model.nomic_bert import read_nomic_config  # custom code in its repo, no transformers class

    hf = read_nomic_config(folder) or AutoConfig.from_pretrained(str(folder))
    archs = getattr(hf, "architectures", None) or []
    if not archs:
        raise ValueError(f"{folder}/config.json names no architecture; expected one of {sorted(SUPPORTED_ARCHITECTURES)}")
    model_class(archs[0])  # fail early with the list of supported ones
    return ModelArgs.from_hf(hf, folder, max_model_len)


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    comm: Communicator | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    ops: ModelOps | None = None,
    pp_rank: int = 0,
    pp_size: int = 1,
    pipeline_layers: tuple[int, ...] | None = None,
    mamba_ssm_cache_dtype: str = "auto",
) -> CausalLM:
    """Build the model for `model_config.path` (HF folder or .gguf file) on `device` in
    `model_config.dtype`, holding only this rank's tensor-parallel shard of its pipeline stage
    (`pp_rank` of `pp_size`, layers split by `pipeline_stages`), and load its weights.

    Parameters are allocated uninitialised on the device and filled straight from the
    checkpoint, so no full-model copy is made.
    """
    folder = resolve_model_path(model_config.path)
    args = dataclasses.replace(read_model_args(folder, model_config.max_model_len),
                               mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)
    from portside.model.lm_pooling import as_pooling_model  # decoder models served by the pooling runner

    cls = as_pooling_model(model_class(args.architecture), model_config.pooler)
    ops = ops or ModelOps()
    qc = model_config.quantization
    stage = None
    if pp_size > 1:
        stage = pipeline_stages(args.num_layers, pp_size, pipeline_layers)[pp_rank]
    with torch.device(device):
        try:
            model = cls(args, comm or SingleRankCommunicator(), tp_rank, tp_size, model_config.dtype, ops=ops,
                        **({"stage": stage} if stage is not None else {}))
        except AttributeError as e:  # an architecture's fields missing from the config (mismatched model_type)
            raise ValueError(
                f"{folder}: config.json names architecture {args.architecture!r}, but its fields are those of a "
                f"{getattr(args.hf_config, 'model_type', '?')!r} config, which {args.architecture} cannot be built "
                f"from ({e}); correct 'architectures' or 'model_type' in config.json") from None
        if qc is not None:  # the format's checkpoint tensors, on the device too
            prepare_model_for_format(model, qc, ops)
    load_checkpoint(model, folder)
    if qc is not None:
        try:
            finalize_quantized(model, qc, ops)
        except ValueError as e:
            raise ValueError(f"{folder}: {e}") from None
    # every class in SUPPORTED_ARCHITECTURES is a CausalLM (interface.py checks LlamaForCausalLM)
    return cast(CausalLM, model.eval())
