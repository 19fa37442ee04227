"""Default sampling parameters from a model's ``generation_config.json``, as vLLM applies them.

``--generation-config`` (`EngineArgs.generation_config`) chooses the source:

- ``auto`` (the default): the model folder's ``generation_config.json``;
- ``vllm``: none; `SamplingParams`' own defaults (and each endpoint's) stand;
- a PATH: a folder holding a ``generation_config.json`` (or that file itself).

Only the sampling fields vLLM reads are taken: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens (which becomes ``max_tokens``). They are defaults: a value
the user gives (a `SamplingParams` argument, a request field, a CLI flag) always wins.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["GENERATION_CONFIG_FILE", "SAMPLING_FIELDS", "describe", "generation_defaults", "read_sampling_fields"]

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_INTEGER_FIELDS = ("top_k", "max_new_tokens")


def read_sampling_fields(file: str) -> dict[str, Any]:
    """The SamplingParams defaults a generation_config.json file sets (fields absent or null are
    left out). Raises ValueError naming the file for unreadable JSON or a non-numeric value."""
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not a readable generation config ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, field in SAMPLING_FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        ok = isinstance(value, int) if key in _INTEGER_FIELDS else isinstance(value, (int, float))
        if not ok or isinstance(value, bool):
            kind = "an integer" if key in _INTEGER_FIELDS else "a number"
            raise ValueError(f"{file}: {key} must be {kind}, got {value!r}")
        out[field] = value
    return out


def _source_file(mode: str, model_path: str) -> str | None:
    if mode == "vllm":
        return None
    if mode == "auto":
        file = os.path.join(model_path, GENERATION_CONFIG_FILE)
        return file if os.path.isfile(file) else None
    path = os.path.expanduser(mode)
    if os.path.isdir(path):
        file = os.path.join(path, GENERATION_CONFIG_FILE)
        if not os.path.isfile(file):
            raise ValueError(f"--generation-config {mode!r}: the folder has no {GENERATION_CONFIG_FILE}; "
                             "pass a folder holding one, 'auto' (the model's) or 'vllm' (none)")
        return file
    if os.path.isfile(path):
        return path
    raise ValueError(f"--generation-config {mode!r}: no such folder; pass 'auto' (the model's "
                     f"{GENERATION_CONFIG_FILE}), 'vllm' (ignore it) or a folder holding a {GENERATION_CONFIG_FILE}")


def describe(defaults: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in defaults.items())


def generation_defaults(mode: str, model_path: str) -> dict[str, Any]:
    """The default SamplingParams fields for `mode` (see the module doc), checked and logged once.
    Raises ValueError for a bad PATH or a generation config SamplingParams rejects."""
    from portside.sampling_params import SamplingParams

    file = _source_file(mode, model_path)
    if file is None:
        logger.info("generation config %s: no sampling defaults; SamplingParams' own apply", mode)
        return {}
    defaults = read_sampling_fields(file)
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{file}: {e}; fix the file or pass --generation-config vllm to ignore it") from None
    logger.info("generation config %s (%s): sampling defaults %s", mode, file, defaults)
    if defaults:
        logger.warning("default sampling parameters from %s: %s (a value you pass still wins; "
                       "--generation-config vllm ignores the file)", file, describe(defaults))
    return defaults
