"""The dependency rules of docs/architecture.md ("Imports"), enforced on the source tree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ("portside.backends", "triton", "torch_xla", "openvino", "intel_extension_for_pytorch", "oneccl_bindings_for_pytorch")


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement in `path` names (relative imports resolved loosely)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _attribute_chains(path: Path) -> list[tuple[int, str]]:
    """Dotted attribute uses such as torch.cuda.synchronize."""
    tree = ast.parse(path.read_text(), filename=str(path))
    chains = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            cur: ast.AST = node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name):
                parts.append(cur.id)
                chains.append((node.lineno, ".".join(reversed(parts))))
    return chains


def core_files() -> list[Path]:
    return sorted((ROOT / "core").rglob("*.py"))


def test_core_imports_no_backend_or_vendor_runtime():
    bad = []
    for path in core_files():
        for line, mod in _imports(path):
            if any(mod == v or mod.startswith(v + ".") for v in VENDOR):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
        for line, chain in _attribute_chains(path):
            if chain.startswith("torch.cuda") or re.search(r"NCCL|(?<![a-z])nccl", chain):  # not httpx.AsyncClient
                bad.append(f"{path.relative_to(ROOT)}:{line} uses {chain}")
    assert not bad, "core/ must stay hardware-agnostic:\n" + "\n".join(bad)


def _is_device_type(node: ast.expr) -> bool:
    """`x.device_type`, a bare `device_type`, or the `.type` of something named like a device
    (`device.type`, `t.device.type`, `self._device.type`); never another object's `.type`
    (`response_format.type`)."""
    if isinstance(node, ast.Name):
        return node.id == "device_type"
    if not isinstance(node, ast.Attribute):
        return False
    if node.attr == "device_type":
        return True
    owner = node.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    return node.attr == "type" and "device" in name.lower()


def _is_text(node: ast.expr) -> bool:
    """A string literal, or a tuple, list or set of them (`x in ("cpu", "xla")`)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and bool(node.elts) and all(_is_text(e) for e in node.elts)


def device_type_checks(source: str) -> list[tuple[int, str]]:
    """Every comparison of a device type with a string literal in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_device_type(o) for o in operands) and any(_is_text(o) for o in operands):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_core_compares_no_device_type_with_a_string():
    """What differs between devices is platform data (`Platform.host_device`, `worker_start_method`,
    `ray_resource`, `backend_options`, ...), never a test of the device's name in core."""
    bad = [f"{path.relative_to(ROOT)}:{line}: {code}" for path in core_files()
           for line, code in device_type_checks(path.read_text())]  # fmt: skip
    assert not bad, "core/ tests device types; make it a Platform attribute or method:\n" + "\n".join(bad)


@pytest.mark.parametrize("code, found", [
    ('if platform.device_type == "cpu": pass', True),
    ('x = "spawn" if "cpu" != cls.device_type else "fork"', True),
    ('ok = t.device.type in ("cpu", "meta")', True),
    ('ok = device.type == "xla"', True),
    ('ok = device_type != "cuda"', True),
    ('ok = rf.type == "json_schema"', False),  # not a device
    ('ok = out.device.type != q.device.type', False),  # no literal
    ('ok = platform.host_device', False),
])
def test_the_device_check_finder(code: str, found: bool) -> None:
    assert bool(device_type_checks(code)) is found


@pytest.mark.parametrize("package", ["kv_cache", "sched", "kv_transfer"])
def test_scheduler_and_kv_cache_are_pure_python(package):
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in sorted((ROOT / "core" / package).rglob("*.py"))
        for line, mod in _imports(p)
        if mod.split(".")[0] in ("torch", "numpy")
    ]
    assert not bad, "\n".join(bad)


def _within(mod: str, packages: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def test_backends_import_only_the_contract_and_shared_kernels():
    """A backend imports portside.contract (and portside.backends.triton, and the config type),
    never another backend's module or core internals such as the scheduler. The canonical
    quantized layouts `ModelOps.prepare_quantized` receives (`QuantWeight` and its helpers) are
    part of the contract and imported from it, not from `portside.quant`."""
    allowed_core = ("portside.contract", "portside.config", "portside.backends.triton")
    bad = []
    for backend_dir in sorted(p for p in (ROOT / "backends").iterdir() if p.is_dir() and not p.name.startswith("_")):
        own = f"portside.backends.{backend_dir.name}"
        for path in sorted(backend_dir.rglob("*.py")):
            for line, mod in _imports(path):
                if not mod.startswith("portside"):
                    continue
                if _within(mod, (own, *allowed_core)):
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_tree_does_not_import_the_deprecated_contract_module():
    """`portside.backend_api` is only a shim for plugins written before `portside.contract`."""
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for folder in ("core", "backends")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if p != ROOT / "core" / "backend_api.py"
        for line, mod in _imports(p)
        if _within(mod, ("portside.backend_api",))
    ]
    assert not bad, "import portside.contract instead:\n" + "\n".join(bad)


def test_import_portside_is_cheap():
    """`import portside` must not pull in torch, transformers or any backend."""
    code = "import sys, portside; print(','.join(m for m in ('torch', 'transformers', 'portside.backends') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import portside loaded: {out}"
