"""A model folder read the way sentence-transformers reads it: `modules.json` lists the modules in
order (the transformer, then Pooling, Dense, Normalize...), each in its own sub-folder with a
`config.json` (Pooling's `pooling_mode` or the older `pooling_mode_*_tokens` flags, its
`include_prompt`; Dense's sizes, bias and activation, with its weights beside); the prompts
(instructions) are in `config_sentence_transformers.json`, and a cross-encoder's activation in
config.json's `sentence_transformers.activation_fn`."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

# sentence-transformers' pooling modes -> portside's pooling types
_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last", "max": "max"}
# the older flags, in the order sentence-transformers concatenates them
_LEGACY = (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"), ("pooling_mode_mean_tokens", "mean"),
           ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
           ("pooling_mode_weightedmean_tokens", "weightedmean"), ("pooling_mode_lasttoken", "lasttoken"))
# Dense activations (torch.nn class paths as sentence-transformers stores them) -> functions
ACTIVATIONS = {"Tanh": torch.tanh, "Identity": lambda x: x, "ReLU": torch.relu, "GELU": torch.nn.functional.gelu,
               "Sigmoid": torch.sigmoid, "SiLU": torch.nn.functional.silu}


@dataclass
class STFolder:
    """What a sentence-transformers folder configures (None / empty: the folder does not say)."""

    pooling_type: str | None = None
    include_prompt: bool = True
    dense: list[str] = field(default_factory=list)  # Dense module folders, in order
    dense_out: int | None = None  # the last Dense layer's out_features
    normalize: bool | None = None  # True: a Normalize module; None: no modules.json
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    cross_encoder_activation: str | None = None  # "sigmoid", "softmax" or "none", from config.json


def _json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) and not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON object")
    return data  # type: ignore[return-value]


def pooling_mode(folder: str, config: dict[str, Any]) -> str:
    """The one portside pooling type a Pooling module's config asks for; ValueError otherwise."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [m for key, m in _LEGACY if config.get(key)] or ["mean"]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else mode
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"{folder}/config.json: pooling mode {mode!r} is not supported; portside pools with one of "
                         f"{', '.join(_MODES)} (sentence-transformers' names)")
    return _MODES[mode]


def read_st_folder(path: str) -> STFolder:
    """The sentence-transformers configuration of the model folder `path` (an empty one without)."""
    out = STFolder()
    modules = _json(os.path.join(path, "modules.json"))
    if isinstance(modules, list):
        out.normalize = False
        for m in sorted(modules, key=lambda m: int(m.get("idx", 0))):
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            sub = os.path.join(path, str(m.get("path", "")))
            if os.path.relpath(sub, path).startswith(".."):
                raise ValueError(f"{path}/modules.json: module path {m.get('path')!r} leaves the model folder")
            cfg = _json(os.path.join(sub, "config.json")) or {}
            if kind == "Pooling":
                out.pooling_type = pooling_mode(sub, cfg)
                out.include_prompt = bool(cfg.get("include_prompt", True))
            elif kind == "Dense":
                if cfg.get("use_residual"):
                    raise ValueError(f"{sub}: a Dense module with use_residual is not supported")
                _activation(sub, cfg)  # named now: an unknown one fails at startup, not on the first request
                out.dense.append(sub)
                out.dense_out = int(cfg["out_features"])
            elif kind == "Normalize":
                out.normalize = True
            elif kind not in ("Transformer", "Dropout"):
                raise ValueError(f"{path}/modules.json: module {m.get('type')!r} is not supported (portside reads "
                                 "Transformer, Pooling, Dense and Normalize)")
    bert = _json(os.path.join(path, "sentence_bert_config.json"))
    if isinstance(bert, dict) and "message" in (bert.get("modality_config") or {}) \
            and "text" not in (bert.get("modality_config") or {}):
        raise ValueError(f"{path}/sentence_bert_config.json: the transformer takes chat messages only "
                         "(modality_config); portside embeds text")
    if isinstance(bert, dict) and "message" in (bert.get("modality_config") or {}):
        logger.warning("%s: sentence-transformers 6 renders text inputs through the chat template for this folder "
                       "(modality_config 'message'); portside embeds the text as given, as vLLM does", path)
    st = _json(os.path.join(path, "config_sentence_transformers.json"))
    if isinstance(st, dict):
        out.prompts = {str(k): str(v) for k, v in (st.get("prompts") or {}).items()}
        out.default_prompt_name = st.get("default_prompt_name") or None
    hf = _json(os.path.join(path, "config.json"))
    fn = ((hf or {}).get("sentence_transformers") or {}).get("activation_fn") if isinstance(hf, dict) else None
    if fn:
        name = str(fn).rsplit(".", 1)[-1]
        out.cross_encoder_activation = {"Sigmoid": "sigmoid", "Identity": "none", "Softmax": "softmax"}.get(name)
        if out.cross_encoder_activation is None:
            raise ValueError(f"{path}/config.json: cross-encoder activation {fn!r} is not supported; "
                             "portside applies Sigmoid, Softmax or Identity")
    return out


def _activation(folder: str, cfg: dict[str, Any]) -> Any:
    name = str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if name not in ACTIVATIONS:
        raise ValueError(f"{folder}/config.json: Dense activation {name!r} is not supported; use one of "
                         f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class DenseLayer:
    """One sentence-transformers Dense module in fp32: activation(x @ W.T + b)."""

    def __init__(self, folder: str, device: torch.device) -> None:
        cfg = _json(os.path.join(folder, "config.json")) or {}
        self.fn = _activation(folder, cfg)
        weights = _dense_weights(folder)
        self.weight = weights["linear.weight"].to(device=device, dtype=torch.float32)
        bias = weights.get("linear.bias")
        self.bias = None if bias is None or not cfg.get("bias", True) else bias.to(device=device, dtype=torch.float32)
        shape = (int(cfg.get("out_features", self.weight.shape[0])), int(cfg.get("in_features", self.weight.shape[1])))
        if tuple(self.weight.shape) != shape:
            raise ValueError(f"{folder}: linear.weight is {tuple(self.weight.shape)}, config.json says {shape}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(torch.nn.functional.linear(x, self.weight, self.bias))


def _dense_weights(folder: str) -> dict[str, torch.Tensor]:
    st = os.path.join(folder, "model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    pt = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ValueError(f"{folder}: a Dense module without model.safetensors or pytorch_model.bin")
