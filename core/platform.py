"""Platform discovery and selection through the ``portside.platforms`` entry-point group.

Every backend, in-tree or third-party, registers the same way: an entry point naming a cheap
``register()`` that returns ``"package.module:PlatformClass"`` (or None when it knows at once
the hardware is absent). A plugin that fails to import, to register, or to probe is reported
with its package and entry-point name and skipped; it never breaks discovery.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from typing import Any

from stevedore import ExtensionManager, NamedExtensionManager

from portside.contract import Availability, Platform

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "portside.platforms"
PLUGINS_ENV = "PORTSIDE_PLUGINS"


class DeviceSelectionError(RuntimeError):
    """No usable platform for the requested device; the message lists what was found."""


@dataclass(frozen=True)
class PlatformEntry:
    entry_point: str  # entry-point name
    package: str  # distribution that provides it
    platform: type[Platform] | None  # None when it could not be loaded
    availability: Availability

    @property
    def name(self) -> str:
        """The --device name (the platform's own name once loaded)."""
        return self.platform.name if self.platform is not None else self.entry_point

    def describe(self) -> dict[str, str]:
        if self.platform is None:
            return {"attention": "-", "graph": "-", "collectives": "-"}
        try:
            return self.platform.describe()
        except Exception as e:  # a plugin's describe() must not break listing
            return {"attention": f"error: {e}", "graph": "-", "collectives": "-"}


def _package_of(entry_point: Any, declared: dict[tuple[str, str], str] | None = None) -> str:
    """The distribution that declares `entry_point` (stevedore's cached entry points lack it);
    `declared` maps (name, value) to it for every entry point of the group (`_declared_packages`)."""
    dist_name = getattr(getattr(entry_point, "dist", None), "name", None)
    if dist_name:
        return dist_name
    if declared is None:
        declared = _declared_packages()
    return declared.get((entry_point.name, entry_point.value), "unknown package")


def _declared_packages() -> dict[tuple[str, str], str]:
    """(name, value) -> distribution for the group's entry points: one scan of every installed
    distribution's metadata (~0.3 s with a few hundred installed), so one per discovery."""
    return {(ep.name, ep.value): ep.dist.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            if ep.dist is not None}  # fmt: skip


def _load_entry(name: str, package: str, register: Any) -> PlatformEntry:
    """Turn one loaded ``register`` callable into an entry, catching every plugin fault."""

    def failed(reason: str) -> PlatformEntry:
        logger.warning("platform plugin %r from %s skipped: %s", name, package, reason)
        return PlatformEntry(name, package, None, Availability.no(reason))

    try:
        target = register()
    except Exception as e:
        return failed(f"register() raised {type(e).__name__}: {e}")
    if target is None:
        logger.info("platform plugin %r from %s: register() found no usable hardware", name, package)
        return PlatformEntry(name, package, None, Availability.no("register() found no usable hardware"))
    if not isinstance(target, str) or ":" not in target:
        return failed(f"register() returned {target!r}; expected 'module:PlatformClass' or None")
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except Exception as e:
        return failed(f"importing {target} failed: {type(e).__name__}: {e}")
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        return failed(f"{target} is not a portside.contract.Platform subclass")
    platform_cls: type[Platform] = cls
    try:
        availability = platform_cls.is_available()
        if not isinstance(availability, Availability):
            return failed(f"{target}.is_available() returned {availability!r}, not an Availability")
    except Exception as e:
        availability = Availability.no(f"probe raised {type(e).__name__}: {e}")
    return PlatformEntry(name, package, platform_cls, availability)


def discover_platforms() -> list[PlatformEntry]:
    """Every platform plugin installed (restricted by $PORTSIDE_PLUGINS when set)."""
    entries: list[PlatformEntry] = []

    def on_load_failure(_manager: Any, entry_point: Any, exc: BaseException) -> None:
        reason = f"import failed: {type(exc).__name__}: {exc}"
        logger.warning("platform plugin %r from %s skipped: %s", entry_point.name, _package_of(entry_point), reason)
        entries.append(PlatformEntry(entry_point.name, _package_of(entry_point), None, Availability.no(reason)))

    allow = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    manager: ExtensionManager[Any]
    if allow:
        manager = NamedExtensionManager(
            namespace=ENTRY_POINT_GROUP,
            names=allow,
            name_order=True,
            invoke_on_load=False,
            on_load_failure_callback=on_load_failure,
        )
    else:
        manager = ExtensionManager(
            namespace=ENTRY_POINT_GROUP, invoke_on_load=False, on_load_failure_callback=on_load_failure
        )
    declared: dict[tuple[str, str], str] | None = None
    for ext in manager:
        if declared is None and getattr(getattr(ext.entry_point, "dist", None), "name", None) is None:
            declared = _declared_packages()
        entries.append(_load_entry(ext.name, _package_of(ext.entry_point, declared), ext.plugin))
    return sorted(entries, key=lambda e: (not e.availability, -(e.platform.priority if e.platform else 0), e.name))


def _table(entries: list[PlatformEntry]) -> str:
    if not entries:
        return "  (no platform plugins installed)"
    return "\n".join(
        f"  {e.name:<14} {'available' if e.availability else 'unavailable: ' + e.availability.reason}"
        f"  [{e.package}]"
        for e in entries
    )


def resolve_platform(device: str | None = None, entries: list[PlatformEntry] | None = None) -> type[Platform]:
    """The platform for `device`, or the best available one when `device` is None."""
    entries = discover_platforms() if entries is None else entries
    if device is not None:
        matches = [e for e in entries if e.name.lower() == device.strip().lower()]  # --device CPU, Cuda
        if not matches:
            raise DeviceSelectionError(f"no platform named {device!r}; devices found:\n{_table(entries)}")
    else:
        matches = [e for e in entries if e.availability and e.platform is not None]
        if not matches:
            raise DeviceSelectionError(f"no available platform; devices found:\n{_table(entries)}")
        best = max(e.platform.priority for e in matches if e.platform is not None)
        matches = [e for e in matches if e.platform is not None and e.platform.priority == best]
        matches = [e for e in matches if e.name == matches[0].name]
    loaded = [e for e in matches if e.platform is not None]
    if len(loaded) > 1:
        packages = " and ".join(f"{e.package} ({e.entry_point})" for e in loaded)
        raise DeviceSelectionError(
            f"device {loaded[0].name!r} is claimed by more than one plugin: {packages}; "
            f"uninstall one, or restrict plugins with {PLUGINS_ENV}=name,..."
        )
    entry = matches[0]
    if entry.platform is None or not entry.availability:
        raise DeviceSelectionError(
            f"device {entry.name!r} is unavailable: {entry.availability.reason}\ndevices found:\n{_table(entries)}"
        )
    return entry.platform


def format_devices(entries: list[PlatformEntry], width: int | None = None) -> str:
    """The `portside devices` table: columns sized to their content, a cell's alternatives
    (``a|b|c``) one per line, and an unavailable platform's reason on indented lines of its own,
    wrapped to `width` (default: the terminal's, 80 when not a terminal)."""
    import shutil
    import textwrap

    width = width or shutil.get_terminal_size((80, 24)).columns
    header = ("DEVICE", "STATUS", "PACKAGE", "ATTENTION", "GRAPH", "COLLECTIVES")
    rows: list[tuple[list[str], str]] = []
    for e in entries:
        d = e.describe()
        status = "available" if e.availability else "unavailable"
        cells = [e.name, status, f"{e.package}:{e.entry_point}", d["attention"], d["graph"], d["collectives"]]
        rows.append((cells, "" if e.availability else e.availability.reason))
    split = [[c.split("|") if "|" in c and not c.startswith("error:") else [c] for c in cells] for cells, _ in rows]
    widths = [max([len(header[i])] + [len(part) for r in split for part in r[i]]) for i in range(len(header))]

    def line(parts: list[str]) -> str:
        return "  ".join(p.ljust(w) for p, w in zip(parts, widths)).rstrip()

    lines = [line(list(header))]
    for (_, reason), parts in zip(rows, split):
        for k in range(max(len(c) for c in parts)):
            lines.append(line([c[k] if k < len(c) else "" for c in parts]))
        if reason:
            lines += textwrap.wrap(reason, max(40, width), initial_indent="    reason: ", subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def format_backend_options(entries: list[PlatformEntry], width: int | None = None) -> str:
    """`portside devices`' second part: each loaded platform's `backend_options` (name, choices,
    default and help, wrapped to `width`), or that it takes none."""
    import shutil
    import textwrap

    width = max(40, width or shutil.get_terminal_size((80, 24)).columns)
    lines = textwrap.wrap("BACKEND OPTIONS (--backend-option KEY=VALUE; Python: platform_options)",
                          width, subsequent_indent="  ")
    for e in entries:
        if e.platform is None:
            continue
        options = getattr(e.platform, "backend_options", ())
        lines.append(f"{e.name}:" + ("" if options else " none"))
        for option in options:
            lines += textwrap.wrap(option.describe(), width, initial_indent="  ", subsequent_indent="      ",
                                   break_long_words=False, break_on_hyphens=False)
            lines += textwrap.wrap(option.help, width, initial_indent="      ", subsequent_indent="      ",
                                   break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)
