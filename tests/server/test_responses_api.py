"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) through the
official `openai` client against a real `portside serve`: a tiny random-weight Qwen3-style model
with <think> / <tool_call> tokens and a hermes tools template whose generation prompt opens a
think block when `reasoning_effort` is "high" (`--enable-auto-tool-choice --tool-call-parser
hermes --reasoning-parser qwen3`). Whatever parses does because of a grammar (a forced call,
`text.format`); prompts are checked token for token against what /tokenize renders for the chat
messages the input should become. Every body and stream event is validated against OpenAI's
published schemas (`openai_schemas`). The store's bounds are unit-tested at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from helpers import post
from openai_schemas import validate, validate_event
from openai_schemas import validate as validate_openai
from server_process import ServerProcess

from portside.server.protocol.bodies import ChatCompletionRequest
from portside.server.protocol.responses import ResponsesRequest, chat_messages
from portside.server.response_store import ResponseStore, StoredResponse
from portside.server.responses_output import EventStream, usage
from portside.testing.tiny import HERMES_TOOLS_TEMPLATE, QWEN_MARKERS, make_tiny_model

slow = pytest.mark.slow  # the cases on the module's own server (tool and reasoning parsers); CI runs them

# the hermes template, thinking when asked: reasoning.effort "high" -> the prompt ends in "<think>\n"
THINKING_TEMPLATE = HERMES_TOOLS_TEMPLATE.replace(
    "{% if enable_thinking is defined", "{% if reasoning_effort is defined and reasoning_effort == 'high' %}{{ '<think>\\n' }}{% endif %}"
    "{% if enable_thinking is defined")  # fmt: skip
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TIME = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": TIME, "strict": True},
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"], "additionalProperties": False}  # fmt: skip
CITY_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_tiny_model(tmp_path_factory.mktemp("qwen3_responses"), "qwen3", added_tokens=QWEN_MARKERS,
                            chat_template=THINKING_TEMPLATE)  # fmt: skip
    proc = ServerProcess(model, tmp_path_factory.mktemp("srv") / "server.log", "--max-model-len", str(MAX_MODEL_LEN),
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def create(srv: ServerProcess, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    """POST /v1/responses; the body validated against OpenAI's schema (Response, or ErrorResponse)."""
    r = post(srv, "/v1/responses", {"model": "tiny", "temperature": 0} | body)
    assert r.status_code == status, r.text
    if status == 200:
        validate("Response", r.json())
    else:
        validate_openai("ErrorResponse", r.json())
    return r.json()  # type: ignore[no-any-return]


def stream(srv: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every event of a streamed response: its `event:` line names its type, each validates
    against its own schema, sequence numbers count from 0, and no [DONE] follows."""
    events, names = [], []
    with httpx.stream("POST", srv.url + "/v1/responses", json={"model": "tiny", "temperature": 0, "stream": True} | body,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[len("event: "):])
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        validate_event(e)
    return events


def prompt_tokens(srv: ServerProcess, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """The prompt's length as chat completions render `messages` (POST /tokenize)."""
    body: dict[str, Any] = {"model": "tiny", "messages": messages} | ({"tools": tools} if tools else {})
    r = post(srv, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()["count"]  # type: ignore[no-any-return]


@slow
def test_string_input(srv: ServerProcess, client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Hello there", max_output_tokens=6, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    (msg,) = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert r.output_text == msg.content[0].text and msg.content[0].type == "output_text"
    assert r.usage is not None and r.usage.input_tokens == prompt_tokens(srv, [{"role": "user", "content": "Hello there"}])
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens <= r.usage.input_tokens + 6
    if r.status == "incomplete":
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 6
    body = create(srv, {"input": "Hello there", "max_output_tokens": 6, "metadata": {"k": "v"}, "user": "u1"})
    assert body["output"][0]["content"][0]["text"] == r.output_text  # greedy: the same text
    assert body["metadata"] == {"k": "v"} and body["user"] == "u1" and body["store"] is True and body["tools"] == []


@slow
def test_items_with_instructions(srv: ServerProcess, client: openai.OpenAI) -> None:
    """Instructions are a system message first; message items of every role, text parts joined."""
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name "}, {"type": "input_text", "text": "a city."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris.", "annotations": []}],
         "id": "msg_1", "status": "completed"},
        {"role": "user", "content": "Another?"},
    ]  # fmt: skip
    r = client.responses.create(model="tiny", input=items, instructions="Be brief.", max_output_tokens=4)  # type: ignore[arg-type]
    expected = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "Another?"}]  # fmt: skip
    assert r.usage is not None and r.usage.input_tokens == prompt_tokens(srv, expected)
    assert r.instructions == "Be brief." and r.output[0].type == "message"


