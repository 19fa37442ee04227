"""Tiny random-weight pooling models for tests, built locally by the libraries that define them:
a sentence-transformers folder (the library's own `save`: modules.json, 1_Pooling, 2_Dense,
Normalize, prompts) over a tiny decoder or encoder, and a transformers *ForSequenceClassification
decoder (a cross-encoder / reward model)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from portside.testing.tiny import make_tiny_model, widen_init
from portside.testing.tiny_tokenizer import make_tiny_tokenizer

__all__ = ["make_tiny_classifier", "make_tiny_st_folder"]


def make_tiny_st_folder(path: str | os.PathLike, base: str | os.PathLike | None = None, *, arch: str = "qwen3",
                        pooling_mode: str = "lasttoken", dense: tuple[int, ...] = (), dense_activation: str = "Tanh",
                        normalize: bool = True, prompts: dict[str, str] | None = None,
                        default_prompt_name: str | None = None, seed: int = 0) -> Path:
    """A sentence-transformers folder at `path`: the tiny model `base` (made from `arch` when
    None), its Pooling (`pooling_mode`: lasttoken, mean, cls, max), one Dense layer per size in
    `dense` (random weights; activation a torch.nn class name), Normalize, and `prompts` (with
    `default_prompt_name`)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    path = Path(path)
    if base is None:
        base = make_tiny_model(path.with_name(path.name + "-base"), arch, seed=seed)
    # plain text in, as folders saved before sentence-transformers 6 (which, for a tokenizer with a chat
    # template, saves a "message" modality and renders text through the template)
    text = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    transformer = Transformer(str(base), modality_config=text, module_output_name="token_embeddings")
    size = transformer.get_embedding_dimension()
    modules: list[Any] = [transformer, Pooling(size, pooling_mode=pooling_mode)]
    gen = torch.Generator().manual_seed(seed + 1)
    for out in dense:
        layer = Dense(size, out, activation_function=getattr(torch.nn, dense_activation)())
        with torch.no_grad():
            layer.linear.weight.copy_(torch.randn(out, size, generator=gen) / size**0.5)
            layer.linear.bias.copy_(0.1 * torch.randn(out, generator=gen))
        modules.append(layer)
        size = out
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, prompts=prompts or {}, default_prompt_name=default_prompt_name,
                        device="cpu").save(str(path))
    return path


def make_tiny_classifier(path: str | os.PathLike, arch: str = "qwen3", num_labels: int = 1, *, seed: int = 0,
                         id2label: dict[int, str] | None = None) -> Path:
    """A transformers `<Arch>ForSequenceClassification` with random weights (wide enough that
    the scores differ) and the tiny tokenizer."""
    import transformers

    from portside.testing.tiny import _hf_config

    path = Path(path)
    tok = make_tiny_tokenizer(path)
    config = _hf_config(arch, len(tok), tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"), {})
    config.num_labels = num_labels
    if id2label is not None:
        config.id2label = dict(id2label)
        config.label2id = {v: k for k, v in id2label.items()}
    config.architectures = [type(config).__name__.removesuffix("Config") + "ForSequenceClassification"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    widen_init(model, 0.25, seed)
    model.save_pretrained(str(path), safe_serialization=True)
    return path
