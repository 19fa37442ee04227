"""`portside` usage errors, help, device names and tables as a user meets them (issue 25):
suggestions for misspelt flags and subcommands under the subcommand's own usage, defaults in
--help, case-insensitive --device, tables that fit 80 columns, --config YAML, vLLM's flags."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from portside.cli import build_parser, parse_args


def portside(*args: str, columns: int = 80, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "portside.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": str(columns)})


def parse(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit code, stderr) of parsing `argv` in-process, as `portside` does."""
    with pytest.raises(SystemExit) as e:
        parse_args(build_parser(), list(argv))
    return int(e.value.code or 0), capsys.readouterr().err


def test_misspelt_flag_suggests_the_flag_under_the_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = parse("serve", "--prot", "8001", capsys=capsys)
    assert code == 2
    assert "unknown flag --prot; did you mean --port?" in err
    assert err.startswith("usage: portside serve ") and "{devices,models,generate,serve}" not in err
    code, err = parse("generate", "hi", "--max-tokns", "3", capsys=capsys)
    assert code == 2 and "unknown flag --max-tokns; did you mean --max-tokens?" in err
    assert err.startswith("usage: portside generate ")
    code, err = parse("serve", "--max-model-length=4096", capsys=capsys)
    assert code == 2 and "did you mean --max-model-len?" in err
    code, err = parse("serve", "--zzqqxx", capsys=capsys)
    assert code == 2 and "unknown flag --zzqqxx" in err and "did you mean" not in err


