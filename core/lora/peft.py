"""Loading the LoRA adapters `peft` saves, as plain tensors.

A folder written by `PeftModel.save_pretrained` holds `adapter_config.json` and
`adapter_model.safetensors` (or `adapter_model.bin` with `safe_serialization=False`). Its tensors
are named ``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]), where ``<module>`` is the Hugging Face name of the base model's linear layer. A layer
then computes ``y = x W^T + scaling * (x A^T) B^T``, with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` under rsLoRA) and per-module r and alpha from ``rank_pattern`` /
``alpha_pattern``.

`load_peft_adapter` returns a `LoRAAdapter` whose B already carries that scaling, so that the
layers only add ``(x A^T) B^T``; everything it cannot serve exactly is refused with a ValueError
naming the folder and the fix. Given the model's `LoRATargets` (`portside.lora.targets`: the
layers the LoRA manager wraps, reached through the model's own checkpoint mapping), every
adapted module is checked against that model's layers: a module it lacks or of other sizes, and
one LoRA does not cover (a recurrent mixer's projections, experts), are refused naming the module.
Without it, only Llama-style and Phi-3 projection names are admitted. `validate_against` checks
an adapter against the model a config describes.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from portside.lora.targets import LoRATargets

__all__ = [
    "AdapterNotFoundError",
    "LoRAAdapter",
    "SUPPORTED_MODULES",
    "check_fit",
    "load_peft_adapter",
    "validate_against",
]

# The module names an adapter loaded without its model may target (Llama-style separate
# projections and Phi-3's fused ones); with the model's `LoRATargets`, its own layers decide
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
_EMBEDDING_MODULES = ("embed_tokens", "lm_head")

# adapter_config.json keys that change the computation beyond y += scaling * B A x: refused when set
_UNSUPPORTED_OPTIONS = {
    "lora_bias": "a bias on lora_B (lora_bias=True)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "target_parameters": "LoRA on parameters rather than modules (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication (layer_replication)",
    "use_qalora": "QA-LoRA (use_qalora=True)",
}

_TENSOR_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
_SAFETENSORS, _BIN = "adapter_model.safetensors", "adapter_model.bin"


class AdapterNotFoundError(ValueError):
    """The adapter folder, its config or its weights file does not exist (a 404 for the server)."""


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One adapter's tensors, ready for the layers to add ``(x A^T) B^T`` to a projection.

    `weights` maps the base model's Hugging Face module name (``model.layers.0.self_attn.q_proj``;
    peft's ``base_model.model.`` prefix removed) to (A [r_module, in], B [out, r_module]), where B
    already includes the module's scaling. Fused Phi-3 modules (``qkv_proj``, ``gate_up_proj``)
    keep their fused B ([q + k + v rows, r]): slicing them is the layer's business.
    `rank` is the largest r_module; `scaling` is what the config gives modules outside
    `rank_pattern` / `alpha_pattern` (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA), and
    `scalings` the factor folded into each module's B. `target_modules`: the kinds of module the
    weights adapt (e.g. ``("k_proj", "q_proj", "v_proj")``), sorted.
    """

    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scalings: dict[str, float] = field(default_factory=dict)
    path: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes the tensors take (for sizing a cache of adapters)."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_peft_adapter(path: str | os.PathLike, *, max_rank: int, dtype: torch.dtype = torch.float32,
                      targets: LoRATargets | None = None) -> LoRAAdapter:
    """Read the adapter `peft` saved in the folder `path`, B scaled, tensors cast to `dtype`.

    Raises ValueError (AdapterNotFoundError for missing files) naming the folder and the fix for:
    a rank above `max_rank`, a peft type other than LoRA, DoRA, trained biases, `modules_to_save`,
    `fan_in_fan_out`, LoRA on embeddings or the LM head, tensors not named as peft names them,
    mismatched A/B shapes, and unreadable files; then, given the serving model's `targets`,
    modules that do not fit it (`check_fit`), else target modules other than `SUPPORTED_MODULES`.
    """
    folder = Path(path)
    config = _read_config(folder)
    _check_config(folder, config, by_name=targets is None)
    pairs = _pair_tensors(folder, _read_tensors(folder), by_name=targets is None)

    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise _error(folder, f"adapter_config.json needs an integer r >= 1 and a number lora_alpha, got r={r!r}, "
                             f"lora_alpha={alpha!r}", "re-save the adapter with peft")
    rslora = bool(config.get("use_rslora"))
    rank_pattern: dict[str, int] = config.get("rank_pattern") or {}
    alpha_pattern: dict[str, float] = config.get("alpha_pattern") or {}

    for module, (a, _) in pairs.items():
        want = _pattern_value(rank_pattern, module, r)
        if a.shape[0] != want:
            raise _error(folder, f"{module} has rank {a.shape[0]} in its tensors but adapter_config.json gives it r={want}",
                         "re-save the adapter with the config it was trained with")
    largest = max(a.shape[0] for a, _ in pairs.values())
    if largest > max_rank:
        raise _error(folder, f"rank {largest} is above the maximum LoRA rank {max_rank}",
                     f"raise --max-lora-rank (max_lora_rank) to {largest} or more")

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scalings: dict[str, float] = {}
    for module, (a, b) in pairs.items():
        rank, module_alpha = a.shape[0], _pattern_value(alpha_pattern, module, alpha)
        scale = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        weights[module] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
        scalings[module] = scale
    adapter = LoRAAdapter(
        rank=largest,
        scaling=alpha / math.sqrt(r) if rslora else alpha / r,
        target_modules=tuple(sorted({m.rsplit(".", 1)[-1] for m in weights})),
        weights=weights,
        scalings=scalings,
        path=str(folder),
    )
    if targets is not None:
        check_fit(adapter, targets)
    return adapter


