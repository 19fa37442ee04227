"""Backend options (issue 44, "platform data"): a platform declares the options only it
understands (`Platform.backend_options`), the user gives them as ``--backend-option KEY=VALUE``
or ``platform_options={KEY: VALUE}``, core refuses unknown keys and values outside an option's
choices naming the option, the platform and what it takes (exit 2 on the command line, ValueError
in Python), and `portside devices` lists them. ``--cpu-graph`` still works, with a warning."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from portside.cli import build_parser, main, parse_args
from portside.contract import (
    AttentionBackend,
    Availability,
    BackendOption,
    DeviceInfo,
    Platform,
    check_backend_options,
)
from portside.engine.args import EngineArgs
from portside.engine.args_cli import engine_kwargs
from portside.platform import PlatformEntry, format_backend_options, resolve_platform


class _VendorPlatform(Platform):
    """A plugin's platform with options of its own (nothing in it runs a model)."""

    name = "vendor-npu"
    device_type = "meta"
    dist_backend = "gloo"
    backend_options: ClassVar[tuple[BackendOption, ...]] = (
        BackendOption("npu_precision", "matmul precision of the vendor's kernels", ("fast", "exact"), "exact"),
        BackendOption("npu_streams", "command streams per device (a positive integer)"),
    )

    @classmethod
    def is_available(cls) -> Availability:
        return Availability.yes()

    @classmethod
    def device_info(cls) -> DeviceInfo:
        return DeviceInfo(name="vendor npu", count=1, total_memory=2**30, free_memory=2**30)

    @classmethod
    def attention_backend(cls, config) -> AttentionBackend:
        raise NotImplementedError

    @classmethod
    def check_and_update_config(cls, config):
        config = super().check_and_update_config(config)  # keys and choices, then what only the platform knows
        streams = config.option("npu_streams", "1")
        if not str(streams).isdigit() or int(streams) < 1:
            raise ValueError(f"npu_streams={streams!r}: give a positive integer")
        return config


def _cli_options(*argv: str) -> dict[str, str]:
    args = parse_args(build_parser(), ["generate", "hi", *argv])
    return engine_kwargs(args)["platform_options"]


def test_a_plugin_declares_its_options_and_core_checks_them(tiny_llama: Path) -> None:
    check_backend_options(_VendorPlatform, {"npu_precision": "fast", "npu_streams": "4"})
    with pytest.raises(ValueError, match=r"unknown vendor-npu backend option\(s\) \['npu_precission'\] \(did you mean "
                                         r"npu_precision\?\); it takes npu_precision, npu_streams"):
        check_backend_options(_VendorPlatform, {"npu_precission": "fast"})
    with pytest.raises(ValueError, match=r"vendor-npu backend option npu_precision='half': use one of \['fast', 'exact'\]"):
        check_backend_options(_VendorPlatform, {"npu_precision": "half"})
    # through the engine's arguments: the declaration first, then the platform's own check
    args = EngineArgs(model=str(tiny_llama), platform_options={"npu_precision": "fast", "npu_streams": "2"})
    assert args.create_engine_config(_VendorPlatform).option("npu_precision") == "fast"
    with pytest.raises(ValueError, match="npu_precision='half': use one of"):
        EngineArgs(model=str(tiny_llama), platform_options={"npu_precision": "half"}).create_engine_config(_VendorPlatform)
    with pytest.raises(ValueError, match="npu_streams='0': give a positive integer"):
        EngineArgs(model=str(tiny_llama), platform_options={"npu_streams": "0"}).create_engine_config(_VendorPlatform)
    # another platform's option is not this one's
    with pytest.raises(ValueError, match=r"unknown vendor-npu backend option\(s\) \['cpu_graph'\]"):
        EngineArgs(model=str(tiny_llama), platform_options={"cpu_graph": "eager"}).create_engine_config(_VendorPlatform)


def test_a_platform_without_options_refuses_any() -> None:
    class Bare(_VendorPlatform):
        name = "bare"
        backend_options = ()

    with pytest.raises(ValueError, match=r"unknown bare backend option\(s\) \['x'\]; it takes none"):
        check_backend_options(Bare, {"x": "1"})


def test_devices_lists_a_plugins_options() -> None:
    entry = PlatformEntry("vendor-npu", "vendor-pkg", _VendorPlatform, Availability.yes())
    text = format_backend_options([entry], width=80)
    assert text.splitlines()[1:] == [
        "vendor-npu:",
        "  npu_precision=fast|exact (default: exact)",
        "      matmul precision of the vendor's kernels",
        "  npu_streams=VALUE",
        "      command streams per device (a positive integer)",
    ]


