"""Shared fixtures. Keep this small: fixtures used by one test file belong in that file."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama HF folder (config, safetensors, ChatML tokenizer), fp32."""
    from portside.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen2 HF folder (qkv bias), fp32."""
    from portside.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


# ---------------------------------------------------------------------------------------------
# Heaviest files first. CI runs each leg with `-n auto --dist loadfile`: a file is a unit of work,
# handed to whichever worker is free, in collection order. pytest-xdist's default order (most test
# cases first) left the few-case, many-process files (tensor/pipeline parallel, Ray, the plugin
# kit) to the end, where one worker ran them while the other sat idle. `file_seconds.json` holds
# each file's measured seconds (the main leg, 2 cores); files run longest first (a new file: 1 s
# a case). Refresh it after adding heavy tests with
#     PORTSIDE_FILE_SECONDS=tests/file_seconds.json python -m pytest -n auto --dist loadfile -m "..."
# (the leg's selection); a stale table only costs balance, never a result.
# ---------------------------------------------------------------------------------------------

_FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False
    if os.environ.get("PORTSIDE_FILE_SECONDS") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_FileSeconds(Path(os.environ["PORTSIDE_FILE_SECONDS"])), "portside-file-seconds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    known = json.loads(_FILE_SECONDS.read_text()) if _FILE_SECONDS.exists() else {}
    counts = Counter(item.nodeid.split("::", 1)[0] for item in items)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item: pytest.Item) -> tuple[float, int]:
        path = item.nodeid.split("::", 1)[0]
        return -known.get(path, float(counts[path])), first[path]

    items.sort(key=key)  # stable: a file's cases keep their order and stay together


class _FileSeconds:
    """Sums each file's setup, call and teardown seconds (the controller receives every worker's
    reports) and writes them, rounded, at the end of the session."""

    def __init__(self, out: Path) -> None:
        self.out, self.seconds = out, Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self) -> None:
        table = {path: round(s, 1) for path, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        self.out.write_text(json.dumps(table, indent=0) + "\n")
