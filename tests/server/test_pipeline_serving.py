"""`portside serve -pp 2`: completions, streamed and not, carry transformers'
greedy tokens and validate against OpenAI's schemas; the server stops cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import post, sse_events
from openai_schemas import validate
from server_process import ServerProcess

from portside.testing.tiny import hf_greedy

pytestmark = pytest.mark.slow


def test_pipeline_parallel_server_gives_transformers_greedy_tokens(tiny_llama: Path, tmp_path: Path,
                                                                   server: ServerProcess) -> None:
    """The text equals the PP 1 server's and transformers' tokens decoded (up to a character still
    incomplete at the end). (TP 2 x PP 2 is checked offline in tests/test_pipeline_parallel.py: the
    server adds nothing to it but four processes on CI's two cores.)"""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tiny_llama))("the quick brown fox jumps over the lazy dog").input_ids
    want = hf_greedy(tiny_llama, ids, 16)
    proc = ServerProcess(tiny_llama, tmp_path / "server.log", "--max-model-len", "128", "--block-size", "4",
                         "--num-kv-blocks", "64", "-pp", "2")
    try:
        proc.wait_ready()
        request = {"model": "tiny", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        r = post(proc, "/v1/completions", request)
        assert r.status_code == 200, r.text
        body = r.json()
        validate("CreateCompletionResponse", body)
        assert body["usage"]["completion_tokens"] == 16
        tok = AutoTokenizer.from_pretrained(str(tiny_llama))
        text = body["choices"][0]["text"]
        assert text == post(server, "/v1/completions", request).json()["choices"][0]["text"]
        assert tok.decode(want, skip_special_tokens=True).startswith(text.rstrip("\ufffd"))
        events = sse_events(proc, "/v1/completions", request | {"stream": True, "logprobs": None})
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text
    finally:
        assert proc.terminate() == 0, proc.log()[-3000:]
