"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the official
`anthropic` SDK against a real `portside serve`: a tiny random-weight Qwen3-style model with
<think> / <tool_call> tokens, a hermes tools template whose generation prompt opens a think block
when enable_thinking is on (as reasoning models' templates do), `--reasoning-parser qwen3` and
`--tool-call-parser hermes`, behind an API key. The model's free output is noise: whatever
validates does because of the grammar engine (forced tool calls), and reasoning comes back as a
thinking block because the prompt opened one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from server_process import ServerProcess

from portside.server.endpoints.messages import BlockStream, Messages, chat_request, signature
from portside.server.errors import APIError
from portside.server.protocol.anthropic import MessagesBody, anthropic_param, chat_messages
from portside.testing.tiny import QWEN_MARKERS, make_tiny_model

API_KEY = "sk-ant-portside-test"
MAX_MODEL_LEN = 1024

# ChatML with hermes tools; assistant reasoning shown as a think block; the generation prompt opens
# a think block when enable_thinking is true and closes an empty one when it is false (Qwen3's)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message.get('reasoning_content') %}{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson) + '\n</tool_call>' }}"
    "{% endfor %}{% if not (loop.last and continue_final_message) %}{{ '<|im_end|>\n' }}{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined %}{{ '<think>\n' if enable_thinking else '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}  # fmt: skip
TIME = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]}
TOOLS = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME}]  # fmt: skip
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
HI = [{"role": "user", "content": "What is the capital of France?"}]
# this SDK has no sampling arguments (Anthropic's newest models take none); the API takes them
GREEDY = {"temperature": 0.0}
WARM = {"temperature": 0.8}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_tiny_model(tmp_path_factory.mktemp("qwen3_messages"), "qwen3", added_tokens=QWEN_MARKERS, chat_template=TEMPLATE,
                             max_position_embeddings=MAX_MODEL_LEN)
    proc = ServerProcess(model, tmp_path_factory.mktemp("srv") / "server.log", "--max-model-len", str(MAX_MODEL_LEN),
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                         "--max-request-body-bytes", "200000", api_key=API_KEY)  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def count(client: anthropic.Anthropic, **kw: Any) -> int:
    return client.messages.count_tokens(model="tiny", **({"messages": HI} | kw)).input_tokens


def raw(server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01",
                                                             "anthropic-beta": "prompt-caching-2024-07-31"} | (headers or {}),
                      timeout=60)  # fmt: skip


def sse(server: ServerProcess, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed /v1/messages, each name checked against its data's type."""
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", json=body | {"stream": True}, headers={"x-api-key": API_KEY},
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    assert "[DONE]" not in text
    for frame in text.strip().split("\n\n"):
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


def test_plain_message_and_count_tokens(server: ServerProcess, client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="tiny", max_tokens=6, messages=HI, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 6 and m.usage.cache_creation_input_tokens == 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count(client)
    # again: the prompt's full blocks come from the prefix cache, and usage says so
    again = client.messages.create(model="tiny", max_tokens=6, messages=HI, extra_body=GREEDY)
    assert again.content[0].text == m.content[0].text
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == count(client)
    body = raw(server, "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HI, "metadata": {"user_id": "u1"},
                                        "service_tier": "auto", "top_k": 5, "top_p": 0.9}).json()  # fmt: skip
    assert set(body) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    assert set(body["usage"]) >= {"input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}


def test_system_prompt(client: anthropic.Anthropic) -> None:
    base = count(client)
    as_text = count(client, system="You are terse.")
    as_blocks = count(client, system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}])
    assert as_text == as_blocks > base
    m = client.messages.create(model="tiny", max_tokens=4, system="You are terse.", messages=HI)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == as_text


def test_multi_turn_with_the_reply_sent_back(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model="tiny", max_tokens=5, messages=HI, extra_body=GREEDY)
    turns = [*HI, {"role": "assistant", "content": first.content}, {"role": "user", "content": [{"type": "text", "text": "And Spain?"}]}]
    second = client.messages.create(model="tiny", max_tokens=5, messages=turns)
    assert second.usage.output_tokens >= 1 and second.usage.input_tokens + second.usage.cache_read_input_tokens == count(client, messages=turns)
    assert count(client, messages=turns) > count(client) + 3
    # a final assistant message is a prefill: the reply continues it
    prefill = [*HI, {"role": "assistant", "content": "The capital"}]
    assert count(client, messages=prefill) > count(client)
    continued = client.messages.create(model="tiny", max_tokens=3, messages=prefill)
    assert continued.usage.output_tokens >= 1 and all(b.type == "text" for b in continued.content)


