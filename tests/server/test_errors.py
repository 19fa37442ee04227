"""Bad input: each gets its status and an OpenAI error body naming the parameter; nothing leaks."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import API_KEY, MAX_MODEL_LEN
from helpers import post
from openai_schemas import validate
from server_process import ServerProcess

MSG = [{"role": "user", "content": "hi"}]
LONG = "word " * (MAX_MODEL_LEN + 10)

# (path, body, status, param); body is a dict (sent as JSON) or bytes (sent raw)
CASES = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_k": -7}, 400, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop_token_ids": [10**7]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "best_of": 1, "n": 2}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "best_of": 21}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "best_of": 3, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": "1"}, 400, "seed"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "nope", "messages": MSG}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "n": -1}, 400, "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "top_p": 7}, 400, "top_p"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "logprobs": 3}, 400, "logprobs"),
    # tools default to tool_choice "auto", which needs --enable-auto-tool-choice (this server has none)
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "guided_json": {"type": "nonsense"}}, 400, "guided_json"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "made_up_field": 1}, 400, "made_up_field"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "use_beam_search": True, "n": 33}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "use_beam_search": True, "n": 11}, 400, "n"),  # 22 logprobs > 20
    ("/v1/completions", {"model": "tiny", "prompt": "x", "use_beam_search": True, "stream": True}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "use_beam_search": True, "temperature": 0.7}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "use_beam_search": True, "logprobs": 1}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "use_beam_search": True, "stop": ["a"]}, 400, "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "length_penalty": 0.5}, 400, "length_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "best_of": 0}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_regex": "(("}, 400, "guided_regex"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "structured_outputs": {"choice": ["a"]}, "guided_regex": "b"}, 400, "guided_regex"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, 400, "guided_json"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_regex": "[^\\s\\S]"}, 400, "guided_regex"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_grammar": "root ::= undefined_rule"}, 400, "guided_grammar"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_json": {"type": "string"}, "min_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_decoding_backend": "outlines", "guided_regex": "a"}, 400, "guided_decoding_backend"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "stream": True, "n": 0}, 400, "n"),
    # content is required but for an assistant that made tool calls (or refused), as OpenAI's
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [*MSG, {"role": "tool", "content": None, "tool_call_id": "c"}]}, 400, "messages[1].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [*MSG, {"role": "assistant", "content": None}]}, 400, "messages[1].content"),
    # a request's own template is code from the client: refused without --trust-request-chat-template
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "chat_template": "{{ messages[0].content }}"}, 400, "chat_template"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400, "chat_template_kwargs"),
    # the waiting limit (256 here) counts sequences: 15 prompts x n=128 could never wait at once
    ("/v1/completions", {"model": "tiny", "prompt": ["hi"] * 15, "n": 128, "max_tokens": 1}, 400, "n"),
]


@pytest.fixture(scope="module")
def before(server: ServerProcess) -> dict[str, float]:
    return server.wait_idle()


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_input(server: ServerProcess, before: dict[str, float], path: str, body: object, status: int, param: str | None) -> None:
    if isinstance(body, bytes):
        r = post(server, path, content=body, headers={"content-type": "application/json"})
    else:
        r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()
    validate("ErrorResponse", err)
    assert err["error"]["param"] == param, err
    assert err["error"]["message"] and "Traceback" not in r.text
    if param:
        assert param.split(".")[0].split("[")[0] in err["error"]["message"] or status == 404


def test_auth_size_and_routes(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}, {"Authorization": API_KEY}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/nowhere")):
            r = httpx.request(method, server.url + path, json=body, headers=headers)
            assert r.status_code == 401, (headers, path, r.text)
            validate("ErrorResponse", r.json())
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200
    # body size: by Content-Length, and by counting a chunked body
    big = json.dumps({"model": "tiny", "prompt": "x" * 70_000}).encode()
    r = post(server, "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    validate("ErrorResponse", r.json())
    r = httpx.post(server.url + "/v1/completions", content=iter([big[:40_000], big[40_000:]]), headers=server.headers)
    assert r.status_code == 413, r.text
    validate("ErrorResponse", r.json())
    # unknown route / method: still an OpenAI error body
    r = httpx.get(server.url + "/v1/nowhere", headers=server.headers)
    assert r.status_code == 404
    validate("ErrorResponse", r.json())
    r = httpx.get(server.url + "/v1/completions", headers=server.headers)
    assert r.status_code == 405
    validate("ErrorResponse", r.json())


def test_nothing_left_allocated(server: ServerProcess, before: dict[str, float]) -> None:
    """After all the refusals above: nothing running or waiting, no KV block in use, all counted."""
    after = server.wait_idle()
    assert after["portside_kv_cache_used_blocks"] == 0 and after["portside_kv_cache_usage_ratio"] == 0
    rejected = after['portside_requests_total{outcome="rejected"}'] - before['portside_requests_total{outcome="rejected"}']
    assert rejected >= len(CASES)
    # and the server still answers
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