def test_misspelt_subcommand_suggests_it(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = parse("serv", capsys=capsys)
    assert code == 2 and "did you mean serve?" in err
    code, err = parse("devcies", capsys=capsys)
    assert code == 2 and "did you mean devices?" in err


def test_bad_values_exit_2_with_the_subcommand_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = parse("generate", "hi", "--max-tokens", "many", capsys=capsys)
    assert code == 2 and "invalid int value: 'many'" in err and err.startswith("usage: portside generate")


def test_help_shows_defaults_once(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            parse_args(build_parser(), [command, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # unwrap argparse's line breaks
        assert "most requests running at once (default: 128)" in text
        assert "shard the model over this many devices (default: 1)" in text
        assert "--max-logprobs MAX_LOGPROBS most logprobs" in text and "(-1: no limit) (default: 20)" in text
        assert "(default: None)" not in text and "(default: False)" not in text
        sub = build_parser().subparser(command)
        formatter = sub._get_formatter()
        for action in sub._actions:  # one statement of a default per flag: its own wording, or the one added
            shown = (formatter._get_help_string(action) or "").replace("%(default)s", "X")
            assert shown.count("(default") <= 1, shown
            if "default" in (action.help or "").lower():
                assert shown == (action.help or "").replace("%(default)s", "X"), shown
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "TCP port to listen on (default 8000) --" in text  # its own wording, not doubled


def test_device_names_are_case_insensitive() -> None:
    from portside.platform import DeviceSelectionError, resolve_platform

    assert resolve_platform("CPU").name == "cpu"
    assert resolve_platform(" Cpu ").name == "cpu"
    with pytest.raises(DeviceSelectionError, match="no platform named 'CPUX'"):
        resolve_platform("CPUX")


def run_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    from portside.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_devices_table_fits_80_columns_and_aligns(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    lines = run_cli(capsys, monkeypatch, "devices").splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(line for line in lines if len(line) > 80)
    header = lines[0]
    starts = [header.index(col) for col in ("STATUS", "PACKAGE", "ATTENTION", "GRAPH", "COLLECTIVES")]
    for line in lines[1:]:
        if len(line) - len(line.lstrip()) == 4:  # a reason (and its wrapped lines), indented 4 under its device
            continue
        # a device row has every cell, each starting at its header's column; a continuation line
        # (a cell's further alternatives) has text only at column starts
        for start in starts:
            if line[:1] != " ":
                assert line[start - 2:start] == "  " and line[start] != " ", (line, start)
        for word in re.finditer(r"\S+", line):
            assert word.start() in [0, *starts], (line, word.group())
    rows = {line.split()[0]: i for i, line in enumerate(lines) if line and not line.startswith(" ")}
    cuda = lines[rows["cuda"]]
    assert cuda.split()[1] == "unavailable"
    assert lines[rows["cuda"] + 1].startswith("    reason: ")  # the reason on its own line, not overflowing the row


def test_models_table_fits_80_columns(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    lines = run_cli(capsys, monkeypatch, "models").splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    starts = [m.start() for m in re.finditer(r"(?<=  )\S", lines[0])]
    for line in lines[1:]:
        if line and not line.startswith("needs") and "  " in line:
            assert all(line[s - 1] == " " and line[s] != " " for s in starts), line


def test_unsupported_vllm_flags_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in [
        (("--pipeline-parallel-size", "2"), "--pipeline-parallel-size 2"),
        (("-pp", "4"), "-pp 4"),
        (("--cpu-offload-gb", "8"), "--cpu-offload-gb 8"),
        (("--speculative-config", '{"method": "ngram"}'), "--speculative-config"),
        (("--kv-transfer-config", "{}"), "--kv-transfer-config"),
        (("--load-format", "bitsandbytes"), "--load-format bitsandbytes"),
        (("--distributed-executor-backend", "ray"), "--distributed-executor-backend ray"),
        (("--enable-sleep-mode",), "--enable-sleep-mode"),
        (("--mm-processor-kwargs", "{}"), "--mm-processor-kwargs"),
        (("--limit-mm-per-prompt", "image=2"), "--limit-mm-per-prompt"),
    ]:
        code, err = parse("serve", *argv, capsys=capsys)
        assert code == 2 and f"portside does not support {flag} (yet): " in err, (argv, err)
    # the values that ask for nothing portside lacks are fine
    args = parse_args(build_parser(), ["serve", "-pp", "1", "--load-format", "safetensors", "--swap-space", "0",
                                       "--distributed-executor-backend", "mp", "--cpu-offload-gb", "0"])
    assert args.command == "serve"
    # vLLM's default --swap-space 4 tunes nothing here: accepted, with a warning saying why
    args = parse_args(build_parser(), ["serve", "--swap-space", "4"])
    assert args.command == "serve" and "--swap-space has no effect: preempted requests are recomputed" in capsys.readouterr().err


def test_vllm_flags_reach_engine_args() -> None:
    from portside.engine.args import EngineArgs, engine_kwargs

    args = parse_args(build_parser(), ["serve", "m", "--gpu-memory-utilization", "0.9", "--max-model-len", "4096",
                                       "--no-enable-chunked-prefill", "--enforce-eager", "--max-logprobs", "5",
                                       "--trust-remote-code"])
    e = EngineArgs(**engine_kwargs(args))
    assert (e.gpu_memory_utilization, e.max_model_len, e.enable_chunked_prefill, e.enforce_eager, e.max_logprobs,
            e.trust_remote_code) == (0.9, 4096, False, True, 5, True)


def test_config_yaml_applied_and_overridden(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /models/x\nport: 9000\nmax_model_len: 1024\nserved-model-name: [a, b]\n"
                   "enable-prefix-caching: false\nenforce-eager: true\nhost: 0.0.0.0\n")
    args = parse_args(build_parser(), ["serve", "--config", str(cfg), "--port", "9100"])
    assert args.model == "/models/x" and args.port == 9100 and args.max_model_len == 1024
    assert args.served_model_name == ["a", "b"] and args.enable_prefix_caching is False and args.enforce_eager
    assert args.host == "0.0.0.0"
    args = parse_args(build_parser(), ["serve", "/models/y", "--config", str(cfg), "--no-enforce-eager"
                                       if False else "--host", "127.0.0.1"])
    assert args.model == "/models/y" and args.host == "127.0.0.1" and args.port == 9000


def test_config_yaml_unknown_key_suggests_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_model_length: 1024\n")
    code, err = parse("serve", "--config", str(cfg), capsys=capsys)
    assert code == 2 and "unknown key 'max_model_length'; did you mean --max-model-len?" in err
    cfg.write_text("- a list\n")
    code, err = parse("serve", "--config", str(cfg), capsys=capsys)
    assert code == 2 and "expected a mapping of flag names to values" in err
    code, err = parse("serve", "--config", str(tmp_path / "missing.yaml"), capsys=capsys)
    assert code == 2 and "cannot read it" in err
    cfg.write_text("cpu-offload-gb: 4\n")  # an unsupported vLLM flag from the file says so too
    code, err = parse("serve", "--config", str(cfg), capsys=capsys)
    assert code == 2 and "portside does not support --cpu-offload-gb 4" in err


def test_no_chunked_prefill_reaches_the_engine(tiny_llama: Path) -> None:
    from portside.engine.args import EngineArgs, engine_kwargs
    from portside.platform import resolve_platform

    args = parse_args(build_parser(), ["serve", str(tiny_llama), "--no-enable-chunked-prefill",
                                       "--max-num-batched-tokens", "16", "--max-model-len", "64"])
    with pytest.raises(ValueError, match="with chunked prefill disabled"):
        EngineArgs(**engine_kwargs(args), model=args.model).create_engine_config(resolve_platform("cpu"))