@slow
@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_call_then_its_output_through_previous_response_id(srv: ServerProcess, client: openai.OpenAI, choice: Any) -> None:
    r = client.responses.create(model="tiny", input="Weather in Paris?", instructions="Use the tools.", tools=TOOLS,  # type: ignore[arg-type]
                                tool_choice=choice, parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    assert r.status == "completed", r
    (call,) = r.output
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if choice != "required":
        assert call.name == "get_weather"
    raw = create(srv, {"input": "Weather in Paris?", "instructions": "Use the tools.", "tools": TOOLS, "tool_choice": choice,
                       "parallel_tool_calls": False, "max_output_tokens": 60})
    assert raw["tool_choice"] == choice and raw["tools"] == [{"description": None} | t for t in TOOLS]
    assert raw["output"][0]["arguments"] == call.arguments
    # the result goes back: the stored conversation (not its instructions) comes first
    r2 = client.responses.create(model="tiny", previous_response_id=r.id, tools=TOOLS, max_output_tokens=5,  # type: ignore[arg-type]
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
    assert r2.previous_response_id == r.id and r2.instructions is None and r2.status in ("completed", "incomplete")
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                     "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}]  # fmt: skip
    assert r2.usage is not None and r2.usage.input_tokens == prompt_tokens(srv, history, CHAT_TOOLS)
    # the same, statelessly: the call item sent back as input (as the Agents SDK does)
    r3 = create(srv, {"input": [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                                {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}],
                      "tools": TOOLS, "max_output_tokens": 5})  # fmt: skip
    assert r3["usage"]["input_tokens"] == r2.usage.input_tokens


@slow
def test_text_format_json_schema(srv: ServerProcess, client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="A city, as JSON.", text=CITY_FORMAT, max_output_tokens=120, temperature=0)  # type: ignore[arg-type]
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    body = create(srv, {"input": "A city, as JSON.", "text": {"format": {"type": "json_object"}}, "max_output_tokens": 120})
    assert body["text"] == {"format": {"type": "json_object"}}
    if body["status"] == "completed":
        assert isinstance(json.loads(body["output"][0]["content"][0]["text"]), dict)


@slow
def test_streaming_text(srv: ServerProcess, client: openai.OpenAI) -> None:
    events = stream(srv, {"input": "A city, as JSON.", "text": CITY_FORMAT, "max_output_tokens": 120})
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                                      "response.completed"]  # fmt: skip
    final = events[-1]["response"]
    text = "".join(d["delta"] for d in deltas)
    assert events[-3]["part"]["text"] == text == final["output"][0]["content"][0]["text"]
    jsonschema.validate(json.loads(text), CITY)
    assert final["status"] == "completed" and final["id"] == events[0]["response"]["id"] and final["usage"]["output_tokens"] > 0
    # the SDK's stream helper rebuilds the same response, which is stored
    with client.responses.stream(model="tiny", input="A city, as JSON.", text=CITY_FORMAT, max_output_tokens=120,  # type: ignore[arg-type]
                                 temperature=0) as s:
        streamed = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        done = s.get_final_response()
    assert done.output_text == streamed == text and done.status == "completed"
    assert client.responses.retrieve(done.id).output_text == text


@slow
def test_streaming_a_call(srv: ServerProcess) -> None:
    events = stream(srv, {"input": "Time?", "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"},
                          "max_output_tokens": 40})  # fmt: skip
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert len(added) == 1 and added[0]["item"]["type"] == "function_call" and added[0]["item"]["name"] == "get_time"
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == args and done["name"] == "get_time" and done["item_id"] == added[0]["item"]["id"]
    jsonschema.validate(json.loads(args), TIME)
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["output"][0]["arguments"] == args