def test_backend_option_flag_fills_platform_options() -> None:
    assert _cli_options() == {}
    assert _cli_options("--backend-option", "cpu_graph=inductor", "--backend-option", "cpu_threads = 2") == {
        "cpu_graph": "inductor", "cpu_threads": "2"}
    # a --config YAML mapping arrives as one JSON object
    assert _cli_options("--backend-option", '{"cpu_graph": "eager", "cpu_prepack": "off"}') == {
        "cpu_graph": "eager", "cpu_prepack": "off"}
    with pytest.raises(ValueError, match="--backend-option cpu_graph is given twice"):
        _cli_options("--backend-option", "cpu_graph=inductor", "--backend-option", "cpu_graph=eager")


def test_backend_option_without_a_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(build_parser(), ["generate", "hi", "--backend-option", "cpu_graph"])
    assert e.value.code == 2
    assert "'cpu_graph': expected KEY=VALUE, e.g. --backend-option cpu_graph=inductor" in capsys.readouterr().err


def test_cpu_graph_flag_still_works_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.warns(DeprecationWarning, match="--cpu-graph is deprecated .*; use --backend-option cpu_graph=inductor"):
        assert _cli_options("--cpu-graph", "inductor") == {"cpu_graph": "inductor"}
    assert "use --backend-option cpu_graph=inductor" in caplog.text
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="--cpu-graph inductor conflicts with "
                                                                           "--backend-option cpu_graph=eager"):
        _cli_options("--cpu-graph", "inductor", "--backend-option", "cpu_graph=eager")


def test_unknown_backend_option_exits_2_on_the_command_line(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "hi", "--model", str(tiny_llama), "--device", "cpu", "--backend-option", "cpu_grpah=eager"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "unknown cpu backend option(s) ['cpu_grpah'] (did you mean cpu_graph?); it takes cpu_graph, cpu_attention" in err
    code = main(["generate", "hi", "--model", str(tiny_llama), "--device", "cpu", "--backend-option", "cpu_graph=tvm"])
    assert code == 2
    assert "cpu backend option cpu_graph='tvm': use one of ['eager', 'inductor', 'openvino']" in capsys.readouterr().err


def test_every_in_tree_platform_declares_its_eager_options() -> None:
    """--enforce-eager sets backend options: each must be one its platform declares."""
    for name in ("cpu", "cuda", "rocm", "tpu"):
        try:
            platform = resolve_platform(name)
        except Exception:  # unavailable here: read the class itself
            platform = _platform_class(name)
        declared = {o.name: o for o in platform.backend_options}
        for key, value in (platform.eager_options or {}).items():
            assert key in declared, (name, key)
            assert declared[key].choices is None or value in declared[key].choices, (name, key, value)


def _platform_class(name: str) -> type[Platform]:
    from portside.platform import discover_platforms

    entry = next(e for e in discover_platforms() if e.name == name)
    assert entry.platform is not None
    return entry.platform


def test_platform_data_replaces_device_checks() -> None:
    """What core once decided by testing the device's name is each platform's declared data."""
    cpu, cuda, tpu = (_platform_class(n) for n in ("cpu", "cuda", "tpu"))
    assert (cpu.host_device, cuda.host_device, tpu.host_device) == (True, False, False)
    assert [p.start_method() for p in (cpu, cuda, tpu)] == ["forkserver", "spawn", "spawn"]
    assert [p.ray_resource_name() for p in (cpu, cuda, tpu)] == ["CPU", "GPU", "TPU"]
    assert cpu.device(3) == torch.device("cpu") and cuda.device(1) == torch.device("cuda", 1)
    # a plugin that declares none of it: derived from its device type, as core decided before
    assert not _VendorPlatform.host_device and _VendorPlatform.start_method() == "spawn"
    assert _VendorPlatform.device(2) == torch.device("meta", 2)

    class HostSimulation(_VendorPlatform):
        device_type = "cpu"

    assert HostSimulation.host_device and HostSimulation.start_method() == "forkserver"
    assert HostSimulation.ray_resource_name() == "CPU" and HostSimulation.device(1) == torch.device("cpu")


def test_namespace_without_backend_flags_has_no_options() -> None:
    assert engine_kwargs(argparse.Namespace())["platform_options"] == {}
