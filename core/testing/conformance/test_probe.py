"""Probe contract: register() is cheap and returns a class path; is_available() is fast, honest
(a reason when it says no) and initialises no device runtime. Checked in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from portside.contract import Platform
from portside.platform import PlatformEntry
from portside.testing.conformance.cases import contract_failure

PROBE_BUDGET_S = float(os.environ.get("PORTSIDE_PROBE_BUDGET_S", "2.0"))  # is_available(), seconds
REGISTER_BUDGET_S = 1.0


@pytest.fixture(scope="module")
def probe_report(conformance_entry: PlatformEntry) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "portside.testing.conformance.probe_worker", conformance_entry.entry_point],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        contract_failure("probe", f"register() or is_available() of {conformance_entry.package}:"
                         f"{conformance_entry.entry_point} raised in a fresh interpreter:\n{proc.stderr[-3000:]}")  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "error" in report:
        contract_failure("probe", report["error"])
    return report


def test_register_returns_a_class_path_cheaply(probe_report: dict, conformance_device: str) -> None:
    if probe_report["register_heavy"]:
        contract_failure("probe", f"register() imported heavy modules {probe_report['register_heavy']}; "
                         "it must only return the class path (import your runtime lazily)")  # fmt: skip
    if probe_report["register_runtimes"]:
        contract_failure("probe", f"register() initialised {probe_report['register_runtimes']}")
    if probe_report["register_s"] > REGISTER_BUDGET_S:
        contract_failure("probe", f"register() took {probe_report['register_s']:.2f}s (budget {REGISTER_BUDGET_S}s)")
    if probe_report["register_returned"] == "None":
        pytest.skip("register() returned None: the plugin says it cannot run here")
    if probe_report.get("name") != conformance_device:
        contract_failure("probe", f"register() points at a platform named {probe_report.get('name')!r}, "
                         f"not {conformance_device!r}")  # fmt: skip


def test_platform_module_import_is_cheap(probe_report: dict) -> None:
    if probe_report.get("import_heavy"):
        contract_failure("probe", f"importing the platform class imported {probe_report['import_heavy']}; "
                         "`portside devices` imports every platform class, so vendor runtimes and kernels "
                         "must be imported inside the methods that build the parts")  # fmt: skip


def test_is_available_is_fast_and_initialises_nothing(probe_report: dict) -> None:
    if probe_report["register_returned"] == "None":
        pytest.skip("register() returned None")
    if probe_report["probe_type"] != "Availability":
        contract_failure("probe", f"is_available() returned a {probe_report['probe_type']}, not an Availability")
    if probe_report["probe_heavy"]:
        contract_failure("probe", f"is_available() imported {probe_report['probe_heavy']}; probe with "
                         "importlib.util.find_spec, device files or environment variables instead")  # fmt: skip
    if probe_report["probe_runtimes"]:
        contract_failure("probe", f"is_available() initialised the device runtime ({probe_report['probe_runtimes']}); "
                         "it must not create a context or allocate memory")  # fmt: skip
    if probe_report["probe_s"] > PROBE_BUDGET_S:
        contract_failure("probe", f"is_available() took {probe_report['probe_s']:.2f}s (budget {PROBE_BUDGET_S}s)")
    if not probe_report["stable"]:
        contract_failure("probe", "two calls of is_available() disagreed")


def test_unavailable_says_why(probe_report: dict, conformance_entry: PlatformEntry) -> None:
    if probe_report["register_returned"] == "None":
        pytest.skip("register() returned None")
    if not probe_report["available"] and not probe_report["reason"].strip():
        contract_failure("probe", "is_available() said no without a reason; users see it in `portside devices`")
    # In-process discovery must agree with the fresh interpreter.
    if conformance_entry.availability.available != probe_report["available"]:
        contract_failure("probe", f"discovery says {conformance_entry.availability}, a fresh probe says "
                         f"available={probe_report['available']}")  # fmt: skip


def test_platform_declares_consistent_capabilities(conformance_platform: type[Platform]) -> None:
    p = conformance_platform
    for attr in ("name", "device_type", "dist_backend"):
        if not isinstance(getattr(p, attr, None), str) or not getattr(p, attr):
            contract_failure("platform", f"class variable {attr} must be a non-empty string")
    if not p.supported_dtypes or not p.block_sizes:
        contract_failure("platform", "supported_dtypes and block_sizes must not be empty")
    if p.default_block_size not in p.block_sizes:
        contract_failure("platform", f"default_block_size {p.default_block_size} is not in block_sizes {p.block_sizes}")
    if p.auto_dtype(p.supported_dtypes[0]) not in p.supported_dtypes:
        contract_failure("platform", "auto_dtype() chose a dtype the platform does not support")
    info = p.device_info()
    if info.count < 1 or info.total_memory <= 0 or not 0 <= info.free_memory <= info.total_memory:
        contract_failure("platform", f"device_info() is inconsistent for an available device: {info}")
    described = p.describe()
    if set(described) != {"attention", "graph", "collectives"}:
        contract_failure("platform", f"describe() must name attention, graph and collectives; got {described}")
