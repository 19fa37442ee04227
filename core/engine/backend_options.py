"""The command line's backend options: ``--backend-option KEY=VALUE`` (repeatable) fills
`EngineArgs.platform_options`, which core checks against the chosen platform's declaration
(`portside.contract.check_backend_options`); ``--cpu-graph MODE``, the one backend option that
had a flag of its own, still works for one release with a warning naming the new spelling."""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from typing import Any

logger = logging.getLogger(__name__)

DEPRECATED_FLAGS = {"cpu_graph": "--cpu-graph"}  # option key -> the flag it had before --backend-option


def parse_backend_option(text: str) -> list[tuple[str, str]]:
    """One ``--backend-option`` value: ``KEY=VALUE``, or a JSON object of them (what a --config
    YAML mapping becomes)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object of KEY: VALUE ({e})") from None
        if isinstance(value, dict):
            return [(str(k), _text(v)) for k, v in value.items()]
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. --backend-option cpu_graph=inductor "
                                         "(`portside devices` lists each platform's options)")
    return [(key.strip(), value.strip())]


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def add_backend_option_args(group: argparse._ArgumentGroup) -> None:
    """``--backend-option`` and the deprecated ``--cpu-graph``."""
    group.add_argument("--backend-option", dest="backend_option", action="append", type=parse_backend_option,
                       default=None, metavar="KEY=VALUE",
                       help="an option of the chosen platform only (repeatable), e.g. cpu_graph=inductor; unknown keys "
                            "and values are refused, and `portside devices` lists each platform's options")
    group.add_argument("--cpu-graph", choices=["eager", "inductor", "openvino"], default=None,
                       help="deprecated: use --backend-option cpu_graph=MODE")


def backend_options_from_args(args: argparse.Namespace) -> dict[str, str]:
    """`EngineArgs.platform_options` from parsed flags (a deprecated flag warns, naming its new
    spelling; given both ways with different values, ValueError)."""
    options: dict[str, str] = {}
    for pairs in getattr(args, "backend_option", None) or ():
        for key, value in pairs:
            if options.get(key, value) != value:
                raise ValueError(f"--backend-option {key} is given twice ({options[key]} and {value}); pass it once")
            options[key] = value
    for key, flag in DEPRECATED_FLAGS.items():
        value = getattr(args, key, None)
        if value is None:
            continue
        message = f"{flag} is deprecated and will be removed after this release; use --backend-option {key}={value}"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        logger.warning(message)
        if options.get(key, value) != value:
            raise ValueError(f"{flag} {value} conflicts with --backend-option {key}={options[key]}; pass one")
        options[key] = value
    return options
