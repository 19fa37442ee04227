"""Refusing a hybrid checkpoint whose config names a layer type portside has no layer for.

Hybrid configs list each decoder layer's kind in ``layer_types`` (LFM2: "conv" and
"full_attention"; Qwen3-Next: "linear_attention" and "full_attention"; ...). A newer checkpoint
may name a kind this portside does not build; loading it must fail with a message naming the
kind and the architecture (the CLI exits 2 on it), never build the wrong layer.

- `check_layer_types(architecture, layer_types, known)`: a hybrid model's constructor calls it
  with the kinds it builds.
- `check_config_layer_types(config)`: the same check on a raw config.json, for kinds transformers
  itself rejects (its config class refuses them before any portside model is built: without
  this the user would see transformers' validation traceback).

No torch here: engine arguments call it before any model code loads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["check_config_layer_types", "check_layer_types"]


def check_layer_types(architecture: str, layer_types: Iterable[str], known: Iterable[str]) -> None:
    """Raise ValueError naming the first layer whose type is not in `known` (and the architecture)."""
    allowed = tuple(known)
    _refuse(architecture, layer_types, allowed, f"portside's {architecture} builds {', '.join(map(repr, allowed))}")


def _refuse(architecture: str, layer_types: Iterable[str], allowed: tuple[str, ...], builds: str) -> None:
    for i, kind in enumerate(layer_types):
        if kind not in allowed:
            raise ValueError(f"{architecture}: layer {i} has layer type {kind!r}, which portside has no layer for "
                             f"({builds}); this checkpoint needs a newer portside")


def _transformers_layer_types() -> tuple[str, ...] | None:
    """The layer types transformers' configs accept (None: this transformers does not check)."""
    try:
        from transformers.configuration_utils import ALLOWED_ATTN_LAYER_TYPES
    except ImportError:
        return None
    return tuple(ALLOWED_ATTN_LAYER_TYPES)


def check_config_layer_types(config: Mapping[str, Any]) -> None:
    """A raw config.json (or its text_config) whose ``layer_types`` names a type transformers'
    configs refuse: the ValueError of `check_layer_types`, before transformers reads it."""
    allowed = _transformers_layer_types()
    for cfg in (config, config.get("text_config")):
        if not isinstance(cfg, Mapping):
            continue
        types = cfg.get("layer_types")
        if allowed is None or not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            continue
        architecture = (config.get("architectures") or [cfg.get("model_type") or "this model"])[0]
        _refuse(str(architecture), types, allowed, "transformers' configs do not know it either")