def validate_against(adapter: LoRAAdapter, hf_config: Any) -> None:
    """Check the adapter against the model `hf_config` describes (a transformers config or a
    config.json's dict; a multimodal model's `text_config` is used), built on the meta device:
    `check_fit` on its `LoRATargets`."""
    from portside.lora.targets import LoRATargets

    check_fit(adapter, LoRATargets.for_config(hf_config))


def check_fit(adapter: LoRAAdapter, targets: LoRATargets) -> None:
    """Check that every adapted module is one of the model's LoRA layers (or a part of one), with
    its in/out sizes. Raises ValueError listing what does not fit, each naming the module: "this
    adapter was trained for another model (...)" for modules the model does not have (another
    layer count, fused or separate projections, a mixture of experts where the adapter has an
    MLP) or of other sizes; "LoRA covers the attention and MLP layers only" for modules the model
    has but LoRA does not cover (a recurrent mixer's projections, experts, routers)."""
    found = targets.problems(adapter.weights)
    folder = Path(adapter.path)
    if found[targets.ANOTHER_MODEL]:
        raise _error(folder, f"this adapter was trained for another model ({_shown(found[targets.ANOTHER_MODEL])})",
                     "serve it with the base model it was trained on")
    if found[targets.NOT_COVERED]:
        raise _error(folder, f"{_shown(found[targets.NOT_COVERED])}; LoRA covers the attention and MLP layers only",
                     "train with target_modules that name only attention and MLP projections (e.g. "
                     "'self_attn.out_proj' rather than 'out_proj' where a recurrent layer has an out_proj too)")


def _shown(problems: list[str]) -> str:
    return "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")


def _error(folder: Path, problem: str, fix: str, cls: type[ValueError] = ValueError) -> ValueError:
    return cls(f"LoRA adapter {folder}: {problem}; {fix}")


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise _error(folder, "no such folder", "give the folder peft's save_pretrained wrote", AdapterNotFoundError)
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise _error(folder, "no adapter_config.json", "give the folder peft's save_pretrained wrote", AdapterNotFoundError)
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _error(folder, f"adapter_config.json is unreadable ({e})", "re-save the adapter with peft") from None
    if not isinstance(config, dict):
        raise _error(folder, "adapter_config.json is not a JSON object", "re-save the adapter with peft")
    return config


