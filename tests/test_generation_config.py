"""Sampling defaults from a model's generation_config.json (`--generation-config auto|vllm|PATH`),
applied as vLLM applies them: by `LLM` (`get_default_sampling_params`), by the server to the
fields a request leaves unset, and by `portside generate` to the flags not passed."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from portside.generation_config import generation_defaults, read_sampling_fields
from portside.sampling_params import SamplingParams

# greedy, so outputs compare exactly; the penalty makes "applied" visible in the tokens too
GEN = {"do_sample": False, "temperature": 0.0, "repetition_penalty": 1.3,
       "max_new_tokens": 6}
EXPLICIT = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=6)
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def gen_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a generation_config.json that sets sampling defaults."""
    folder = tmp_path_factory.mktemp("gen_model") / "model"
    shutil.copytree(tiny_llama, folder)
    file = folder / "generation_config.json"
    file.write_text(json.dumps({**(json.loads(file.read_text()) if file.is_file() else {}), **GEN}))
    return folder


def _write(folder: Path, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


def test_fields_map_as_vllm_maps_them(tmp_path):
    data = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
            "max_new_tokens": 128, "do_sample": True, "eos_token_id": [1, 2], "max_length": 4096, "top_a": None}
    file = _write(tmp_path, data) / "generation_config.json"
    assert read_sampling_fields(str(file)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                               "repetition_penalty": 1.1, "max_tokens": 128}
    assert generation_defaults("auto", str(tmp_path))["max_tokens"] == 128
    assert generation_defaults("vllm", str(tmp_path)) == {}
    assert generation_defaults("auto", str(_write(tmp_path / "plain", {"eos_token_id": 2}))) == {}
    assert generation_defaults("auto", str(tmp_path / "no-file-here")) == {}


def test_path_mode_reads_that_folder_and_bad_paths_are_clear_errors(tmp_path):
    model = _write(tmp_path / "model", {"temperature": 0.7})
    other = _write(tmp_path / "other", {"temperature": 0.3, "top_k": 5})
    assert generation_defaults(str(other), str(model)) == {"temperature": 0.3, "top_k": 5}
    assert generation_defaults(str(other / "generation_config.json"), str(model)) == {"temperature": 0.3, "top_k": 5}
    with pytest.raises(ValueError, match="no such folder.*'auto'.*'vllm'"):
        generation_defaults(str(tmp_path / "missing"), str(model))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no generation_config.json"):
        generation_defaults(str(tmp_path / "empty"), str(model))
    with pytest.raises(ValueError, match="top_k must be an integer"):
        generation_defaults("auto", str(_write(tmp_path / "bad", {"top_k": "many"})))
    with pytest.raises(ValueError, match="top_p.*--generation-config vllm"):
        generation_defaults("auto", str(_write(tmp_path / "range", {"top_p": 1.5})))
    (tmp_path / "json" / "generation_config.json").parent.mkdir()
    (tmp_path / "json" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable generation config"):
        generation_defaults("auto", str(tmp_path / "json"))


def test_llm_applies_the_model_defaults_and_vllm_mode_ignores_them(gen_model):
    from portside import LLM

    with LLM(str(gen_model), device="cpu", num_kv_blocks=64) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=6)
        (default,) = llm.generate(PROMPT, use_tqdm=False)
        (explicit,) = llm.generate(PROMPT, EXPLICIT, use_tqdm=False)
        assert default.outputs[0].token_ids == explicit.outputs[0].token_ids
        assert 1 <= len(default.outputs[0].token_ids) <= 6
        (chat,) = llm.chat([{"role": "user", "content": "hello"}], use_tqdm=False)
        (chat_explicit,) = llm.chat([{"role": "user", "content": "hello"}], EXPLICIT, use_tqdm=False)
        assert chat.outputs[0].token_ids == chat_explicit.outputs[0].token_ids
        # an explicit value wins over the model's default
        (longer,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), use_tqdm=False)
        assert len(longer.outputs[0].token_ids) == 9
    with LLM(str(gen_model), device="cpu", num_kv_blocks=64, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_llm_bad_generation_config_path_fails_before_loading(gen_model, tmp_path):
    from portside import LLM

    with pytest.raises(ValueError, match="--generation-config .*no such folder"):
        LLM(str(gen_model), device="cpu", generation_config=str(tmp_path / "nope"))


def test_sampling_params_from_a_request_use_defaults_only_for_unset_fields():
    from portside.server.pipeline import sampling_params
    from portside.server.protocol import ChatCompletionRequest, CompletionRequest

    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 7, "max_tokens": 50}
    msgs = [{"role": "user", "content": "hi"}]
    p = sampling_params(ChatCompletionRequest(model="m", messages=msgs), max_tokens=1000, logprobs=None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.2, 0.9, 7, 50)
    req = ChatCompletionRequest(model="m", messages=msgs, temperature=1.0, top_k=-1, max_completion_tokens=300)
    p = sampling_params(req, max_tokens=300, logprobs=None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 0.9, -1, 300)
    p = sampling_params(CompletionRequest(model="m", prompt="x", max_tokens=80), max_tokens=80, logprobs=None,
                        defaults=defaults)
    assert p.max_tokens == 80
    p = sampling_params(CompletionRequest(model="m", prompt="x"), max_tokens=16, logprobs=None, defaults=defaults)
    assert (p.temperature, p.max_tokens) == (0.2, 16)  # the endpoint's own default 16 is already lower
    p = sampling_params(CompletionRequest(model="m", prompt="x"), max_tokens=16, logprobs=None)
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, -1)  # no generation config: OpenAI's defaults


