"""Decoding strategies through `portside serve`: a server with `--speculative-config` answers
greedy completions (streamed and not) with transformers' tokens and counts proposals in vLLM's
`vllm:spec_decode_*` series; a bad config exits 2 naming the problem."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import post, sse_events
from openai_schemas import validate
from server_process import ServerProcess

from portside.testing.tiny import hf_greedy

pytestmark = pytest.mark.slow
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("spec_server") / "server.log"
    proc = ServerProcess(tiny_llama, log, "--max-model-len", "256", "--block-size", "4", "--num-kv-blocks", "400",
                         "--speculative-config", json.dumps(SPEC))
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


def test_speculative_server_gives_transformers_greedy_tokens(spec_server: ServerProcess, server: ServerProcess,
                                                            tiny_llama: Path) -> None:
    """The text equals the plain server's (whose tokens are checked against transformers
    elsewhere) and transformers' tokens decoded (up to a character still incomplete at the end)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    base = tok("the quick brown fox jumps over").input_ids
    ids = base + hf_greedy(tiny_llama, base, 10) + base  # quotes the continuation: proposals find it
    want = hf_greedy(tiny_llama, ids, 20)
    request = {"model": "tiny", "prompt": ids, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    r = post(spec_server, "/v1/completions", request)
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["text"] == post(server, "/v1/completions", request).json()["choices"][0]["text"]
    assert tok.decode(want, skip_special_tokens=True).startswith(choice["text"].rstrip("\ufffd"))
    assert len(choice["logprobs"]["tokens"]) == 20 and body["usage"]["completion_tokens"] == 20
    events = sse_events(spec_server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 20,
                                                         "temperature": 0, "ignore_eos": True, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]
    m = spec_server.wait_idle()
    drafts = next(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    proposed = next(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_draft_tokens_total"))
    accepted = next(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert drafts > 0 and proposed >= accepted >= 0
    assert any(k.startswith('vllm:spec_decode_num_accepted_tokens_per_pos_total{') for k in m)


@pytest.mark.parametrize("value,message", [
    ('{"method": "eagle9", "num_speculative_tokens": 2}', "unknown method 'eagle9'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer from 1"),
    ('{"model": "/no/such/draft", "num_speculative_tokens": 2}', "draft-model speculation"),
    ("ngram", "not valid JSON"),
])
def test_bad_speculative_config_exits_2(tiny_llama: Path, value: str, message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "portside.cli", "serve", str(tiny_llama), "--device", "cpu", "--port", "0",
                        "--speculative-config", value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
