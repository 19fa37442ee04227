"""What LoRA adapters may adapt in one model, and where each of an adapter's modules lands.

LoRA covers a model's attention and MLP projections: the linear layers the LoRA manager wraps
(`lora_layers`: portside's ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` and
``up_proj`` layers, none inside a recurrent mixer, i.e. a module with ``state_shapes`` such as a
Mamba mixer, a Gated DeltaNet or LFM2's short convolution). An adapter names the base model's
modules as its Hugging Face checkpoint does (peft adapts the transformers model, whose modules
are the checkpoint's names); the model's own checkpoint mapping (``checkpoint_tensors``, the one
its weights load through) says which layer, and which part of a fused layer, each name fills.
Nothing here knows an architecture by name: LFM2's ``out_proj`` and ``w1``/``w2``/``w3``,
Qwen3-Next's gated ``q_proj`` (queries and gates, 2H heads), Granite's ``shared_mlp.input_linear``
land where that model's loader puts them, and are sized by the layer they land in.

`LoRATargets.problems` sorts what does not fit into two kinds: modules the model does not have
or whose sizes differ (an adapter trained for another model), and modules the model has but LoRA
does not cover (a recurrent mixer's projections, experts, routers, embeddings).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portside.lora.layers import LORA_MODULES
from portside.model.layers import LinearBase

__all__ = ["LoRATargets", "lora_layers"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def recurrent_mixers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's recurrent mixers by module name: modules that keep a per-sequence state
    (``state_shapes``, what a hybrid model's state spec is built from)."""
    return {name: m for name, m in model.named_modules() if callable(getattr(m, "state_shapes", None))}


def lora_layers(model: nn.Module) -> dict[str, LinearBase]:
    """The linear layers LoRA adapters may adapt, by portside module name: the attention and MLP
    projections (names in `LORA_MODULES`), none inside a recurrent mixer."""
    mixers = tuple(f"{name}." for name in recurrent_mixers(model))
    return {name: m for name, m in model.named_modules()
            if isinstance(m, LinearBase) and name.rsplit(".", 1)[-1] in LORA_MODULES and not name.startswith(mixers)}


def in_features(layer: LinearBase) -> int:
    """Input columns of the layer's whole checkpoint tensor (all tensor-parallel ranks)."""
    return layer.in_local if layer.in_partition() is None else layer.in_local * int(getattr(layer, "tp_size", 1))