@slow
def test_reasoning_items(srv: ServerProcess, client: openai.OpenAI) -> None:
    """reasoning.effort reaches the template (here: "high" opens a think block); the reasoning
    comes back as a reasoning item, streamed as reasoning_text events, counted in usage."""
    r = client.responses.create(model="tiny", input="Think.", reasoning={"effort": "high", "summary": "auto"}, max_output_tokens=6,
                                temperature=0)  # fmt: skip
    first = r.output[0]
    assert first.type == "reasoning" and first.id.startswith("rs_") and first.summary == []
    assert first.content and first.content[0].type == "reasoning_text" and first.content[0].text
    assert r.usage is not None and 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    assert r.reasoning is not None and r.reasoning.effort == "high"
    events = stream(srv, {"input": "Think.", "reasoning": {"effort": "high"}, "max_output_tokens": 6})
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == first.content[0].text
    assert [e["text"] for e in events if e["type"] == "response.reasoning_text.done"] == [text]
    # without the effort the prompt does not think: no reasoning item
    assert create(srv, {"input": "Think.", "max_output_tokens": 3})["output"][0]["type"] == "message"
    # a reasoning item sent back is the assistant's reasoning (the template leaves it out of the prompt)
    back = create(srv, {"input": [{"role": "user", "content": "Think."}, first.model_dump(exclude_none=True),
                                  {"role": "user", "content": "Again."}], "max_output_tokens": 2})  # fmt: skip
    expected = [{"role": "user", "content": "Think."}, {"role": "assistant", "content": ""}, {"role": "user", "content": "Again."}]
    assert back["usage"]["input_tokens"] == prompt_tokens(srv, expected)


@slow
def test_retrieve_delete_and_store_false(srv: ServerProcess, client: openai.OpenAI) -> None:
    body = create(srv, {"input": "Hi", "max_output_tokens": 3})
    got = httpx.get(f"{srv.url}/v1/responses/{body['id']}", timeout=10)
    assert got.status_code == 200 and got.json() == body
    assert client.responses.retrieve(body["id"]).id == body["id"]
    again = httpx.get(f"{srv.url}/v1/responses/{body['id']}?stream=true", timeout=10)  # never re-streamed
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream"
    r = httpx.delete(f"{srv.url}/v1/responses/{body['id']}", timeout=10)
    assert r.status_code == 200 and r.json() == {"id": body["id"], "object": "response.deleted", "deleted": True}
    for method in ("GET", "DELETE"):
        gone = httpx.request(method, f"{srv.url}/v1/responses/{body['id']}", timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id", gone.text
        validate_openai("ErrorResponse", gone.json())
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(body["id"])
    # store: false is not kept, so it can be neither read nor continued
    kept = client.responses.create(model="tiny", input="Hi", max_output_tokens=3, store=False)
    assert kept.store is False
    assert httpx.get(f"{srv.url}/v1/responses/{kept.id}", timeout=10).status_code == 404
    err = create(srv, {"input": "More", "previous_response_id": kept.id}, status=400)["error"]
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
    # a stream is stored too, once complete
    events = stream(srv, {"input": "Hi", "max_output_tokens": 3})
    assert httpx.get(f"{srv.url}/v1/responses/{events[-1]['response']['id']}", timeout=10).json() == events[-1]["response"]


ERRORS = [
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "web_search_call", "id": "ws_1"}]}, "input[1].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                             {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "input[0].content"),  # a text-only model: the message's images are refused
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": "x", "max_output_tokens": MAX_MODEL_LEN * 4}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [TOOLS[0] | {"defer_loading": True}]}, "tools[0].defer_loading"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": CITY}}}, "text.format.name"),
    ({"input": "x", "reasoning": {"effort": "minimal"}}, "reasoning.effort"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "top_logprobs": 2, "tools": TOOLS}, "top_logprobs"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": []}, "input"),
    ({}, "input"),
]


@slow
@pytest.mark.parametrize(("body", "param"), ERRORS, ids=[p for _, p in ERRORS])
def test_errors_name_the_field(srv: ServerProcess, body: dict[str, Any], param: str) -> None:
    err = create(srv, {"max_output_tokens": 4} | body, status=400)["error"]
    assert err["param"] == param and param in err["message"], err


@slow
def test_errors_through_the_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert "resp_nope" in str(e.value) and e.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        client.responses.create(model="tiny", input="x", max_output_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")


@slow
def test_logprobs(srv: ServerProcess) -> None:
    body = create(srv, {"input": "Hi", "max_output_tokens": 4, "top_logprobs": 2, "include": ["message.output_text.logprobs"]})
    part = body["output"][0]["content"][0]
    assert len(part["logprobs"]) == body["usage"]["output_tokens"] and all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    events = stream(srv, {"input": "Hi", "max_output_tokens": 4, "top_logprobs": 2})
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in part["logprobs"]]


# the store's bounds, without a server


def entry(nbytes: int = 10) -> StoredResponse:
    return StoredResponse({"id": "x"}, [], 0, nbytes)