def _check_config(folder: Path, config: dict[str, Any], by_name: bool) -> None:
    """Refuse what portside cannot serve exactly, before reading any tensor (`by_name`: target
    modules outside `SUPPORTED_MODULES` too, when no model is there to check them against)."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _error(folder, f"peft_type is {peft_type!r}, and only LORA adapters are supported",
                     "give a LoRA adapter (peft's LoraConfig)")
    if config.get("use_dora"):
        raise _error(folder, "DoRA (use_dora=True) is not supported", "train a plain LoRA adapter (use_dora=False)")
    if config.get("bias", "none") != "none":
        raise _error(folder, f"bias={config['bias']!r} trains the base model's biases, which is not supported",
                     "train with bias='none'")
    if config.get("modules_to_save"):
        raise _error(folder, f"modules_to_save {config['modules_to_save']} holds full copies of those modules, "
                             "which is not supported",
                     "train without modules_to_save, or merge the adapter into the model and serve the merged model")
    if config.get("fan_in_fan_out"):
        raise _error(folder, "fan_in_fan_out=True (GPT-2-style Conv1D weights) is not supported",
                     "use an adapter for a model with nn.Linear projections")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise _error(folder, f"{what} is not supported", f"train without {key}")
    targets = config.get("target_modules")
    if isinstance(targets, list | tuple):  # a string is a regex (or "all-linear"): the tensor names tell
        for target in targets:
            _check_module_kind(folder, str(target).rsplit(".", 1)[-1], f"target module {target!r}", by_name)


def _check_module_kind(folder: Path, kind: str, what: str, by_name: bool = True) -> None:
    if kind in _EMBEDDING_MODULES:
        hint = f"among {', '.join(SUPPORTED_MODULES)}" if by_name else "naming attention and MLP projections only"
        raise _error(folder, f"LoRA on embeddings or the LM head is not supported ({what})", f"train with target_modules {hint}")
    if by_name and kind not in SUPPORTED_MODULES:
        raise _error(folder, f"{what} is not supported",
                     f"train with target_modules among {', '.join(SUPPORTED_MODULES)}")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors, else adapter_model.bin (as peft prefers them)."""
    try:
        if (folder / _SAFETENSORS).is_file():
            from safetensors.torch import load_file

            return load_file(str(folder / _SAFETENSORS), device="cpu")
        if (folder / _BIN).is_file():
            state = torch.load(folder / _BIN, map_location="cpu", weights_only=True)
            if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise ValueError("not a dict of tensors")
            return dict(state)
    except Exception as e:  # safetensors, pickle and zip errors have no common base
        raise _error(folder, f"its weights are unreadable ({type(e).__name__}: {e})", "re-save the adapter with peft") from None
    raise _error(folder, f"no {_SAFETENSORS} (or {_BIN})", "give the folder peft's save_pretrained wrote",
                 AdapterNotFoundError)


def _pair_tensors(folder: Path, tensors: dict[str, torch.Tensor],
                  by_name: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B) from peft's tensor names, every name (`by_name`: its kind too) and shape checked."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR_NAME.fullmatch(name)
        if m is None:
            kind = next((k for k in _EMBEDDING_MODULES if f".{k}." in f".{name}"), None)
            if kind is not None:
                _check_module_kind(folder, kind, f"tensor {name!r}")
            raise _error(folder, f"tensor {name!r} is not named as peft names LoRA weights "
                                 "(base_model.model.<module>.lora_A.weight / .lora_B.weight)",
                         "give an adapter saved by peft's save_pretrained")
        _check_module_kind(folder, m["module"].rsplit(".", 1)[-1], f"module {m['module']!r}", by_name)
        found.setdefault(m["module"], {})[m["ab"]] = tensor
    if not found:
        raise _error(folder, "its weights file holds no LoRA tensors", "re-save the adapter with peft")
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise _error(folder, f"{module} has no {missing}.weight", "re-save the adapter with peft")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
            raise _error(folder, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                                 "(A is [r, in], B is [out, r])", "re-save the adapter with peft")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise _error(folder, f"{module}: LoRA tensors are {a.dtype} / {b.dtype}, not floating point",
                         "re-save the adapter with peft")
        pairs[module] = (a, b)
    return pairs


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """The value of the first key of `patterns` that matches `module`, as peft's
    `get_pattern_key` matches them (the key, a regex, matching a dot-separated suffix), else
    `default`."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default
