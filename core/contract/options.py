"""Backend options: settings only one platform understands (the cpu graph mode, the CUDA graph
sizes, the XLA buckets), declared by the platform and given by the user as
``--backend-option KEY=VALUE`` on the command line or ``platform_options={KEY: VALUE}`` in Python.

A platform lists what it takes in `Platform.backend_options`, one `BackendOption` each; core
checks every option given against that declaration before the platform sees the configuration
(`check_backend_options`: an unknown key, or a value outside an option's `choices`, is an error
that names the option, the platform and what it takes), and `portside devices` lists them. The
platform's own `check_and_update_config` then checks what the declaration cannot say (a number's
range, an optional dependency being installed) and reads the values with
`EngineConfig.option(key, default)`. Values are strings, as on the command line.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the platform module imports this one; this only names the type
    from portside.contract.platform import Platform

__all__ = ["BackendOption", "check_backend_options"]


@dataclass(frozen=True)
class BackendOption:
    """One option a platform takes (`Platform.backend_options`)."""

    name: str
    """The key: ``--backend-option NAME=VALUE``, ``platform_options={NAME: VALUE}``. Prefix it with
    your platform's name (``cpu_graph``, ``xla_strict``) so that it cannot be mistaken for another's."""
    help: str
    """What it does, one line, as `portside devices` shows it."""
    choices: tuple[str, ...] | None = None
    """The values it takes, checked by core; None: any string (the platform checks it)."""
    default: str | None = None
    """The value when it is not given, as documentation (`portside devices`); the platform's code
    applies it. None: no single default (it depends on the configuration; say so in `help`)."""

    def describe(self) -> str:
        """``name=a|b|c (default: a)`` for listings."""
        values = "|".join(self.choices) if self.choices else "VALUE"
        return f"{self.name}={values}" + (f" (default: {self.default})" if self.default is not None else "")


def check_backend_options(platform: type[Platform], options: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
    """Raise ValueError unless every option in `options` is one `platform` declares, with a value
    among its `choices` where it has any. The message names the option, the platform, and what it
    takes (the closest key where one was misspelt)."""
    given = dict(options)
    declared = {o.name: o for o in platform.backend_options}
    unknown = sorted(k for k in given if k not in declared)
    if unknown:
        close = [m for k in unknown for m in difflib.get_close_matches(k, list(declared), n=1, cutoff=0.6)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        takes = (f"it takes {', '.join(declared)}" if declared else "it takes none")
        raise ValueError(f"unknown {platform.name} backend option(s) {unknown}{hint}; {takes} "
                         "(`portside devices` lists each platform's options)")
    for key, value in given.items():
        option = declared[key]
        if option.choices is not None and str(value) not in option.choices:
            raise ValueError(f"{platform.name} backend option {key}={str(value)!r}: use one of {list(option.choices)}")
