"""Tiny random-weight encoder-only models (BERT, XLM-RoBERTa, ModernBERT and their
sequence-classification heads) as Hugging Face folders, built with transformers, with a tokenizer
that frames text as BERT does (``[CLS] a [SEP]``, pairs ``[CLS] a [SEP] b [SEP]`` with token
types 0 then 1), and the helpers that run portside's model on one step of packed prompts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from portside.testing.tiny_tokenizer import make_tiny_tokenizer

__all__ = ["ENCODER_ARCHS", "make_tiny_encoder", "make_tiny_nomic", "make_bert_tokenizer", "encoder_step_context",
           "load_encoder"]

# arch key -> (transformers config class, base architecture, classifier architecture)
ENCODER_ARCHS = {
    "bert": ("BertConfig", "BertModel", "BertForSequenceClassification"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForSequenceClassification"),
    "modernbert": ("ModernBertConfig", "ModernBertModel", "ModernBertForSequenceClassification"),
}


def make_bert_tokenizer(path: str | os.PathLike, token_types: bool = True) -> Any:
    """The tiny BPE tokenizer with [CLS] / [SEP] / [PAD] and BERT's framing of texts and pairs;
    with `token_types` (BERT) it returns token_type_ids, 1 for a pair's second text; without
    (XLM-R, ModernBERT, as their tokenizers) none, and pairs as RoBERTa joins them."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    base = make_tiny_tokenizer(path)
    base.add_special_tokens({"cls_token": "[CLS]", "sep_token": "[SEP]"})
    cls, sep = base.convert_tokens_to_ids("[CLS]"), base.convert_tokens_to_ids("[SEP]")
    backend = base.backend_tokenizer
    backend.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1" if token_types else "[CLS] $A [SEP] [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, cls_token="[CLS]", sep_token="[SEP]",
                                  pad_token="<|endoftext|>", model_max_length=512, clean_up_tokenization_spaces=False,
                                  model_input_names=["input_ids", "token_type_ids", "attention_mask"] if token_types
                                  else ["input_ids", "attention_mask"])
    (Path(path) / "chat_template.jinja").unlink(missing_ok=True)  # the base tokenizer's; BERT's have none
    tok.save_pretrained(str(path))
    return tok


def _init(model: torch.nn.Module, seed: int, std: float) -> None:
    """Weights wide enough that every layer matters; norms ~1, biases small."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name.lower():
                p.copy_((1.0 + 0.1 * noise) if name.endswith("weight") else 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embeddings" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(std * noise)


def make_tiny_encoder(path: str | os.PathLike, arch: str = "bert", *, classifier: bool = False, num_labels: int = 3,
                      seed: int = 0, init_std: float = 0.15, **overrides: Any) -> Path:
    """A tiny random-weight `arch` (`ENCODER_ARCHS`) folder at `path`: hidden 64, 4 heads, 2
    layers (ModernBERT: 4, global attention every 2nd, local window 8), intermediate 96, 128
    positions; with `classifier`, the ``*ForSequenceClassification`` model with `num_labels`."""
    import transformers

    path = Path(path)
    tok = make_bert_tokenizer(path, token_types=arch == "bert")
    config_cls, base, head = ENCODER_ARCHS[arch]
    kwargs: dict[str, Any] = dict(vocab_size=len(tok), hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                  intermediate_size=96, max_position_embeddings=128, pad_token_id=tok.pad_token_id)
    if arch == "bert":
        kwargs.update(type_vocab_size=2)
    elif arch == "xlm-roberta":
        kwargs.update(max_position_embeddings=130, type_vocab_size=1)
    elif arch == "modernbert":
        kwargs.update(num_hidden_layers=4, global_attn_every_n_layers=2, local_attention=8,
                      bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, cls_token_id=tok.cls_token_id,
                      sep_token_id=tok.sep_token_id)
    if classifier:
        kwargs.update(num_labels=num_labels)
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [head if classifier else base]
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).eval()
    _init(model, seed, init_std)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def load_encoder(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Any:
    """portside's model for the folder, on the CPU."""
    from portside.config import ModelConfig
    from portside.model.registry import load_model

    return load_model(ModelConfig(path=str(path), dtype=dtype, max_model_len=128), torch.device("cpu"))


def encoder_step_context(backend: Any, lengths: list[int], token_type_ids: list[list[int]] | None = None) -> Any:
    """A `ForwardContext` for one step holding whole prompts of `lengths` back to back (no cache),
    and the step's positions [T]."""
    from portside.contract import AttentionMetadata, ForwardContext

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.full((bounds[-1],), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(bounds, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.zeros((len(lengths), 1), dtype=torch.int32),
        max_query_len=max(lengths), max_seq_len=max(lengths), block_size=16,
        query_start_loc_cpu=bounds, seq_lens_cpu=list(lengths),
    )
    types = None if token_type_ids is None else torch.tensor([t for ts in token_type_ids for t in ts], dtype=torch.int64)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return ForwardContext(backend, [], md, token_type_ids=types), positions


def make_tiny_nomic(path: str | os.PathLike, *, seed: int = 0, rotary_emb_fraction: float = 1.0,
                    activation_function: str = "swiglu") -> Path:
    """A tiny random-weight NomicBERT folder as nomic's checkpoints are laid out (transformers has no
    class for it): config.json in nomic's spellings, tensors by nomic's names, the BERT tokenizer."""
    import json

    from safetensors.torch import save_file

    path = Path(path)
    tok = make_bert_tokenizer(path)
    h, inner, layers = 64, 96, 2
    cfg = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "auto_map": {
        "AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig"},
        "vocab_size": len(tok), "n_embd": h, "n_head": 4, "n_layer": layers, "n_inner": inner, "n_positions": 128,
        "layer_norm_epsilon": 1e-12, "rotary_emb_base": 1000, "rotary_emb_fraction": rotary_emb_fraction,
        "rotary_emb_interleaved": False, "rotary_scaling_factor": None, "type_vocab_size": 2, "qkv_proj_bias": False,
        "mlp_fc1_bias": False, "mlp_fc2_bias": False, "activation_function": activation_function, "prenorm": False,
        "causal": False, "pad_token_id": tok.pad_token_id}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.15, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=g)

    t = {"embeddings.word_embeddings.weight": rnd(len(tok), h, std=0.5),
         "embeddings.token_type_embeddings.weight": rnd(2, h, std=0.5),
         "emb_ln.weight": rnd(h, std=0.1, mean=1.0), "emb_ln.bias": rnd(h, std=0.1)}
    for i in range(layers):
        p = f"encoder.layers.{i}."
        t |= {p + "attn.Wqkv.weight": rnd(3 * h, h), p + "attn.out_proj.weight": rnd(h, h),
              p + "mlp.fc11.weight": rnd(inner, h), p + "mlp.fc12.weight": rnd(inner, h), p + "mlp.fc2.weight": rnd(h, inner)}
        for n in ("norm1", "norm2"):
            t |= {p + n + ".weight": rnd(h, std=0.1, mean=1.0), p + n + ".bias": rnd(h, std=0.1)}
    save_file(t, str(path / "model.safetensors"))
    return path
