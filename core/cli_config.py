"""`--config config.yaml`: flags read from a YAML mapping, as vLLM's `--config` reads them.

Keys are flag names with - or _ (`max-model-len: 4096` or `max_model_len: 4096`): the
subcommand's flags, its positional MODEL (`model:`), and the program's own flags that go before
the subcommand (`log-level: INFO`); a flag given on the command line wins over the file. An unknown key is a usage error naming the closest flag.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from portside.cli_parser import option_names, suggest


class ConfigFileError(ValueError):
    """A --config file that cannot be read or names an unknown flag."""


def _key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def config_argv(
    path: str, parser: argparse.ArgumentParser, top: argparse.ArgumentParser | None = None
) -> tuple[list[str], dict[str, Any], list[str]]:
    """What the YAML file at `path` stands for: the command-line tokens of `parser`'s (the
    subcommand's) flags, to go before the user's own so that those override them; the values of
    positional arguments (`model:`) it sets; and the tokens of `top`'s flags (the program's own,
    such as --log-level), to go before the subcommand. A key both know is the subcommand's."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"--config {path}: not valid YAML ({e})") from None
    if data is None:
        return [], {}, []
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    flags, top_flags = _flags(parser), _flags(top) if top is not None else {}
    positionals = {a.dest: a for a in parser._actions if not a.option_strings}
    tokens: list[str] = []
    top_tokens: list[str] = []
    positional: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = _key(str(raw_key))
        if key in positionals and key not in flags:
            positional[key] = value
            continue
        if key not in flags and key not in top_flags:
            known = [f for p in (parser, top) if p is not None for f in option_names(p) if f not in ("--help", "--config")]
            hint = suggest("--" + str(raw_key).replace("_", "-"), known)
            raise ConfigFileError(f"--config {path}: unknown key {raw_key!r}{hint}")
        if value is None:
            continue
        if key in flags:
            tokens += _tokens(path, raw_key, *flags[key], value)
        else:
            top_tokens += _tokens(path, raw_key, *top_flags[key], value)
    return tokens, positional, top_tokens


def _flags(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, str]]:
    """Each long flag of `parser` by its YAML key (but --help and --config)."""
    flags: dict[str, tuple[argparse.Action, str]] = {}
    for action in parser._actions:
        for s in action.option_strings:
            if s.startswith("--") and s not in ("--help", "--config"):
                flags[_key(s)] = (action, s)
    return flags


def _tokens(path: str, key: Any, action: argparse.Action, flag: str, value: Any) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {key} must be true or false, got {value!r}")
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true and friends
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {key} must be true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [t for v in value for t in (flag, str(v))]
        if action.nargs in ("+", "*"):
            return [flag, *map(str, value)]
        return [flag, json.dumps(value)]  # a flag that takes one JSON list (--allowed-origins)
    return [flag, str(value).lower() if isinstance(value, bool) else str(value)]
