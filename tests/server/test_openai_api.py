"""The real server driven by the official `openai` client; every body validated against OpenAI's schemas."""

from __future__ import annotations

import pytest
from conftest import MAX_MODEL_LEN
from helpers import post, sse_events
from openai_schemas import validate, validate_completion_chunk
from server_process import ServerProcess

PROMPT = "The harbour town woke early."
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


def completion(server: ServerProcess, **body: object) -> dict:
    r = post(server, "/v1/completions", {"model": "tiny", **body})
    assert r.status_code == 200, r.text
    validate("CreateCompletionResponse", r.json())
    return r.json()


def chat(server: ServerProcess, **body: object) -> dict:
    r = post(server, "/v1/chat/completions", {"model": "tiny", **body})
    assert r.status_code == 200, r.text
    validate("CreateChatCompletionResponse", r.json())
    return r.json()


def test_models_and_health(server: ServerProcess, client) -> None:
    import httpx

    raw = httpx.get(server.url + "/v1/models", headers=server.headers).json()
    validate("ListModelsResponse", raw)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert raw["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


def test_completion_with_openai_client(server: ServerProcess, client) -> None:
    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    body = raw.http_response.json()
    validate("CreateCompletionResponse", body)
    parsed = raw.parse()
    assert parsed.object == "text_completion" and parsed.model == "tiny"
    (choice,) = parsed.choices
    assert choice.finish_reason in ("stop", "length") and choice.text == body["choices"][0]["text"]
    assert parsed.usage.completion_tokens <= 6 and parsed.usage.prompt_tokens > 0
    assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
    # greedy is deterministic, and a token-id prompt gives what its text gives
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert again.choices[0].text == choice.text
    ids = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, echo=False, logprobs=0)
    assert ids.choices[0].logprobs.tokens[0] == choice.text[: len(ids.choices[0].logprobs.tokens[0])]


def test_completion_stream_equals_non_stream(server: ServerProcess, client) -> None:
    whole = completion(server, prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    events = sse_events(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    for e in events:
        validate_completion_chunk(e)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == whole["usage"] | {"prompt_tokens_details": last["usage"]["prompt_tokens_details"]}
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # and through the official client
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    assert text == whole["choices"][0]["text"]


def test_chat_with_openai_client_stream_and_not(server: ServerProcess, client) -> None:
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=CHAT, max_completion_tokens=8, temperature=0)
    validate("CreateChatCompletionResponse", raw.http_response.json())
    resp = raw.parse()
    msg = resp.choices[0].message
    assert resp.object == "chat.completion" and msg.role == "assistant"
    assert resp.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
    events = sse_events(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0,
                                                        "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    for e in events:
        validate("CreateChatCompletionStreamResponse", e)
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["total_tokens"] > 0


def test_n2_and_seeds(server: ServerProcess, client) -> None:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=1234)
    a = client.completions.with_raw_response.create(**kw)
    validate("CreateCompletionResponse", a.http_response.json())
    a = a.parse()
    assert [c.index for c in a.choices] == [0, 1]
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    c = client.completions.create(**(kw | {"seed": 99}))
    assert [x.text for x in c.choices] != [x.text for x in a.choices]
    assert a.usage.completion_tokens <= 16
    chat_n = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, n=2, seed=7, temperature=1.0)
    assert sorted(ch.index for ch in chat_n.choices) == [0, 1]
    events = sse_events(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 6, "n": 2, "seed": 7,
                                                        "temperature": 1.0, "stream": True})  # fmt: skip
    texts = {0: "", 1: ""}
    for e in events:
        validate("CreateChatCompletionStreamResponse", e)
        for ch in e["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
    assert texts == {ch.index: ch.message.content for ch in chat_n.choices}
    finishes = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
    assert len(finishes) == 2


def test_stop_strings(server: ServerProcess) -> None:
    full = completion(server, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    cut = full[: full.find(stop)]
    got = completion(server, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop, "@@never@@"])
    assert got["choices"][0]["text"] == cut and got["choices"][0]["finish_reason"] == "stop"
    events = sse_events(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                   "ignore_eos": True, "stop": stop, "stream": True})  # fmt: skip
    assert "".join(e["choices"][0]["text"] for e in events) == cut
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs(server: ServerProcess, client) -> None:
    body = completion(server, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    # tokens that end mid-character decode alone to U+FFFD; the text holds such bytes back
    assert "".join(lp["tokens"]).replace("\ufffd", "") == body["choices"][0]["text"].replace("\ufffd", "")
    for logprob, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top token
    resp = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens and all(len(t.top_logprobs) <= 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5) for t in content)
    events = sse_events(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                        "logprobs": True, "top_logprobs": 2, "stream": True})  # fmt: skip
    for e in events:
        validate("CreateChatCompletionStreamResponse", e)
    streamed = [t for e in events for ch in e["choices"] if ch["logprobs"] for t in ch["logprobs"]["content"]]
    assert [t["token"] for t in streamed] == [t.token for t in content]


def test_prompts_as_token_ids_batches_and_echo(server: ServerProcess) -> None:
    text = completion(server, prompt=PROMPT, max_tokens=6, temperature=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(server_model(server)))
    prompt_ids = tok(PROMPT).input_ids
    by_ids = completion(server, prompt=prompt_ids, max_tokens=6, temperature=0)
    assert by_ids["choices"][0]["text"] == text["choices"][0]["text"]
    batch = completion(server, prompt=[PROMPT, "A ship arrived"], max_tokens=4, temperature=0, n=2)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == batch["choices"][1]["text"]  # greedy: both samples agree
    batch_ids = completion(server, prompt=[prompt_ids, prompt_ids[:3]], max_tokens=4, temperature=0)
    assert len(batch_ids["choices"]) == 2
    echo = completion(server, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echo["choices"][0]["text"] == PROMPT + text["choices"][0]["text"]


def server_model(server: ServerProcess) -> str:
    return server.proc.args[server.proc.args.index("serve") + 1]


def test_sampling_extras(server: ServerProcess, client) -> None:
    greedy = completion(server, prompt=PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]
    top1 = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy
    long = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
        seed=3, user="tester", extra_body={"min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 12, "stop_token_ids": [2]},
    )  # fmt: skip
    assert long.usage.completion_tokens == 12 and long.choices[0].finish_reason == "length"
    bias = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, logit_bias={"65": 100}, temperature=0, logprobs=True)
    assert [t.token for t in bias.choices[0].logprobs.content] == [completion_token(server, 65)] * 3


def completion_token(server: ServerProcess, token_id: int) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server_model(server)).decode([token_id])


def test_default_max_tokens_fits_the_context(server: ServerProcess) -> None:
    """Chat without max_tokens may use the whole rest of the context; completions default to 16."""
    long_prompt = "word " * 100
    body = completion(server, prompt=long_prompt, temperature=0, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 16
    msgs = [{"role": "user", "content": "word " * 100}]
    body = chat(server, messages=msgs, temperature=0, ignore_eos=True)
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == MAX_MODEL_LEN
    assert body["choices"][0]["finish_reason"] == "length"
