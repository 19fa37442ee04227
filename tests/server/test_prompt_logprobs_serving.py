"""prompt_logprobs and best_of over HTTP on the shared server: vLLM's field shapes (completions: on
every choice; chat: on the response, over the rendered template), echo with logprobs, values equal
to transformers' log_softmax, best_of's choice and usage; bodies validated against OpenAI's schemas."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import post
from openai_schemas import validate
from server_process import ServerProcess

from portside.testing.tiny import hf_logits

PROMPT = "the quick brown fox jumps over the lazy dog while a small cat sleeps"
MSG = [{"role": "user", "content": "the quick brown fox"}]


def prompt_ids(tiny_llama: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))(text).input_ids


def assert_matches_oracle(tiny_llama: Path, ids: list[int], got: list[Any], k: int) -> None:
    """vLLM's JSON shape: None first, then {token id: {logprob, rank, decoded_token}} holding
    the prompt token and the top-k, equal to transformers' values."""
    ref = torch.log_softmax(hf_logits(tiny_llama, ids), dim=-1)
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        row, entry = ref[j - 1], got[j]
        top_vals, top_ids = torch.topk(row, k)
        assert set(entry) == {str(ids[j]), *(str(t) for t in top_ids.tolist())}
        tok = entry[str(ids[j])]
        assert tok["logprob"] == pytest.approx(row[ids[j]].item(), abs=1e-4)
        assert tok["rank"] == 1 + int((row > row[ids[j]]).sum())
        for r, (tid, val) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), start=1):
            assert entry[str(tid)]["logprob"] == pytest.approx(val, abs=1e-4) and entry[str(tid)]["rank"] == r
            assert isinstance(entry[str(tid)]["decoded_token"], str)


def test_completions_prompt_logprobs_on_every_choice(server: ServerProcess, tiny_llama: Path) -> None:
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "n": 2, "seed": 5,
                                         "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateCompletionResponse", body)
    ids = prompt_ids(tiny_llama, PROMPT)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert len(body["choices"]) == 2
    assert_matches_oracle(tiny_llama, ids, body["choices"][0]["prompt_logprobs"], 2)
    assert body["choices"][1]["prompt_logprobs"] == body["choices"][0]["prompt_logprobs"]
    plain = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]  # not asked: not there


def test_completions_echo_with_logprobs(server: ServerProcess, tiny_llama: Path) -> None:
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "echo": True,
                                         "logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = prompt_ids(tiny_llama, PROMPT)
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(ids) + 4 == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    # the first prompt token has no logprob: null, as OpenAI's legacy API and vLLM return it
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = torch.log_softmax(hf_logits(tiny_llama, ids), dim=-1)
    for j in range(1, len(ids)):
        assert lp["token_logprobs"][j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        assert len(lp["top_logprobs"][j]) <= 2
    assert lp["text_offset"][len(ids)] == len(PROMPT)  # the completion's offsets follow the echoed text
    body = copy.deepcopy(r.json())  # OpenAI's schema types those two entries as non-null; all else validates
    body["choices"][0]["logprobs"]["token_logprobs"][0] = 0.0
    body["choices"][0]["logprobs"]["top_logprobs"][0] = {}
    validate("CreateCompletionResponse", body)


def test_chat_prompt_logprobs_on_the_response(server: ServerProcess, tiny_llama: Path) -> None:
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateChatCompletionResponse", body)
    tokenized = post(server, "/tokenize", {"model": "tiny", "messages": MSG}).json()["tokens"]  # the rendered template
    assert body["usage"]["prompt_tokens"] == len(tokenized)
    assert "prompt_logprobs" not in body["choices"][0]
    assert_matches_oracle(tiny_llama, tokenized, body["prompt_logprobs"], 1)


def _completion_logprob(choice: dict[str, Any]) -> float:
    return sum(choice["logprobs"]["token_logprobs"])


def test_completions_best_of(server: ServerProcess) -> None:
    common = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "seed": 11, "temperature": 1.0}
    r = post(server, "/v1/completions", {**common, "n": 2, "best_of": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateCompletionResponse", body)
    ref = post(server, "/v1/completions", {**common, "n": 5, "logprobs": 0}).json()
    ranked = sorted(ref["choices"], key=lambda c: -_completion_logprob(c))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [c["text"] for c in ranked[:2]]
    assert body["choices"][0]["logprobs"] is None  # not asked
    # usage counts every sample drawn (as OpenAI counts best_of completions)
    assert body["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    assert body["usage"]["completion_tokens"] > sum(len(c["logprobs"]["tokens"]) for c in ranked[:2])


def test_chat_best_of(server: ServerProcess) -> None:
    common = {"model": "tiny", "messages": MSG, "max_tokens": 5, "seed": 2, "temperature": 1.0}
    r = post(server, "/v1/chat/completions", {**common, "best_of": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateChatCompletionResponse", body)
    assert len(body["choices"]) == 1
    ref = post(server, "/v1/chat/completions", {**common, "n": 3, "logprobs": True}).json()
    best = max(ref["choices"], key=lambda c: sum(t["logprob"] for t in c["logprobs"]["content"]))
    assert body["choices"][0]["message"]["content"] == best["message"]["content"]
    assert body["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]


def test_nothing_left_allocated(server: ServerProcess) -> None:
    after = server.wait_idle()
    assert after["portside_kv_cache_used_blocks"] == 0
