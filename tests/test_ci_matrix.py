"""The CI definition stays one source of truth: the workflow names every leg of ci/legs.toml,
every leg calls ci/run-leg, and the workflow files pass the GitHub-workflow schema check."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"


def legs() -> dict[str, dict]:
    with open(ROOT / "ci" / "legs.toml", "rb") as f:
        return tomllib.load(f)["legs"]


def workflow() -> dict:
    return yaml.safe_load((WORKFLOWS / "ci.yml").read_text())


def test_every_leg_is_in_the_workflow_matrix():
    jobs = workflow()["jobs"]
    cpu = set(jobs["cpu-legs"]["strategy"]["matrix"]["leg"])
    hw = {entry["leg"] for entry in jobs["hardware-legs"]["strategy"]["matrix"]["include"]}
    defined = legs()
    assert cpu | hw == set(defined), f"workflow legs {sorted(cpu | hw)} != ci/legs.toml legs {sorted(defined)}"
    assert cpu == {n for n, leg in defined.items() if leg["hardware"] == "cpu"}
    assert not cpu & hw


def test_every_leg_runs_through_run_leg():
    for name in ("cpu-legs", "hardware-legs"):
        steps = workflow()["jobs"][name]["steps"]
        assert any("ci/run-leg ${{ matrix.leg }}" in s.get("run", "") for s in steps), name


def test_legs_are_well_formed():
    for name, leg in legs().items():
        assert set(leg) >= {"description", "pins", "extras", "env", "pytest", "hardware", "cpu_ci"}, name
        if leg["cpu_ci"]:
            assert leg["hardware"] == "cpu", f"{name}: only cpu legs can run in .ci/run"
    assert legs()["main"]["cpu_ci"], "the main leg always runs"


@pytest.mark.skipif(shutil.which("check-jsonschema") is None and not Path(sys.executable).with_name("check-jsonschema").exists(),
                    reason="check-jsonschema is not installed (pip install check-jsonschema)")
def test_workflows_validate_against_the_github_workflow_schema():
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    files = sorted(str(p) for p in WORKFLOWS.glob("*.yml"))
    proc = subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
