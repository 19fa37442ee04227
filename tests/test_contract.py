"""The Platform contract as a package (`portside.contract`, docs/plugins.md): every part a plugin
may provide is declared with a docstring, the contract reads nothing it does not declare, and the
old module, `portside.backend_api`, still serves every name it had, with a DeprecationWarning
that points at the plugin's import line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import portside.contract as contract
from portside.contract import Availability, DeviceInfo, Platform

ROOT = Path(__file__).resolve().parents[1]
CONTRACT_DIR = ROOT / "core" / "contract"

# `portside.backend_api.__all__` before the split, verbatim: what plugins written from
# docs/plugins.md may import (plus `EncoderAttention`, importable though not listed)
OLD_NAMES = [
    "HUGE_PAGE", "Availability", "DeviceInfo", "host_memory", "host_zeros", "KV_CACHE_DTYPES",
    "QUANTIZED_KV_CACHE_DTYPES", "KV_SCALE_BYTES", "kv_cache_dtype_name", "kv_cache_torch_dtype",
    "is_quantized_kv", "kv_row_bytes", "quantize_kv", "dequantize_kv", "KVCacheSpec", "AttentionMetadata",
    "ForwardContext", "GraphCaptureSupport", "ATTENTION_FEATURES", "AttentionBackend", "ModelOps", "LoRAMapping",
    "GraphRunner", "EagerGraphRunner", "ModelFn", "PiecewiseModel", "Communicator", "SingleRankCommunicator",
    "TorchDistributedCommunicator", "Sampler", "TokenBitmask", "apply_token_bitmask", "Platform",
]  # fmt: skip


def _shim():
    sys.modules.pop("portside.backend_api", None)
    return importlib.import_module("portside.backend_api")


# ---- the deprecated module -------------------------------------------------------------------


def test_every_old_name_resolves_to_the_contracts_object_with_a_warning():
    shim = _shim()
    assert sorted(shim.__all__) == sorted(OLD_NAMES)
    assert set(OLD_NAMES) <= set(contract.__all__)
    for name in [*OLD_NAMES, "EncoderAttention"]:
        with pytest.warns(DeprecationWarning, match=rf"import {name} from portside\.contract"):
            value = getattr(shim, name)
        assert value is getattr(contract, name), name
    assert set(dir(shim)) >= set(OLD_NAMES)
    with pytest.raises(AttributeError, match="no attribute 'Nonexistent'"):
        shim.Nonexistent  # noqa: B018


def test_the_warning_points_at_the_plugins_import_line(tmp_path, monkeypatch):
    """A plugin module that imports the old names runs unchanged; the warning names its file and line."""
    plugin = tmp_path / "old_style_plugin.py"
    plugin.write_text(
        "from portside.backend_api import (\n"
        "    AttentionBackend,\n"
        "    Availability,\n"
        "    Platform,\n"
        "    TorchDistributedCommunicator,\n"
        ")\n\n\n"
        "class OldStylePlatform(Platform):\n"
        "    name = 'old-style'\n"
        "    device_type = 'cpu'\n"
        "    dist_backend = 'gloo'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _shim()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("old_style_plugin")
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert [str(w.message).rsplit(" ", 3)[-3] for w in deprecations] == [
        "AttentionBackend", "Availability", "Platform", "TorchDistributedCommunicator"]  # fmt: skip
    assert {(Path(w.filename), w.lineno) for w in deprecations} == {(plugin, 1)}
    assert issubclass(module.OldStylePlatform, contract.Platform)
    sys.modules.pop("old_style_plugin", None)


def test_star_import_of_the_old_module_still_works():
    namespace: dict = {}
    with pytest.warns(DeprecationWarning):
        exec("from portside.backend_api import *", namespace)  # noqa: S102
    assert namespace["Platform"] is Platform and namespace["host_zeros"] is contract.host_zeros


def test_no_test_configuration_makes_the_deprecation_an_error():
    """Plugins (npu_example, triton_interp) import the old module: their kits must not fail on it."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    errors = [f for f in options.get("filterwarnings", []) if f.startswith("error")]
    assert all("Deprecation" not in f and f.count(":") >= 2 for f in errors), errors  # none for every category
    for conftest in [*ROOT.glob("tests/**/conftest.py"), *ROOT.glob("core/testing/**/conftest.py")]:
        text = conftest.read_text()
        assert 'simplefilter("error"' not in text and 'filterwarnings("error' not in text, conftest


