"""The kit's pytest plugin: the ``--device`` option and the fixtures every check uses.

Loaded by this package's conftest.py when pytest collects the package
(``pytest --pyargs portside.testing.conformance --device NAME``). It can also be loaded
explicitly with ``-p portside.testing.conformance.plugin``; loading it twice is harmless.
``$PORTSIDE_CONFORMANCE_DEVICE`` stands in for ``--device``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from portside.contract import Platform
from portside.platform import PlatformEntry, discover_platforms

DEVICE_ENV = "PORTSIDE_CONFORMANCE_DEVICE"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("portside-conformance", "portside backend conformance kit")
    try:
        group.addoption("--device", default=None, metavar="NAME",
                        help=f"the platform to check, as `portside devices` lists it (default: ${DEVICE_ENV})")  # fmt: skip
    except ValueError:  # already added: the plugin was loaded both with -p and by the conftest
        pass


@pytest.fixture(scope="session")
def conformance_device(request: pytest.FixtureRequest) -> str:
    """The --device NAME under test."""
    name = request.config.getoption("--device", default=None) or os.environ.get(DEVICE_ENV)
    if not name:
        pytest.skip(f"the conformance kit needs a device: pass --device NAME (or set ${DEVICE_ENV})")
    return name


@pytest.fixture(scope="session")
def conformance_entry(conformance_device: str) -> PlatformEntry:
    """The discovered plugin entry for the device (loaded or not, available or not)."""
    entries = discover_platforms()
    matches = [e for e in entries if e.name == conformance_device]
    found = ", ".join(f"{e.name} [{e.package}:{e.entry_point}]" for e in entries) or "none"
    if not matches:
        pytest.fail(f"portside conformance [discovery]: no platform named {conformance_device!r} is installed; "
                    f"found: {found}", pytrace=False)  # fmt: skip
    loaded = [e for e in matches if e.platform is not None]
    if len(loaded) > 1:
        pytest.fail("portside conformance [discovery]: device name claimed by several plugins: "
                    + ", ".join(f"{e.package}:{e.entry_point}" for e in loaded), pytrace=False)  # fmt: skip
    entry = loaded[0] if loaded else matches[0]
    if entry.platform is None and "found no usable hardware" not in entry.availability.reason:
        pytest.fail(f"portside conformance [discovery]: plugin {entry.package}:{entry.entry_point} failed to load: "
                    f"{entry.availability.reason}", pytrace=False)  # fmt: skip
    return entry


@pytest.fixture(scope="session")
def conformance_platform(conformance_entry: PlatformEntry) -> type[Platform]:
    """The platform class; skips (with the platform's reason) when it cannot run here."""
    if conformance_entry.platform is None or not conformance_entry.availability:
        pytest.skip(f"{conformance_entry.name} is unavailable here: {conformance_entry.availability.reason}")
    return conformance_entry.platform


@pytest.fixture(scope="session")
def conformance_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama (head_dim 64, GQA 4/2) HF folder with a local tokenizer."""
    from portside.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("conformance_tiny"), "llama", seed=11, head_dim=64)


@pytest.fixture(scope="session")
def conformance_dtype(conformance_platform: type[Platform]) -> torch.dtype:
    """float32 when declared (exact comparisons), else the platform's first dtype."""
    dtypes = conformance_platform.supported_dtypes
    return torch.float32 if torch.float32 in dtypes else dtypes[0]