def _generate(capsys, caplog, *args: str) -> tuple[int, str, str]:
    """`portside generate` in this process (the subprocess path is tests/test_cli.py's): exit
    code, stdout, and stderr with the log records."""
    from portside.cli import main

    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        code = main(["generate", PROMPT, "--raw", "--device", "cpu", "--num-kv-blocks", "64", *args])
    out, err = capsys.readouterr()
    return code, out, err + caplog.text


def test_cli_generate_uses_the_defaults_for_flags_not_passed(gen_model, tmp_path, capsys, caplog):
    model = ("--model", str(gen_model))
    default = _generate(capsys, caplog, *model)
    explicit = _generate(capsys, caplog, *model, "--temperature", "0", "--repetition-penalty", "1.3", "--max-tokens", "6")
    assert default[0] == 0 and explicit[0] == 0, default[2] + explicit[2]
    assert default[1] == explicit[1] and default[1].strip()
    assert "default sampling parameters from" in default[2] and "repetition_penalty=1.3" in default[2]
    code, _, err = _generate(capsys, caplog, *model, "--generation-config", str(tmp_path / "missing"))
    assert code == 2 and "no such folder" in err and "'vllm'" in err


@pytest.mark.slow
def test_cli_generate_vllm_mode_and_a_path(gen_model, tmp_path, capsys, caplog):
    model = ("--model", str(gen_model))
    explicit = _generate(capsys, caplog, *model, "--temperature", "0", "--repetition-penalty", "1.3", "--max-tokens", "6")
    # --generation-config vllm: the CLI's own defaults (greedy, 64 tokens, no penalty)
    ignored = _generate(capsys, caplog, *model, "--generation-config", "vllm")
    plain = _generate(capsys, caplog, *model, "--generation-config", "vllm", "--temperature", "0", "--max-tokens", "64",
                      "--repetition-penalty", "1.0")
    assert ignored[0] == 0 and ignored[1] == plain[1], ignored[2]
    assert "default sampling parameters" not in ignored[2]
    # PATH: another folder's generation config; a bad PATH exits 2 naming the fix
    other = _write(tmp_path / "other", {"temperature": 0.0, "max_new_tokens": 6, "repetition_penalty": 1.3})
    from_path = _generate(capsys, caplog, *model, "--generation-config", str(other))
    assert from_path[0] == 0 and from_path[1] == explicit[1], from_path[2]
