"""The `portside` argument parser: usage errors that name the fix.

A misspelt flag or subcommand gets a difflib suggestion under the subcommand's own usage, every
usage error exits with code 2, and `--help` shows each flag's default.
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, NoReturn

EXIT_USAGE = 2


class HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to a flag's help where it has a default worth showing and its help does
    not state one already (the texts that say "default ..." themselves keep their wording)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.help is None
            or action.help == argparse.SUPPRESS
            or default in (None, False, argparse.SUPPRESS, [])
            or "%(default)" in text
            or "default" in text.lower()
            or not action.option_strings
        ):
            return action.help
        return text + " (default: %(default)s)"


def suggest(name: str, known: list[str]) -> str:
    """"; did you mean X?" for the closest of `known`, or ""."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def option_names(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the closest subcommand and exit 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m and m.group(2):
            choices = re.findall(r"'([^']*)'", m.group(2))
            message += suggest(m.group(1), choices)
        self.exit(EXIT_USAGE, f"{self.short_usage()}{self.prog}: error: {message}\n")

    def short_usage(self) -> str:
        """argparse's usage, or one line naming the positionals and --help when that runs long."""
        usage = self.format_usage()
        if usage.count("\n") <= 4:
            return usage
        names = [(str(a.metavar or a.dest), a.nargs == "?") for a in self._actions
                 if not a.option_strings and a.help != argparse.SUPPRESS]
        positionals = " ".join(f"[{n}]" if optional else n for n, optional in names)
        return f"usage: {self.prog} [options] {positionals}  (every option: {self.prog} --help)\n"

    def subparser(self, command: str | None) -> argparse.ArgumentParser:
        """The parser of `command` (this one when there is none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                return action.choices[command]
        return self

    def unknown_args_error(self, command: str | None, extra: list[str], nested: str | None = None) -> NoReturn:
        """Exit 2 for arguments no flag took, under the subcommand's usage (`nested`: its own subcommand's,
        as `bench latency`), with suggestions."""
        from portside.engine.unsupported_args import unsupported_message

        sub = self.subparser(command)
        if nested is not None and isinstance(sub, Parser):
            sub = sub.subparser(nested)
        known = option_names(sub) + option_names(self)
        flag = next((t for t in extra if t.startswith("-")), None)
        if flag is None:
            sub.error(f"unexpected argument {extra[0]!r}; see `portside {command or ''} --help`".replace("  ", " "))
        name = flag.split("=", 1)[0]
        reason = unsupported_message(name)
        if reason:
            sub.error(reason)
        sub.error(f"unknown flag {name}{suggest(name, known)}")