# ---- declarations ----------------------------------------------------------------------------


def _contract_classes() -> list[type]:
    """The classes the contract's own modules define (re-exports from portside.sample etc. aside)."""
    return [v for v in vars(contract).values()
            if inspect.isclass(v) and v.__module__.startswith("portside.contract.")]  # fmt: skip


def _attribute_docstrings(cls: type) -> tuple[set[str], set[str]]:
    """(names declared in the class body, those followed by a docstring), from the source."""
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    declared, documented = set(), set()
    body = node.body
    for i, stmt in enumerate(body):
        names = []
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names = [stmt.target.id]
        elif isinstance(stmt, ast.Assign):
            names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
        names = [n for n in names if not n.startswith("_")]
        declared.update(names)
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            documented.update(names)
    return declared, documented


@pytest.mark.parametrize("cls", _contract_classes(), ids=lambda c: c.__name__)
def test_every_attribute_and_method_is_declared_with_a_docstring(cls):
    assert cls.__doc__, cls
    declared, documented = _attribute_docstrings(cls)
    inherited = {n for base in cls.__mro__[1:] for n in vars(base)}
    missing = sorted(n for n in declared - documented if n not in inherited)
    assert not missing, f"{cls.__name__}: attributes without a docstring: {missing}"
    undocumented = [
        name for name, value in vars(cls).items()
        if not name.startswith("_") and inspect.isfunction(inspect.unwrap(getattr(value, "__func__", value)))
        and not inspect.getdoc(getattr(cls, name))
    ] + [name for name, value in vars(cls).items() if isinstance(value, property) and not value.__doc__]  # fmt: skip
    assert not undocumented, f"{cls.__name__}: methods without a docstring: {undocumented}"


def test_the_contract_reads_no_undeclared_attribute():
    """No `getattr` / `hasattr` on the objects a plugin provides: what core reads is declared."""
    bad = []
    for path in sorted(CONTRACT_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in ("cls", "self", "backend", "platform")):
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, bad


def test_describe_reads_declared_names_with_their_defaults():
    class Bare(Platform):
        name = "bare"
        device_type = "cpu"
        dist_backend = "gloo"

        @classmethod
        def is_available(cls) -> Availability:
            return Availability.yes()

        @classmethod
        def device_info(cls) -> DeviceInfo:
            return DeviceInfo("bare", 1, 1, 1)

        @classmethod
        def attention_backend(cls, config):  # type: ignore[override]
            raise NotImplementedError

    assert Bare.describe() == {"attention": "?", "graph": "eager", "collectives": "gloo"}

    class Named(Bare):
        attention_name = "paged"
        graph_name = "captured"
        collectives_name = "ring"

    assert Named.describe() == {"attention": "paged", "graph": "captured", "collectives": "ring"}


def test_each_part_is_one_small_module():
    sizes = {p.name: len(p.read_text().splitlines()) for p in CONTRACT_DIR.glob("*.py")}
    assert {"platform.py", "attention.py", "graph.py", "collectives.py", "model_ops.py", "memory.py",
            "kv_quant.py", "sampling.py"} <= set(sizes)  # fmt: skip
    assert max(sizes.values()) < 500, sizes


def test_public_names_live_in_their_part():
    assert contract.Platform.__module__ == "portside.contract.platform"
    assert contract.AttentionBackend.__module__ == "portside.contract.attention"
    assert contract.GraphRunner.__module__ == "portside.contract.graph"
    assert contract.TorchDistributedCommunicator.__module__ == "portside.contract.collectives"
    assert contract.ModelOps.__module__ == "portside.contract.model_ops"
    assert contract.host_zeros.__module__ == "portside.contract.memory"
    assert contract.quantize_kv.__module__ == "portside.contract.kv_quant"
    assert sorted(contract.__all__) == sorted(set(contract.__all__))
    for name in contract.__all__:
        assert hasattr(contract, name), name



def test_torch_distributed_communicator_keeps_what_subclasses_use(tmp_path):
    """`plugins/npu_example`'s communicator calls ``self._dist.all_gather(..., group=self.group)``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        comm = contract.TorchDistributedCommunicator()
        assert comm._dist is dist and comm.group is None and (comm.rank, comm.world_size) == (0, 1)
    finally:
        dist.destroy_process_group()
