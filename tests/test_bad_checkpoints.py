"""A broken checkpoint fails at load with exit code 2 and a message naming the folder and the
tensor or config field at fault: an unknown architecture, a missing tensor, a tensor of the
wrong shape, an expert tensor with no place, an unsupported rope type.

The first case runs `python -m portside.cli generate` as a user does (the process's own exit code
and stderr); the others call the same `portside.cli.main` in this process (the same code path
without a new interpreter importing torch and transformers: ~12 s each on CI's 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from portside.testing.tiny import make_tiny_model

Generate = Callable[[Path], tuple[int, str]]  # a model folder -> (exit code, stderr)


def _argv(model: Path) -> list[str]:
    return ["generate", "hi", "--raw", "--model", str(model), "--device", "cpu", "--max-tokens", "2"]


def _generate_subprocess(model: Path) -> tuple[int, str]:
    """(exit code, stderr) of `python -m portside.cli generate` on `model`."""
    proc = subprocess.run([sys.executable, "-m", "portside.cli", *_argv(model)], capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    return proc.returncode, proc.stderr


@pytest.fixture
def generate(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> Generate:
    """`portside generate` on a model folder in this process: (exit code, what it wrote to stderr
    and logged; a logged traceback shows up here as it would on a user's terminal)."""
    from portside.cli import main

    def run(model: Path) -> tuple[int, str]:
        code = main(_argv(model))
        return code, capsys.readouterr().err + caplog.text

    return run


def _edit_tensors(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _assert_exit_2(result: tuple[int, str], *needles: str) -> None:
    code, stderr = result
    assert code == 2, stderr[-2000:]
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in stderr, f"{needle!r} not in {stderr!r}"


@pytest.mark.slow
def test_unknown_architecture(moe: Path, tmp_path: Path) -> None:
    path = _copy(moe, tmp_path / "m")
    _edit_config(path, architectures=["XverseForCausalLM"])
    _assert_exit_2(_generate_subprocess(path), "XverseForCausalLM", "Qwen3MoeForCausalLM")


@pytest.mark.slow
def test_architecture_that_does_not_match_the_configs_fields(moe: Path, tmp_path: Path, generate: Generate) -> None:
    """A supported architecture whose config is another model type's: named, exit 2, no traceback."""
    path = _copy(moe, tmp_path / "m")
    _edit_config(path, architectures=["FalconH1ForCausalLM"])
    _assert_exit_2(generate(path), "FalconH1ForCausalLM", "'qwen3_moe' config", "correct 'architectures'")


@pytest.mark.slow
def test_missing_expert_tensor_is_named(moe: Path, tmp_path: Path, generate: Generate) -> None:
    path = _copy(moe, tmp_path / "m")
    _edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    _assert_exit_2(generate(path), str(path), "missing 1 tensors", "model.layers.1.mlp.experts.2.up_proj.weight")


@pytest.mark.slow
def test_wrong_shape_is_named(moe: Path, tmp_path: Path, generate: Generate) -> None:
    path = _copy(moe, tmp_path / "m")
    name = "model.layers.0.self_attn.q_norm.weight"
    _edit_tensors(path, lambda t: t.__setitem__(name, t[name][:-1].clone()))
    _assert_exit_2(generate(path), str(path), name, "(15,)")


@pytest.mark.slow
def test_expert_beyond_the_configured_count_is_named(moe: Path, tmp_path: Path, generate: Generate) -> None:
    path = _copy(moe, tmp_path / "m")
    extra = "model.layers.0.mlp.experts.4.gate_proj.weight"  # the config says 4 experts (0-3)
    _edit_tensors(path, lambda t: t.__setitem__(extra, t["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()))
    _assert_exit_2(generate(path), extra)


@pytest.mark.slow
def test_unsupported_rope_type_is_named(tmp_path: Path, generate: Generate) -> None:
    path = make_tiny_model(tmp_path / "m", "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "mrope-interleaved", "rope_theta": 10000.0}
    cfg.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(cfg))
    _assert_exit_2(generate(path), "mrope-interleaved")