def test_streamed_message(server: ServerProcess, client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="tiny", max_tokens=8, messages=HI, extra_body=GREEDY)
    with client.messages.stream(model="tiny", max_tokens=8, messages=HI, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count(client)
    events = sse(server, {"model": "tiny", "max_tokens": 8, "messages": HI, "temperature": 0.0})
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[2] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_forced_tool_call_and_its_result(server: ServerProcess, client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="tiny", max_tokens=120, messages=[{"role": "user", "content": "Weather in Paris?"}],
                               tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, extra_body=WARM)  # fmt: skip
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    turns = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": m.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees"},
                                          {"type": "text", "text": "Thanks"}]}]  # fmt: skip
    reply = client.messages.create(model="tiny", max_tokens=5, messages=turns, tools=TOOLS, tool_choice={"type": "none"})
    assert reply.content and all(b.type == "text" for b in reply.content)
    errored = [*turns[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                                          "content": [{"type": "text", "text": "no such city"}]}]}]  # fmt: skip
    assert count(client, messages=errored, tools=TOOLS) > count(client, messages=turns[:1], tools=TOOLS)
    # streamed: the input arrives as input_json_delta pieces that join into the call's input
    with client.messages.stream(model="tiny", max_tokens=120, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=WARM) as stream:  # fmt: skip
        final = stream.get_final_message()
    (call,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER)
    assert final.stop_reason == "tool_use"
    events = sse(server, {"model": "tiny", "max_tokens": 120, "messages": HI, "tools": TOOLS, "temperature": 0.8,
                          "tool_choice": {"type": "tool", "name": "get_time"}})  # fmt: skip
    starts = [e["content_block"] for n, e in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["name"] == "get_time"
    pieces = [e["delta"]["partial_json"] for n, e in events if n == "content_block_delta"]
    jsonschema.validate(json.loads("".join(pieces)), TIME)
    server.wait_idle()


def test_tool_choice_any(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="tiny", max_tokens=150, messages=HI, tools=TOOLS, extra_body=WARM,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})  # fmt: skip
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(calls) == 1
    jsonschema.validate(calls[0].input, SCHEMAS[calls[0].name])


