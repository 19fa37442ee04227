"""Third-party backends: the example plugin package, pip-installed from plugins/, passes the
conformance kit, is listed by `portside devices` and serves end to end, and nothing in portside
names it; deliberately broken plugins are reported by package and entry-point name and skipped,
and two plugins claiming one device name make `--device` fail naming both packages.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # installs plugin packages and runs their kits and servers in subprocesses (CI runs them)

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIR = ROOT / "plugins" / "npu_example"
PLUGIN_DIST = "portside-npu-example"
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def _device_rows(stdout: str) -> list[str]:
    """`portside devices` with each device's wrapped cells and reason lines joined onto its row."""
    rows: list[str] = []
    for line in stdout.splitlines():
        if line.startswith(" ") and rows:
            rows[-1] += " " + line.strip()
        else:
            rows.append(line)
    return rows


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))  # fmt: skip


def _portside(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "portside.cli", *args], env=env)


def _installed_from_plugins_dir() -> bool:
    try:
        dist = importlib.metadata.distribution(PLUGIN_DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    direct = dist.read_text("direct_url.json") or ""
    return str(PLUGIN_DIR) in direct and any(ep.group == "portside.platforms" for ep in dist.entry_points)


@pytest.fixture(scope="module")
def npu_example() -> Iterator[str]:
    """The example plugin, editable-installed into this venv (kept if it was there already)."""
    was_installed = _installed_from_plugins_dir()
    if not was_installed:
        proc = _run([*PIP, "install", "--no-deps", "--no-build-isolation", "-e", str(PLUGIN_DIR)])
        assert proc.returncode == 0, proc.stderr
    yield "npu-example"
    if not was_installed:
        _run([*PIP, "uninstall", "-y", PLUGIN_DIST])


# ---- the example plugin ---------------------------------------------------------------------


def test_example_plugin_passes_the_kit(npu_example: str) -> None:
    # The plugin's own test suite runs the kit, exactly as its CI would.
    proc = _run([sys.executable, "-m", "pytest", str(PLUGIN_DIR / "tests"), "-q", "-p", "no:cacheprovider"], timeout=1800)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]


def test_example_plugin_listed_by_devices(npu_example: str) -> None:
    proc = _portside("devices")
    assert proc.returncode == 0, proc.stderr
    line = next((l for l in proc.stdout.splitlines() if l.startswith("npu-example ")), None)
    assert line is not None, proc.stdout
    for part in ("available", f"{PLUGIN_DIST}:npu-example", "npu-example-batched", "padded-decode", "gloo"):
        assert part in line, line
    assert "cpu " in proc.stdout  # the in-tree backends are still there


def test_example_plugin_unavailable_says_why(npu_example: str) -> None:
    proc = _portside("devices", env={"NPU_EXAMPLE_VISIBLE_DEVICES": ""})
    line = next(l for l in _device_rows(proc.stdout) if l.startswith("npu-example "))
    assert "unavailable" in line and "NPU_EXAMPLE_VISIBLE_DEVICES is empty" in line, line
    proc = _portside("generate", "hi", "--model", "/nonexistent", "--device", "npu-example",
                     env={"NPU_EXAMPLE_VISIBLE_DEVICES": ""})  # fmt: skip
    assert proc.returncode == 2 and "NPU_EXAMPLE_VISIBLE_DEVICES is empty" in proc.stderr, proc.stderr


def test_example_plugin_refuses_an_8bit_kv_cache(npu_example: str, tiny_llama: Path) -> None:
    """Written before 8-bit KV caches, the example declares none: --kv-cache-dtype fp8 is refused
    before loading, naming the flag (exit 2), never silently stored in the model's dtype."""
    proc = _portside("generate", "hi", "--model", str(tiny_llama), "--device", "npu-example", "--kv-cache-dtype", "fp8")
    assert proc.returncode == 2, proc.stderr
    assert "--kv-cache-dtype fp8 is not supported by the npu-example platform; use one of ['auto']" in proc.stderr


def test_example_plugin_serves_end_to_end(npu_example: str, tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from portside.testing.tiny import hf_greedy

    assert (ROOT / "core" / "server" / "main.py").is_file()
    with socket_port() as port:
        pass
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "portside.cli", "serve", str(tiny_llama), "--device", "npu-example", "--port", str(port),
         "--dtype", "float32", "--num-kv-blocks", "64", "--served-model-name", "tiny", "--uvicorn-log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.3)
        prompt = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13, 14, 200, 201]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        tok = AutoTokenizer.from_pretrained(str(tiny_llama))
        assert r.json()["choices"][0]["text"] == tok.decode(hf_greedy(tiny_llama, prompt, 12))
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


class socket_port:
    """A free loopback port (closed again before the server binds it)."""

    def __enter__(self) -> int:
        import socket

        self._s = socket.socket()
        self._s.bind(("127.0.0.1", 0))
        return self._s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self._s.close()


def test_nothing_in_portside_names_the_example_plugin() -> None:
    pattern = re.compile(r"npu[-_]example|NpuExample", re.IGNORECASE)
    offenders = []
    for base in ("core", "backends"):
        for path in (ROOT / base).rglob("*.py"):
            if pattern.search(path.read_text(encoding="utf-8")):
                offenders.append(str(path.relative_to(ROOT)))
    for name in ("pyproject.toml", "setup.py"):
        if pattern.search((ROOT / name).read_text()):
            offenders.append(name)
    assert not offenders, f"portside names the example plugin in {offenders}"


# ---- broken plugins ---------------------------------------------------------------------------

