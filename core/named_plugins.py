"""Classes chosen by name on the command line (`--tool-call-parser`, `--reasoning-parser`):
built in, or from a third-party package's entry point, imported only when asked for."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def load_named(group: str, name: str, base: type[T], builtins: dict[str, type[T]], what: str) -> type[T]:
    """`builtins[name]`, else the `base` subclass the entry point `name` of `group` names;
    ValueError naming the problem (unknown name with the known ones, import failure, wrong type)."""
    if name in builtins:
        return builtins[name]
    from stevedore import NamedExtensionManager

    errors: list[str] = []

    def on_load_failure(_manager: Any, entry_point: Any, exc: BaseException) -> None:
        errors.append(f"{entry_point.name} ({entry_point.value}): {type(exc).__name__}: {exc}")

    manager: NamedExtensionManager[Any] = NamedExtensionManager(
        namespace=group, names=[name], on_load_failure_callback=on_load_failure, on_missing_entrypoints_callback=None
    )
    if errors:
        raise ValueError(f"{what} {name!r} failed to load: {errors[0]}")
    if name not in manager.names():
        known = sorted({*builtins, *manager.entry_points_names()})
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(known)}")
    cls = manager[name].plugin
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{what} {name!r} ({manager[name].entry_point.value}) is not a {base.__name__}")
    return cls
