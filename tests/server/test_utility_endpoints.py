"""vLLM's utility endpoints on the real server: /tokenize and /detokenize against the Hugging Face
tokenizer, /version, /v1/models/{id}; and /v1/embeddings on a `--task embed` server against
transformers' pooled final hidden states, with the 400s for bad input and for a task mismatch."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import API_KEY, MAX_MODEL_LEN
from helpers import post
from jsonschema import ValidationError
from openai_schemas import validate
from server_process import ServerProcess

from portside.chat_template import render_chat_ids

TEXT = "The harbour town woke early. Fishing boats slipped out past the lighthouse."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_tok(tiny_llama: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def hf_chat_ids(tok, messages: list[dict[str, str]], **kwargs: bool) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' own chat-template tokenization (newer versions return a BatchEncoding)."""
    out = tok.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def get(server: ServerProcess, path: str) -> httpx.Response:
    return httpx.get(server.url + path, headers=server.headers, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None = None, *, says: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    validate("ErrorResponse", body)
    assert says in body["error"]["message"], body
    if param is not None:
        assert body["error"]["param"] == param, body


# ---- tokenize / detokenize / version / models ---------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_prompt_round_trip(server: ServerProcess, hf_tok, add_special_tokens: bool) -> None:
    r = post(server, "/tokenize", {"model": "tiny", "prompt": TEXT, "add_special_tokens": add_special_tokens,
                                   "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = hf_tok(TEXT, add_special_tokens=add_special_tokens).input_ids
    assert body == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want,
                    "token_strs": hf_tok.convert_ids_to_tokens(want)}
    back = post(server, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": hf_tok.decode(want)}
    assert hf_tok.decode(want, skip_special_tokens=True) == TEXT


def test_tokenize_messages_as_chat_renders_them(server: ServerProcess, hf_tok) -> None:
    r = post(server, "/tokenize", {"messages": MESSAGES})  # model is optional, as vLLM's
    assert r.status_code == 200, r.text
    want = render_chat_ids(hf_tok, MESSAGES)
    assert want == hf_chat_ids(hf_tok, MESSAGES, add_generation_prompt=True)
    assert r.json() == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want, "token_strs": None}
    # what chat completions count as the prompt
    chat = post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == len(want)
    r = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert r.json()["tokens"] == render_chat_ids(hf_tok, MESSAGES, add_generation_prompt=False)
    last = [*MESSAGES, {"role": "assistant", "content": "Par"}]
    r = post(server, "/tokenize", {"messages": last, "add_generation_prompt": False, "continue_final_message": True})
    assert r.json()["tokens"] == hf_chat_ids(hf_tok, last, continue_final_message=True)


def test_tokenize_bad_input(server: ServerProcess) -> None:
    assert_error(post(server, "/tokenize", {"model": "tiny"}), 400, "prompt", says="exactly one of")
    assert_error(post(server, "/tokenize", {"prompt": "x", "messages": MESSAGES}), 400, "prompt")
    assert_error(post(server, "/tokenize", {"prompt": 5}), 400, "prompt")
    assert_error(post(server, "/tokenize", {"prompt": "x", "add_generation_prompt": False}), 400, "add_generation_prompt")
    assert_error(post(server, "/tokenize", {"prompt": "x", "model": "nope"}), 404, "model")
    assert_error(post(server, "/tokenize", {"prompt": "x", "frobnicate": 1}), 400, "frobnicate")
    assert_error(post(server, "/tokenize", {"messages": MESSAGES, "continue_final_message": True}), 400, "continue_final_message")
    assert_error(post(server, "/detokenize", {"tokens": [1, 10**6]}), 400, "tokens", says="out of range")
    assert_error(post(server, "/detokenize", {"tokens": "abc"}), 400, "tokens")
    assert_error(post(server, "/detokenize", {}), 400, "tokens")


def test_version(server: ServerProcess) -> None:
    import portside

    r = get(server, "/version")
    assert r.status_code == 200 and r.json() == {"version": portside.__version__}
    assert httpx.get(server.url + "/version", timeout=10).status_code == 401  # the API key guards it too


def test_model_by_id(server: ServerProcess) -> None:
    listed = get(server, "/v1/models").json()["data"]
    r = get(server, "/v1/models/tiny")
    assert r.status_code == 200, r.text
    validate("Model", r.json())
    assert r.json() == listed[0] and r.json()["id"] == "tiny"
    assert_error(get(server, "/v1/models/gpt-4"), 404, "model", says="gpt-4")


def test_embeddings_refused_without_task_embed(server: ServerProcess) -> None:
    r = post(server, "/v1/embeddings", {"model": "tiny", "input": "hello"})
    assert_error(r, 400, says="--runner pooling")


# ---- embeddings ------------------------------------------------------------------------------------

EMBED_LEN = 64


@pytest.fixture(scope="module")
def embed_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Mean pooling (every token's state counts) with a 7-token budget: prompts span blocks and steps."""
    proc = ServerProcess(
        tiny_llama, tmp_path_factory.mktemp("embed") / "server.log", "--task", "embed", "--pooling-type", "mean",
        "--max-model-len", str(EMBED_LEN), "--block-size", "4", "--max-num-batched-tokens", "7", "--num-kv-blocks", "64",
        api_key=API_KEY,
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()


@torch.no_grad()
def hf_mean_embedding(path: Path, ids: list[int]) -> np.ndarray:
    from portside.testing.tiny import hf_model

    hidden = hf_model(path)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0).numpy()


@pytest.mark.slow
def test_embeddings_match_transformers(embed_server: ServerProcess, tiny_llama: Path, hf_tok) -> None:
    texts = ["the", "The harbour town woke early.", TEXT + " The bakers lit their ovens."]
    r = post(embed_server, "/v1/embeddings", {"model": "tiny", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    validate("CreateEmbeddingResponse", body)
    ids = [hf_tok(t).input_ids for t in texts]
    assert body["object"] == "list" and body["model"] == "tiny"
    n = sum(map(len, ids))  # vLLM's UsageInfo, its fields in its order
    assert list(body["usage"].items()) == [("prompt_tokens", n), ("total_tokens", n), ("completion_tokens", 0),
                                           ("prompt_tokens_details", None)]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for d, p in zip(body["data"], ids):
        np.testing.assert_allclose(d["embedding"], hf_mean_embedding(tiny_llama, p), atol=2e-5, rtol=1e-4)
    # token ids, one list and a batch of them; base64 decodes to the same float32 vectors
    one = post(embed_server, "/v1/embeddings", {"input": ids[1], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
    same = {"atol": 1e-6, "rtol": 1e-5}  # other batches: other chunk boundaries, so float rounding
    np.testing.assert_allclose(vec, np.asarray(body["data"][1]["embedding"], dtype=np.float32), **same)
    batch = post(embed_server, "/v1/embeddings", {"input": [ids[2], ids[0]]}).json()
    assert [d["index"] for d in batch["data"]] == [0, 1]
    np.testing.assert_allclose([d["embedding"] for d in batch["data"]], [body["data"][2]["embedding"], body["data"][0]["embedding"]], **same)
    embed_server.wait_idle()  # every KV block back


@pytest.mark.slow
def test_embeddings_openai_client_and_truncation(embed_server: ServerProcess, tiny_llama: Path, hf_tok) -> None:
    import openai

    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    res = client.embeddings.create(model="tiny", input=[TEXT])  # the client asks for base64 by default
    np.testing.assert_allclose(res.data[0].embedding, hf_mean_embedding(tiny_llama, hf_tok(TEXT).input_ids), atol=2e-5, rtol=1e-4)
    long_ids = (hf_tok(TEXT).input_ids * 6)[:100]
    r = post(embed_server, "/v1/embeddings", {"input": long_ids, "truncate_prompt_tokens": 10}).json()
    np.testing.assert_allclose(r["data"][0]["embedding"], hf_mean_embedding(tiny_llama, long_ids[-10:]), atol=2e-5, rtol=1e-4)
    assert r["usage"]["prompt_tokens"] == 10
    full = post(embed_server, "/v1/embeddings", {"input": long_ids, "truncate_prompt_tokens": -1}).json()
    assert full["usage"]["prompt_tokens"] == EMBED_LEN  # a whole max_model_len prompt is fine for an embedding
    embed_server.wait_idle()


@pytest.mark.slow
def test_embeddings_of_messages(embed_server: ServerProcess, tiny_llama: Path, hf_tok) -> None:
    """vLLM's chat form: one conversation through the chat template (no generation prompt by default)."""
    r = post(embed_server, "/v1/embeddings", {"model": "tiny", "messages": MESSAGES})
    assert r.status_code == 200, r.text
    validate("CreateEmbeddingResponse", r.json())
    ids = render_chat_ids(hf_tok, MESSAGES, add_generation_prompt=False)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], hf_mean_embedding(tiny_llama, ids), atol=2e-5, rtol=1e-4)
    r = post(embed_server, "/v1/embeddings", {"messages": MESSAGES, "add_generation_prompt": True})
    assert r.json()["usage"]["prompt_tokens"] == len(render_chat_ids(hf_tok, MESSAGES))
    assert_error(post(embed_server, "/v1/embeddings", {"messages": MESSAGES, "input": "x"}), 400, "input", says="exactly one")
    assert_error(post(embed_server, "/v1/embeddings", {"input": "x", "add_generation_prompt": True}), 400, "add_generation_prompt")
    assert_error(post(embed_server, "/v1/embeddings", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}), 400, "chat_template")
    assert_error(post(embed_server, "/v1/embeddings", {"messages": []}), 400, "messages")


@pytest.mark.slow
def test_embeddings_bad_input(embed_server: ServerProcess) -> None:
    def embed(body: dict) -> httpx.Response:  # type: ignore[type-arg]
        return post(embed_server, "/v1/embeddings", body)

    for bad in ("", [], [""], [[]], [1, "a"], 5, {"a": 1}, [True]):
        assert_error(embed({"input": bad}), 400, "input")
    assert_error(embed({}), 400, "input")
    assert_error(embed({"input": "x", "dimensions": EMBED_LEN + 1}), 400, "dimensions", says="more than this model's")
    assert_error(embed({"input": "x", "dimensions": 0}), 400, "dimensions", says="positive integer")
    assert_error(embed({"input": ["x"] * 2049}), 400, "input", says="more than the 2048")
    assert_error(embed({"input": "x", "encoding_format": "int8"}), 400, "encoding_format")
    assert_error(embed({"input": [10**6]}), 400, "input", says="out of range")
    assert_error(embed({"input": list(range(3, 3 + EMBED_LEN + 1))}), 400, "input", says="maximum context length")
    assert_error(embed({"input": "x", "truncate_prompt_tokens": 0}), 400, "truncate_prompt_tokens")
    assert_error(embed({"input": "x", "truncate_prompt_tokens": EMBED_LEN + 1}), 400, "truncate_prompt_tokens")
    assert_error(embed({"input": "x", "model": "nope"}), 404, "model")
    assert_error(embed({"input": "x", "unknown": 1}), 400, "unknown")
    assert embed({"input": "x", "user": "u-1"}).status_code == 200
    embed_server.wait_idle()


@pytest.mark.slow
def test_generation_refused_under_task_embed(embed_server: ServerProcess) -> None:
    r = post(embed_server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert_error(r, 400, says="task 'embed'")
    r = post(embed_server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES})
    assert_error(r, 400, says="--task generate")
    assert post(embed_server, "/tokenize", {"prompt": "hi"}).status_code == 200  # the utilities serve both tasks


@pytest.mark.slow
def test_base64_is_not_the_schema_float_list(embed_server: ServerProcess) -> None:
    """OpenAI's schema types `embedding` as floats: a base64 body matches once decoded."""
    body = post(embed_server, "/v1/embeddings", {"input": "x", "encoding_format": "base64"}).json()
    with pytest.raises(ValidationError):
        validate("CreateEmbeddingResponse", body)
    for d in body["data"]:
        d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
    validate("CreateEmbeddingResponse", body)