GOOD_PLATFORM = '''
from portside.contract import Availability, DeviceInfo, Platform
from portside.attention.reference import ReferenceAttentionBackend

class DupPlatform(Platform):
    name = "dup-device"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -100  # never auto-selected

    @classmethod
    def is_available(cls):
        return Availability.yes()

    @classmethod
    def device_info(cls):
        return DeviceInfo("dup", 1, 1, 1)

    @classmethod
    def attention_backend(cls, config):
        return ReferenceAttentionBackend()
'''

# package -> (entry-point name, module source)
BROKEN: dict[str, tuple[str, str]] = {
    "portside-broken-import": ("broken-import", "raise RuntimeError('boom at import')\ndef register(): pass\n"),
    "portside-broken-register": ("broken-register", "def register():\n    raise RuntimeError('boom at register')\n"),
    "portside-broken-type": ("broken-type", "def register():\n    return 42\n"),
    "portside-broken-class": ("broken-class", "class NotAPlatform: pass\ndef register():\n    return __name__ + ':NotAPlatform'\n"),
    "portside-broken-probe": ("broken-probe", GOOD_PLATFORM.replace('"dup-device"', '"broken-probe"').replace(
        "return Availability.yes()", "raise RuntimeError('boom at probe')") + "def register():\n    return __name__ + ':DupPlatform'\n"),
    "portside-broken-probe-type": ("broken-probe-type", GOOD_PLATFORM.replace('"dup-device"', '"broken-probe-type"').replace(
        "return Availability.yes()", "return True") + "def register():\n    return __name__ + ':DupPlatform'\n"),
    "portside-dup-a": ("dup-a", GOOD_PLATFORM + "def register():\n    return __name__ + ':DupPlatform'\n"),
    "portside-dup-b": ("dup-b", GOOD_PLATFORM + "def register():\n    return __name__ + ':DupPlatform'\n"),
}  # fmt: skip

EXPECTED_REASON = {
    "broken-import": "import failed: RuntimeError: boom at import",
    "broken-register": "register() raised RuntimeError: boom at register",
    "broken-type": "register() returned 42",
    "broken-class": "is not a portside.contract.Platform subclass",
    "broken-probe": "probe raised RuntimeError: boom at probe",
    "broken-probe-type": "is_available() returned True, not an Availability",
}


def _write_package(root: Path, dist: str, ep_name: str, source: str) -> Path:
    module = dist.replace("-", "_")
    pkg = root / dist
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text(source)
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{dist}"
        version = "0.0.1"
        [project.entry-points."portside.platforms"]
        {ep_name} = "{module}:register"
        [tool.setuptools]
        packages = ["{module}"]
        """))
    return pkg


@pytest.fixture(scope="module")
def broken_plugins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Every broken package pip-installed (one pip call) into a private target folder that only
    the subprocesses below see, so tests running beside these never meet them. Removed after."""
    root = tmp_path_factory.mktemp("broken_plugins")
    target = root / "site"
    paths = [str(_write_package(root / "src", d, ep, src)) for d, (ep, src) in BROKEN.items()]
    proc = _run([*PIP, "install", "--no-deps", "--no-build-isolation", "--target", str(target), *paths])
    assert proc.returncode == 0, proc.stderr
    yield {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    _run([*PIP, "uninstall", "-y", *BROKEN], env={"PYTHONPATH": str(target)})  # tidy; the folder goes too
    import shutil

    shutil.rmtree(target, ignore_errors=True)


def test_devices_reports_broken_plugins_and_carries_on(broken_plugins: dict[str, str]) -> None:
    proc = _portside("devices", env=broken_plugins)
    assert proc.returncode == 0, proc.stderr
    lines = _device_rows(proc.stdout)
    for dist, (ep, _) in BROKEN.items():
        if ep.startswith("dup"):
            continue
        line = next((l for l in lines if f"{dist}:{ep}" in l), None)
        assert line is not None, f"{dist}:{ep} missing from:\n{proc.stdout}"
        assert "unavailable" in line and EXPECTED_REASON[ep] in line, line
        assert ep in proc.stderr and dist in proc.stderr, proc.stderr  # the warning names both too
    assert re.search(r"^cpu\s+available", proc.stdout, re.M), proc.stdout
    dup_lines = [l for l in lines if l.startswith("dup-device ")]
    assert len(dup_lines) == 2 and any("portside-dup-a:dup-a" in l for l in dup_lines) and any(
        "portside-dup-b:dup-b" in l for l in dup_lines), proc.stdout  # fmt: skip


def test_selection_still_works_beside_broken_plugins(broken_plugins: dict[str, str]) -> None:
    code = "from portside.platform import resolve_platform; print(resolve_platform().name, resolve_platform('cpu').name)"
    proc = _run([sys.executable, "-c", code], env=broken_plugins)
    assert proc.returncode == 0 and proc.stdout.split() == ["cpu", "cpu"], proc.stderr


def test_duplicate_device_name_errors_naming_both_packages(broken_plugins: dict[str, str], tiny_llama: Path) -> None:
    proc = _portside("generate", "hi", "--model", str(tiny_llama), "--device", "dup-device", env=broken_plugins)
    assert proc.returncode == 2, proc.stderr
    assert "portside-dup-a" in proc.stderr and "portside-dup-b" in proc.stderr, proc.stderr
    assert "more than one plugin" in proc.stderr, proc.stderr


@pytest.mark.parametrize("device", ["broken-probe", "broken-import"])
def test_selecting_a_broken_plugin_says_why(broken_plugins: dict[str, str], tiny_llama: Path, device: str) -> None:
    proc = _portside("generate", "hi", "--model", str(tiny_llama), "--device", device, env=broken_plugins)
    assert proc.returncode == 2 and EXPECTED_REASON[device] in proc.stderr, proc.stderr