def test_thinking_blocks(server: ServerProcess, client: anthropic.Anthropic) -> None:
    on = {"type": "enabled", "budget_tokens": 6}
    m = client.messages.create(model="tiny", max_tokens=8, messages=HI, thinking=on, extra_body=GREEDY)
    assert m.content[0].type == "thinking" and m.content[0].thinking and m.content[0].signature
    assert not any(b.type == "text" for b in m.content)  # random weights do not close the think block
    with client.messages.stream(model="tiny", max_tokens=8, messages=HI, thinking=on, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == m.content[0].thinking and final.content[0].signature == m.content[0].signature
    deltas = [e["delta"]["type"] for n, e in sse(server, {"model": "tiny", "max_tokens": 8, "messages": HI, "thinking": on})
              if n == "content_block_delta"]  # fmt: skip
    assert deltas[0] == "thinking_delta" and deltas[-1] == "signature_delta"
    off = client.messages.create(model="tiny", max_tokens=8, messages=HI, thinking={"type": "disabled"}, extra_body=GREEDY)
    assert all(b.type == "text" for b in off.content)
    # the thinking sent back reaches the template (as reasoning_content)
    turns = [*HI, {"role": "assistant", "content": m.content + [{"type": "text", "text": "Paris."}]}, {"role": "user", "content": "Sure?"}]
    plain = [*HI, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Sure?"}]
    assert count(client, messages=turns) > count(client, messages=plain)


def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model="tiny", max_tokens=12, messages=HI, extra_body=GREEDY)
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 12
    text = free.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    m = client.messages.create(model="tiny", max_tokens=12, messages=HI, extra_body=GREEDY, stop_sequences=[stop, "zzzzqq"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text.startswith(m.content[0].text) and stop not in m.content[0].text


def test_errors_in_anthropic_shape(server: ServerProcess, client: anthropic.Anthropic) -> None:
    def bad(match: str, **kw: Any) -> None:
        with pytest.raises(anthropic.BadRequestError, match=match) as e:
            client.messages.create(**({"model": "tiny", "max_tokens": 4, "messages": HI} | kw))
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"

    bad(r"frequency_penalty", extra_body={"frequency_penalty": 1.0})
    bad(r"messages\[0\]\.content\[1\]\.type.*'document'",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "document", "source": {}}]}])
    bad(r"messages\[1\]\.content\[0\]\.name.*'nope'", tools=TOOLS, tool_choice={"type": "none"},
        messages=[*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "nope", "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}])
    bad(r"messages\[0\]\.content\[0\]\.tool_use_id", messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}])
    bad(r"max_tokens", max_tokens=10**6)
    bad(r"messages\[0\]\.content\[1\]\.source\.type", messages=[{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image", "source": {"type": "file", "file_id": "f"}}]}])
    bad(r"messages\[0\]\.content.*text-only", system="s", messages=[{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}])
    bad(r"tool_choice\.name", tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})
    bad(r"thinking\.budget_tokens", thinking={"type": "enabled", "budget_tokens": 10})
    bad(r"tools\[0\]\.type", tools=[{"type": "web_search_20250305", "name": "web_search"}])
    bad(r"temperature", extra_body={"temperature": 1.5})
    missing = raw(server, "/v1/messages", {"model": "tiny", "messages": HI})  # the SDK will not send it
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content"):
        client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": 5}])  # type: ignore[list-item]
    with pytest.raises(anthropic.NotFoundError, match="nope") as nf:
        client.messages.create(model="nope", max_tokens=4, messages=HI)
    assert nf.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as auth:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(model="tiny", max_tokens=4, messages=HI)
    assert auth.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "Incorrect API key provided"}}
    r = raw(server, "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 300_000}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.BadRequestError) as streamed:  # refused before the stream starts: a plain error body
        client.messages.create(model="tiny", max_tokens=4, messages=HI, stream=True, stop_sequences=[""])
    assert "stop_sequences" in streamed.value.body["error"]["message"]
    server.wait_idle()


def test_api_key_headers_and_other_routes_keep_openai_errors(server: ServerProcess) -> None:
    ok = raw(server, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": HI})  # x-api-key on any route
    assert ok.status_code == 200, ok.text
    bearer = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": HI},
                        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)  # fmt: skip
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    missing = httpx.post(server.url + "/v1/chat/completions", json={}, timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape
    bad = raw(server, "/v1/chat/completions", {"model": "tiny", "messages": HI, "bogus": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bogus"
    unknown = raw(server, "/v1/messages/nope", {})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


def test_body_mapping_onto_the_chat_turn() -> None:
    """What the template gets: system first, tool results as tool messages in place (an error
    marked), thinking as reasoning_content, images as data URLs; redacted thinking is unreadable."""
    body = MessagesBody.model_validate({
        "model": "tiny", "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}], "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": "s"},
                                              {"type": "redacted_thinking", "data": "opaque"},
                                              {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo", "unit": "c"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "is_error": True, "content": "down"},
                                         {"type": "text", "text": "Look:"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]},
        ],
    })  # fmt: skip
    messages, origins = chat_messages(body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[0]["content"] == "Be brief."
    assert messages[2] == {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
        {"id": "toolu_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]}
    assert messages[3] == {"role": "tool", "tool_call_id": "toolu_a", "content": "Error: down"}
    assert messages[4]["content"] == [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]
    # an error about the chat request's messages names the Anthropic body's
    assert anthropic_param("messages[4].content[1]: the image could not be loaded", origins) == \
        "messages[2].content[2]: the image could not be loaded"
    assert anthropic_param("messages[0]: too long", origins) == "system: too long"


def test_refusals_that_depend_on_the_server() -> None:
    ctx: Any = SimpleNamespace(tool_parser=None, harmony=False, reasoning_parser=None)
    body = {"model": "tiny", "max_tokens": 4, "messages": HI}
    with pytest.raises(APIError, match="--tool-call-parser") as e:
        chat_request(ctx, MessagesBody.model_validate(body | {"tools": TOOLS}))
    assert e.value.param == "tool_choice"
    with pytest.raises(APIError, match="--reasoning-parser") as e:
        chat_request(ctx, MessagesBody.model_validate(body | {"thinking": {"type": "enabled", "budget_tokens": 2}}))
    assert e.value.param == "thinking"
    chat, _ = chat_request(ctx, MessagesBody.model_validate(body | {"tools": TOOLS, "tool_choice": {"type": "any"}}))
    assert chat.tool_choice == "required" and chat.tools is not None and chat.tools[0].function.parameters == WEATHER


def test_block_events_follow_the_kind_of_output() -> None:
    """Thinking, then text, then two calls (the second's arguments in pieces): each its own block,
    the thinking one closed with its signature."""
    blocks = BlockStream()
    deltas = [{"reasoning_content": "hm"}, {"reasoning_content": "m"}, {"content": "ok"},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "a", "arguments": "{}"}}]},
              {"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "b", "arguments": ""}}]},
              {"tool_calls": [{"index": 1, "function": {"arguments": '{"x"'}}]}, {"tool_calls": [{"index": 1, "function": {"arguments": ": 1}"}}]}]  # fmt: skip
    events = [e for d in deltas for e in blocks.feed(d)] + blocks.close()
    shape = [(e["type"], e["index"], (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events]
    assert shape == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_delta", 3, "input_json_delta"), ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
    ]  # fmt: skip
    assert events[3]["delta"]["signature"] == signature("hmm") and blocks.called
    assert events[8]["content_block"]["id"].startswith("toolu_") and events[11]["content_block"]["name"] == "b"


def test_error_event_after_the_stream_started() -> None:
    api = Messages.__new__(Messages)  # framing only: no request behind it
    frame = api.error_event(APIError(503, "queue full"))
    name, data = frame.strip().split("\n")
    assert name == "event: error"
    assert json.loads(data[len("data: "):]) == {"type": "error", "error": {"type": "overloaded_error", "message": "queue full"}}