def test_store_evicts_the_least_recently_used() -> None:
    store = ResponseStore(max_entries=2, max_bytes=100, ttl_s=60)
    assert store.put("a", entry()) and store.put("b", entry())
    assert store.get("a") is not None  # a is now the most recently used
    assert store.put("c", entry())
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None and len(store) == 2
    assert store.put("d", entry(85))  # over the byte bound: the least recently used goes
    assert len(store) == 2 and store.get("a") is None and store.nbytes == 95
    assert store.put("e", entry(95))  # both others go
    assert len(store) == 1 and store.nbytes == 95
    assert not store.put("huge", entry(101)) and store.get("huge") is None  # larger than the bound alone: not kept
    assert store.delete("e") and not store.delete("e") and store.nbytes == 0


def test_store_expires_entries_after_their_ttl() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=10, max_bytes=1000, ttl_s=10, clock=lambda: now[0])
    store.put("a", entry())
    store.put("b", entry())
    now[0] = 8.0
    assert store.get("a") is not None  # used: a lives until 18
    now[0] = 12.0
    assert store.get("b") is None and store.get("a") is not None
    now[0] = 30.0
    store.put("c", entry())  # a store drops what expired
    assert len(store) == 1 and store.nbytes == 10 and not store.delete("a")


def test_store_flags(tmp_path: Path) -> None:
    from portside.cli import build_parser, parse_args
    from portside.server.main import server_config

    def config(*flags: str) -> Any:
        return server_config(parse_args(build_parser(), ["serve", str(tmp_path), *flags]))

    store = config("--responses-store-max-entries", "5", "--responses-store-ttl", "30", "--responses-store-max-bytes", "1000").response_store
    assert (store.max_entries, store.ttl_s, store.max_bytes) == (5, 30.0, 1000)
    for flag, value in (("--responses-store-max-entries", "-1"), ("--responses-store-ttl", "0"), ("--responses-store-max-bytes", "-5")):
        with pytest.raises(ValueError, match=flag):
            config(flag, value)


# the input's conversion and the event stream, without a server


def test_items_become_chat_messages() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "see "}, {"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}]},
        {"role": "assistant", "content": "Done."},
    ]})  # fmt: skip
    messages, where = chat_messages(req.items, [f"input[{i}]" for i in range(len(req.items))], "Be brief.")
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "see "},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "auto"}}]},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c2", "name": "g", "content": "2"},
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "1"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "short"},
    ]  # fmt: skip
    assert where == ["instructions", "input[0]", "input[1]", "input[5]", "input[6]", "input[7]"]
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": messages}).messages[1].image_urls == ["data:image/png;base64,AA"]
    with pytest.raises(ValueError, match=r"^input\[0\]\.call_id: no function_call"):
        chat_messages([{"type": "function_call_output", "call_id": "x", "output": "1"}], ["input[0]"], None)


def test_event_stream_interleaves_items_and_fails_in_shape() -> None:
    """Reasoning, text, a call streamed in pieces, text again: each item opened and closed in
    turn, every event valid; a failure after that is response.failed with what came out so far."""

    def snapshot(status: str, output: list[dict[str, Any]], final_usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"id": "resp_1", "object": "response", "created_at": 1, "status": status, "error": None, "incomplete_details": None,
                "instructions": None, "model": "m", "tools": [], "output": output, "parallel_tool_calls": True, "metadata": {},
                "tool_choice": "auto", "temperature": 1.0, "top_p": 1.0}  # fmt: skip
        return body | ({"usage": final_usage} if final_usage else {})

    es = EventStream(snapshot)
    events = es.start()
    for delta in ({"reasoning_content": "hm"}, {"reasoning_content": "m"}, {"content": "I'll "}, {"content": "call."},
                  {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, {"content": "Also."}):  # fmt: skip
        events += es.feed(delta, [])
    closing, body = es.finish(False, usage(10, 8, 0, 2))
    events += closing
    for e in events:
        validate_event(e)
    validate("Response", body)
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call", "message"]
    assert body["output"][0]["content"][0]["text"] == "hmm" and body["output"][2]["arguments"] == '{"a": 1}'
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    es = EventStream(snapshot)
    events = es.start() + es.feed({"content": "par"}, [])
    failed = es.failed("server_error", "the engine stopped")
    validate_event(failed)
    assert failed["response"]["status"] == "failed" and failed["response"]["output"][0]["content"][0]["text"] == "par"
    assert failed["sequence_number"] == len(events)
