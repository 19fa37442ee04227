"""`portside` usage errors, help, device names and tables as a user meets them (issue 25):
suggestions for misspelt flags and subcommands under the subcommand's own usage, defaults in
--help, case-insensitive --device, tables that fit 80 columns, --config YAML, vLLM's flags."""

from __future__ import annotations

import argparse
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
        # generate sizes its batch (and KV cache) for its one prompt's samples
        assert f"most requests running at once (default: {'-n' if command == 'generate' else 128})" in text
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
    out = run_cli(capsys, monkeypatch, "devices")
    assert all(len(line) <= 80 for line in out.splitlines()), "\n".join(l for l in out.splitlines() if len(l) > 80)
    lines = out.split("\n\n", 1)[0].splitlines()  # the table; the backend options follow a blank line
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


@pytest.mark.parametrize(("argv", "flag"), [
    (("--cpu-offload-gb", "8"), "--cpu-offload-gb 8"),
    (("--load-format", "bitsandbytes"), "--load-format bitsandbytes"),
    (("--enable-sleep-mode",), "--enable-sleep-mode"),
    (("--mm-processor-kwargs", "{}"), "--mm-processor-kwargs"),
    (("--tokenizer-mode", "mistral"), "--tokenizer-mode mistral"),
    (("--tokenizer-mode", "slow"), "--tokenizer-mode slow"),
    (("--revision", "v1.0"), "--revision"),
    (("--code-revision", "main"), "--code-revision"),
    (("--tokenizer-revision", "abc123"), "--tokenizer-revision"),
    (("--hf-config-path", "/cfg"), "--hf-config-path"),
    (("--config-format", "mistral"), "--config-format mistral"),
    (("--model-impl", "transformers"), "--model-impl transformers"),
    (("--skip-tokenizer-init",), "--skip-tokenizer-init"),
    (("--override-generation-config", '{"temperature": 0.5}'), "--override-generation-config"),
    (("--rope-scaling", '{"rope_type": "yarn"}'), "--rope-scaling"),
    (("--rope-theta", "1000000"), "--rope-theta"),
    (("--disable-sliding-window",), "--disable-sliding-window"),
    (("--enable-expert-parallel",), "--enable-expert-parallel"),
    (("--num-gpu-blocks-override", "100"), "--num-gpu-blocks-override"),
    (("--kv-cache-memory-bytes", "4800M"), "--kv-cache-memory-bytes"),
    (("--logits-processors", "mod:Cls"), "--logits-processors"),
    (("--quantization-param-path", "scales.json"), "--quantization-param-path"),
])  # fmt: skip
def test_unsupported_vllm_flags_say_so(argv: tuple[str, ...], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (("serve",), ("generate", "hi")):
        code, err = parse(*command, *argv, capsys=capsys)
        assert code == 2 and f"portside does not support {flag} (yet): " in err, (argv, err)
        assert "unknown flag" not in err and "unrecognized arguments" not in err


def test_unsupported_vllm_flags_accept_their_harmless_values() -> None:
    args = parse_args(build_parser(), ["serve", "-pp", "1", "--load-format", "safetensors", "--swap-space", "0",
                                       "--distributed-executor-backend", "mp", "--cpu-offload-gb", "0",
                                       "--tokenizer-mode", "auto", "--config-format", "hf", "--model-impl", "auto",
                                       "--preemption-mode", "recompute", "--speculative-config", '{"method": "ngram"}'])
    assert args.command == "serve" and args.speculative_config == '{"method": "ngram"}'  # supported since issue 22


@pytest.mark.parametrize(("argv", "why"), [
    (("--download-dir", "/models"), "portside downloads no checkpoints"),
    (("--hf-token",), "never contacts the Hugging Face Hub"),  # vLLM's `--hf-token` alone: use the stored token
    (("--hf-token", "hf_xxx"), "never contacts the Hugging Face Hub"),
    (("--ignore-patterns", "original/**"), "portside downloads no checkpoints"),
    (("--max-parallel-loading-workers", "2"), "weights load in one pass"),
    (("--disable-frontend-multiprocessing",), "share one process"),
    (("--disable-async-output-proc",), "after each step"),
    (("--async-scheduling",), "after the previous one finishes"),
    (("--compilation-config", '{"level": 3}'), "--enforce-eager turns them off"),
    (("-O3",), "--enforce-eager turns them off"),
    (("--max-seq-len-to-capture", "8192"), "--enforce-eager turns them off"),
    (("--cuda-graph-sizes", "1", ), "--enforce-eager turns them off"),
    (("--disable-custom-all-reduce",), "the platform's collective op"),
    (("--use-v2-block-manager",), "the only one"),
    (("--num-scheduler-steps", "8"), "multi-step scheduling does not exist here"),
    (("--num-lookahead-slots", "4"), "--speculative-config"),
    (("--scheduler-delay-factor", "0.5"), "no separate limit on partial prefills"),
    (("--max-num-partial-prefills", "2"), "no separate limit on partial prefills"),
    (("--max-long-partial-prefills", "1"), "no separate limit on partial prefills"),
    (("--long-prefill-token-threshold", "512"), "no separate limit on partial prefills"),
    (("--tokenizer-pool-size", "4"), "offload threads"),
    (("--enable-reasoning",), "--reasoning-parser NAME alone"),
    (("--enable-log-requests",), "logged by default"),
    (("--disable-fastapi-docs",), "no /docs"),
])  # fmt: skip
def test_vllm_tuning_flags_without_effect_warn(argv: tuple[str, ...], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Flags whose subject does not exist here, with the same results either way: accepted (the
    rest of the command line still parses), with a warning saying why they do nothing."""
    args = parse_args(build_parser(), ["serve", "m", *argv, "--port", "9001"])
    assert (args.command, args.model, args.port) == ("serve", "m", 9001)
    err = capsys.readouterr().err
    assert f"portside: warning: {argv[0][:2] if argv[0] == '-O3' else argv[0]} has no effect: " in err and why in err, err


def test_vllm_flags_reach_engine_args() -> None:
    from portside.engine.args import EngineArgs
    from portside.engine.args_cli import engine_kwargs

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


def test_config_yaml_sets_the_programs_own_flags_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every flag is settable from the file: --log-level goes before the subcommand on a command
    line, and a file key of it used to exit 2 as unknown."""
    cfg = tmp_path / "c.yaml"
    for command, more in ((["serve"], "port: 8001\n"), (["generate", "hi"], "max-tokens: 7\n")):
        cfg.write_text("log-level: INFO\ndisable-custom-all-reduce: true\nnum-scheduler-steps: 8\n" + more)
        args = parse_args(build_parser(), [*command, "--config", str(cfg)])
        assert args.log_level == "INFO" and (args.port if command == ["serve"] else args.max_tokens) in (8001, 7)
        assert "--num-scheduler-steps has no effect" in capsys.readouterr().err  # a vLLM tuning flag from the file
    cfg.write_text("log-level: INFO\n")
    args = parse_args(build_parser(), ["--log-level", "DEBUG", "serve", "--config", str(cfg)])
    assert args.log_level == "DEBUG"  # the command line still wins
    cfg.write_text("log_levl: INFO\n")
    code, err = parse("serve", "--config", str(cfg), capsys=capsys)
    assert code == 2 and "unknown key 'log_levl'; did you mean --log-level?" in err
    # every flag of both parsers has a key the file accepts
    parser = build_parser()
    for command in ("generate", "serve"):
        sub = parser.subparser(command)
        for action in sub._actions + parser._actions:
            flag = next((s for s in action.option_strings if s.startswith("--")), None)
            if flag is None or flag in ("--help", "--config") or isinstance(action, argparse._SubParsersAction):
                continue
            from portside.cli_config import config_argv

            cfg.write_text(f"{flag[2:]}: null\n")  # null: known, and left unset
            assert config_argv(str(cfg), sub, top=parser) == ([], {}, []), flag


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
    from portside.engine.args import EngineArgs
    from portside.engine.args_cli import engine_kwargs
    from portside.platform import resolve_platform

    args = parse_args(build_parser(), ["serve", str(tiny_llama), "--no-enable-chunked-prefill",
                                       "--max-num-batched-tokens", "16", "--max-model-len", "64"])
    with pytest.raises(ValueError, match="with chunked prefill disabled"):
        EngineArgs(**engine_kwargs(args), model=args.model).create_engine_config(resolve_platform("cpu"))