class LoRATargets:
    """The LoRA view of one built model (any device; the meta device costs nothing): its
    adaptable layers (`layers`), the Hugging Face names under which its checkpoint stores a fused
    layer whole (`fused`: Phi-3's ``qkv_proj``; peft then names that module, not its parts), and
    `problems`, the check of an adapter's modules against them."""

    ANOTHER_MODEL, NOT_COVERED = "another model", "not covered"

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = lora_layers(model)
        self.mixers = recurrent_mixers(model)
        config = getattr(model, "config", None)
        hf = getattr(config, "hf_config", None)
        self.model_type: str = getattr(hf, "model_type", None) or type(model).__name__
        self.num_layers: int | None = getattr(config, "num_layers", None)
        self._modules = dict(model.named_modules())
        self._params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        self.fused: dict[str, str] = {}  # HF module name -> portside layer it fills whole
        separate: dict[str, None] = {}  # "q/k/v", "gate/up": parts the checkpoint stores apart
        for name, layer in self.layers.items():
            if layer.parts is None or len(layer.parts) < 2:
                continue
            whole = self._checkpoint_name(name)
            rows = sum(layer.checkpoint_rows(p) for p in layer.parts)
            try:  # does the model's loader split a checkpoint tensor of that name into the layer's parts?
                split = [(m, p) for m, p, _ in self._map(whole, torch.empty(rows, in_features(layer), device="meta"))]
            except (ValueError, RuntimeError):
                split = []
            if split == [(name, p) for p in layer.parts]:
                self.fused[whole] = name
            else:
                separate["/".join(_part_name(name, p) for p in layer.parts)] = None
        self.separate = " and ".join(separate)

    @classmethod
    def for_config(cls, hf_config: Any) -> LoRATargets:
        """Of the model a transformers config (or a config.json's dict) describes, built on the
        meta device; a multimodal config's `text_config` is the model taken."""
        from portside.model.args import ModelArgs

        return cls._build(ModelArgs.from_hf(_text_config(hf_config)))

    @classmethod
    def for_folder(cls, folder: str | Path) -> LoRATargets:
        """Of the model in a Hugging Face folder (the one the engine serves), built on the meta device."""
        from portside.model.registry import read_model_args

        return cls._build(read_model_args(folder))

    @classmethod
    def _build(cls, args: Any) -> LoRATargets:
        from portside.model.registry import model_class

        with torch.device("meta"):
            return cls(model_class(args.architecture)(args))

    # ---- the check --------------------------------------------------------------------------

    def problems(self, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list[str]]:
        """What does not fit among an adapter's modules (HF name -> (A [r, in], B [out, r])),
        by kind: `ANOTHER_MODEL` (no such module, or other sizes), `NOT_COVERED` (a module the
        model has that LoRA does not cover). Each problem names the module."""
        found: dict[str, list[str]] = {self.ANOTHER_MODEL: [], self.NOT_COVERED: []}
        for name, (a, b) in weights.items():
            problem = self._problem(name, a.shape[1], b)
            if problem is not None:
                found[problem[0]].append(problem[1])
        return found

    def _problem(self, name: str, cols: int, b: torch.Tensor) -> tuple[str, str] | None:
        whole = self.fused.get(name)
        if whole is not None:  # a layer stored whole: the adapter's B covers every part
            fused = self.layers[whole]
            return self._sizes(name, (cols, b.shape[0]), (in_features(fused), sum(map(fused.checkpoint_rows, fused.parts or ()))))
        try:
            mapped = self._map(name, b)
        except ValueError as e:  # rows the model's loader cannot split
            return self.ANOTHER_MODEL, f"{name}: {e}"
        rows = 0
        for module, part, _ in mapped:
            layer = self.layers.get(module)
            if layer is None:
                return self._not_adaptable(name, module)
            if layer.parts is not None and part not in layer.parts:  # a fused name, where the model has parts
                what = f"separate {self.separate} projections" if self.separate else "no such module"
                return self.ANOTHER_MODEL, f"{name}: {self.model_type} has {what}"
            if module in self.fused.values():
                return self.ANOTHER_MODEL, f"{name}: {self.model_type} has fused {' / '.join(_leaf(n) for n in self.fused)}"
            rows += layer.checkpoint_rows(part)
        if not mapped:
            return self.ANOTHER_MODEL, f"{name}: {self.model_type} has no such module"
        return self._sizes(name, (cols, b.shape[0]), (in_features(self.layers[mapped[0][0]]), rows))

    def _sizes(self, name: str, have: tuple[int, int], want: tuple[int, int]) -> tuple[str, str] | None:
        if have == want:
            return None
        return self.ANOTHER_MODEL, f"{name} maps {have[0]} -> {have[1]}, the model's {want[0]} -> {want[1]}"

    def _not_adaptable(self, name: str, module: str) -> tuple[str, str]:
        """Why `name` (landing on portside's `module`, not an adaptable layer) is refused."""
        m = _LAYER.search(module)
        if m and self.num_layers is not None and int(m[1]) >= self.num_layers:
            return self.ANOTHER_MODEL, f"{name}: the model has {self.num_layers} layers"
        ancestors = [p for p in _prefixes(module) if p in self._modules]
        mixer = next((p for p in reversed(ancestors) if p in self.mixers), None)
        if mixer is not None:
            where = f"layer {m[1]}'s" if m else "a"
            return self.NOT_COVERED, f"{name} is a projection of {where} recurrent mixer ({type(self.mixers[mixer]).__name__})"
        exists = module in self._modules or module in self._params or f"{module}.weight" in self._params
        if exists and ".experts." in f"{module}.":
            return self.NOT_COVERED, f"{name} is an expert of a mixture of experts"
        if exists:
            return self.NOT_COVERED, f"{name} is not an attention or MLP projection"
        if any(hasattr(self._modules[p], "experts") for p in ancestors):
            return self.ANOTHER_MODEL, f"{name}: layer {m[1] if m else '?'}'s MLP is a mixture of experts"
        return self.ANOTHER_MODEL, f"{name}: {self.model_type} has no such module"

    # ---- the model's checkpoint mapping -----------------------------------------------------

    def _map(self, name: str, tensor: torch.Tensor) -> list[tuple[str, object, torch.Tensor]]:
        """(portside module, part, rows of the tensor) for a checkpoint module `name` holding `tensor`."""
        pieces: Iterable[tuple[str, object, torch.Tensor]] = self.model.checkpoint_tensors(  # type: ignore[operator]
            f"{name}.weight", tensor)
        return [(target.removesuffix(".weight"), part, piece) for target, part, piece in pieces]

    def _checkpoint_name(self, module: str) -> str:
        """`module` as the checkpoint names it, the model's `renames` undone."""
        name = f"{module}.weight"
        for old, new in reversed(getattr(self.model, "renames", ())):
            name = name.replace(new, old)
        return name.removesuffix(".weight")


def _text_config(hf_config: Any) -> Any:
    """A transformers config for `hf_config` (a config or a config.json's dict), its text model's."""
    if isinstance(hf_config, Mapping):
        cfg = dict(hf_config)
        if isinstance(cfg.get("text_config"), Mapping):
            cfg = dict(cfg["text_config"])
        from transformers import AutoConfig, PretrainedConfig

        # config.json's encoding of inf / nan ({"__float__": "Infinity"}), as transformers reads the file
        cfg = getattr(PretrainedConfig, "_decode_special_floats", lambda c: c)(cfg)
        model_type = cfg.pop("model_type", None)
        return AutoConfig.for_model(model_type, **cfg) if model_type else PretrainedConfig(**cfg)
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def _part_name(module: str, part: object) -> str:
    """A fused layer's part as the checkpoint names it, short: "q", "gate" (the decoder's own
    naming of a part, as its missing-tensor messages give it)."""
    from portside.model.decoder import _checkpoint_name

    return _leaf(_checkpoint_name(f"{module}.weight", part).removesuffix(".weight")).removesuffix("_proj")


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _prefixes(module: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b", "a.b.c"]."""
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]
